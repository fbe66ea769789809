"""``similarity``: the position-position structure of an encoding, and how much of it
is a function of ``i - j`` alone.

Two views per model:

* ``gram`` — ``p_i·p_j`` for the vectors an input-stage encoding produces:
  ``embed(0, pos)`` for additive encodings (``embed(1, pos)`` when that does not vary with
  position, as for a multiplicative or a convolutional one; ``embed`` of one constant token id for encodings that build
  the embedding). For sinusoidal, ``p_i·p_j = Σ_k cos((i - j)ω_k)`` exactly (Vaswani et
  al. 2017, §3.5: ``PE_{pos+k}`` is a linear function of ``PE_pos``), so the share is 1
  up to float rounding.
* ``logits`` — the first layer's attention logits when every token is the same (mean over
  8 constant tokens and the heads): what position alone does to the scores after
  LayerNorm, ``W_Q``, ``W_K``, rotations, vector terms and biases. Causal models use the
  visible triangle only.

The number reported is :func:`~.stats.diagonal_share`, the variance explained by the
mean along each diagonal; ``offdiag`` leaves the main diagonal (the norms) out. Noise of
``L×L`` i.i.d. entries scores about ``2/L`` by chance.
"""

from __future__ import annotations

import torch

from ..base import Stage
from ..output import panel_grid, save_figure
from .models import Subject
from .scores import attention_scores, causal_mask
from .stats import diagonal_share


@torch.no_grad()
def position_vectors(model, L: int) -> tuple[torch.Tensor | None, str]:
    """``(L, D)`` position vectors of the model's input stage, or None, and how they were made."""
    pos = torch.arange(L).unsqueeze(0)
    enc = model.input_encoding
    if enc is None:
        first = model.blocks[0].attn.encoding
        enc = first if first.stages & Stage.INPUT else None
    if enc is None:
        return None, "no input stage"
    if enc.input_at == "tokens":
        return enc.embed(torch.zeros(1, L, dtype=torch.long), pos)[0].float(), "embed(constant token id)"
    zeros = torch.zeros(1, L, model.dim)
    p = enc.embed(zeros, pos)[0].float()
    if float((p - p[:1]).abs().max()) > 0:  # depends on position: an additive encoding
        return p, "embed(0, pos)"
    # zero content gives nothing that varies with position (x ⊙ p, or a convolution of x
    # with zero padding): probe with constant content instead
    return enc.embed(torch.ones(1, L, model.dim), pos)[0].float(), "embed(1, pos)"


@torch.no_grad()
def position_logits(model, L: int, *, n_tokens: int = 8) -> torch.Tensor:
    """Layer-0 logits with constant content, mean over ``n_tokens`` tokens and heads: ``(L, L)``."""
    acc = torch.zeros(L, L)
    n = min(n_tokens, model.vocab_size)
    for t in range(n):
        tokens = torch.full((1, L), t, dtype=torch.long)
        acc += attention_scores(model, tokens)[0][0].mean(0)  # (L, L)
    return acc / n


def run_similarity(subjects: list[Subject], *, length=64) -> list[dict]:
    results = []
    for sub in subjects:
        m = sub.model
        L = min(length, m.max_len or length)
        p, how = position_vectors(m, L)
        entry = {"label": sub.label, "encoding": sub.name, "source": sub.source, "length": L, "vectors": how}
        entry["causal"] = m.causal
        if p is not None:
            gram = p @ p.t()  # (L, L)
            entry["gram"] = gram.tolist()
            entry["gram_share"] = diagonal_share(gram)
            entry["gram_share_offdiag"] = diagonal_share(gram, skip_main=True)
        logits = position_logits(m, L)
        keep = causal_mask(m, L)
        entry["logits"] = logits.tolist()
        entry["logits_variance"] = float(logits[keep].var() if keep is not None else logits.var())
        entry["logits_share"] = diagonal_share(logits, keep=keep)
        entry["logits_share_offdiag"] = diagonal_share(logits, keep=keep, skip_main=True)
        results.append(entry)
    return results


def plot_similarity(results: list[dict], path, *, subtitle: str | None = None) -> None:
    fig, axes_of = panel_grid(len(results), 2, 3)
    for row, r in enumerate(results):
        for col, key in enumerate(("gram", "logits")):
            ax = axes_of(row)[col]
            ax.set_xticks([])
            ax.set_yticks([])
            if key not in r:
                ax.text(0.5, 0.5, f"{r['label']}:\n{r['vectors']}", ha="center", va="center", fontsize=9)
                ax.set_frame_on(False)
                continue
            m = torch.tensor(r[key])
            if key == "logits" and r["causal"]:  # the model never sees the upper triangle
                m = m.masked_fill(~torch.ones_like(m, dtype=torch.bool).tril(), float("nan"))
            im = ax.imshow(m.numpy(), cmap="viridis")
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
            title = "p_i·p_j" if key == "gram" else "layer-0 logits, constant content"
            ax.set_title(f"{r['label']}: {title}\ndiagonal share {_share(r[key + '_share'])}", fontsize=8)
            ax.set_xlabel("j", fontsize=8)
            ax.set_ylabel("i", fontsize=8)
    title = "Position-position structure and the share of it that is a function of i - j"
    save_figure(fig, path, title=title, subtitle=subtitle)


def _share(v: float | None) -> str:
    return "n/a (constant)" if v is None else f"{v:.3f}"
