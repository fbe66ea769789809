"""``decompose``: split attention logits into content and position terms.

For an additive absolute encoding, ``q_i = (x_i + p_i)W_Q`` and ``k_j = (x_j + p_j)W_K``,
so ``q_i·k_j`` is the sum of content·content, content·position, position·content and
position·position (Ke et al., "Rethinking Positional Encoding in Language Pre-training"
(TUPE), ICLR 2021, §2). The model normalises ``x + p`` first; LayerNorm is linear once its
per-token mean and deviation are fixed, so with ``σ_i`` from the sum the split is exact:
``LN(x+p) = [γ(x - x̄)/σ + β] + [γ(p - p̄)/σ]`` (β goes with the content).

The same split for encodings that keep other terms, read from the stage interface:

* ``rotate`` is linear in ``q``/``k``, so each input term is rotated separately;
* ``score_terms(q, k)`` is split by evaluating it with ``q`` or ``k`` set to zero:
  ``T(0,0)`` (relative·relative, Transformer-XL's ``v·W_R R``), ``T(q,0) - T(0,0)``
  (query·relative, c2p), ``T(0,k) - T(0,0)`` (relative·key, p2c, XL's ``u·k``) and the
  rest (terms that multiply ``q`` and ``k``, e.g. CoPE's gates);
* ``bias`` is a position-only term (T5, ALiBi, TUPE's position-position term).

Each term's share is ``Var(term) / Σ_t Var(t)`` over the visible ``(b, h, i, j)`` entries.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..attend.scores import expand_kv, scores
from ..base import Stage
from ..output import pyplot, save_figure
from .models import Subject
from .scores import causal_mask, layer_inputs, score_parts
from .stats import masked_values

TERM_ORDER = (
    "content·content",
    "content·position",
    "position·content",
    "position·position",
    "query·rel (c2p)",
    "rel·key (p2c)",
    "rel·rel",
    "terms rest",
    "bias",
)


def _ln_split(ln, c: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
    """``ln(c + p)`` as ``(content, position)`` parts that sum to it exactly."""
    x = c + p
    sigma = torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + ln.eps)
    w = ln.weight if ln.weight is not None else 1.0
    b = ln.bias if ln.bias is not None else 0.0
    content = w * (c - c.mean(-1, keepdim=True)) / sigma + b
    position = w * (p - p.mean(-1, keepdim=True)) / sigma
    return content, position


def input_split(model, layer: int, tokens: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, str]:
    """The attention input of ``layer`` as ``(content, position)`` and how it was split."""
    attn = model.blocks[layer].attn
    enc = attn.encoding
    x = layer_inputs(model, tokens, pos)[layer]
    ln = model.blocks[layer].ln1
    if layer == 0 and model.input_encoding is not None and model.tok_emb is not None:
        c = model.tok_emb(tokens)  # (B, L, D)
        return (*_ln_split(ln, c, x - c), "x + p at the embeddings, split through ln1")
    h = ln(x)
    if model.blocks[layer].layer_input:
        return h, attn.embed_input(h, attn.make_call(h, pos)) - h, "embed(h) - h inside the layer"
    how = "no input stage" if not enc.stages & Stage.INPUT else f"layer {layer} > 0: position already mixed in"
    if model.tok_emb is None:
        how = "the encoding builds the embedding: content and position not separable"
    return h, torch.zeros_like(h), how


@torch.no_grad()
def decompose_terms(model, tokens: Tensor, *, layer: int = 0) -> tuple[dict[str, Tensor], str, float]:
    """The logits of ``layer`` as named ``(B, H, L, L)`` terms.

    Returns ``(terms, how the input was split, max |total - Σ terms|)``.
    """
    B, L = tokens.shape
    pos = torch.arange(L).unsqueeze(0)
    attn = model.blocks[layer].attn
    enc = attn.encoding
    if attn.q_norm is not None or enc.softcap is not None:
        what = f"qk_norm={attn.qk_norm!r}" if attn.q_norm is not None else f"softcap={enc.softcap}"
        raise ValueError(f"layer {layer} has {what}: its logits are not a sum of content and position terms")
    c, p, how = input_split(model, layer, tokens, pos)
    qc, kc = attn.project(c, attn.make_call(c, pos))[:2]  # rotated; projection biases stay with the content
    qp = (p @ attn.q_proj.weight.t()).view(B, L, attn.heads, attn.head_dim).transpose(1, 2)  # (B, H, L, Dh)
    # grouped k/v: kv_heads key heads (H where the encoding's key side is per head: Attention.key_heads)
    kp = (p @ attn.k_proj.weight.t()).view(B, L, attn.kv_heads, attn.head_dim).transpose(1, 2)
    kp = expand_kv(kp, None, attn.key_heads)[0]  # (B, key_heads, L, Dh)
    if p.any():  # rotations are linear: rotate each part
        qp, kp = enc.rotate(qp, kp, pos, pos)
    else:  # no position in the input: its parts are zero (a non-linear q/k stage, PoPE, maps 0 elsewhere)
        qp, kp = torch.zeros_like(qc), torch.zeros_like(kc)
    kc, kp = expand_kv(kc, None, attn.heads)[0], expand_kv(kp, None, attn.heads)[0]  # (B, H, L, Dh)
    s = enc.scale
    ctx = attn.project(
        c + p, attn.make_call(c, pos)
    ).ctx  # what the layer hands the score side (fox, inkling, path read the input)

    def qk(a, b):  # the q·k term: bilinear in the two (an encoding's own SCORES stage: rope-extension, path)
        return enc.qk_scores(a, b, pos, pos, ctx=ctx) if enc.stages & Stage.SCORES else a @ b.transpose(-1, -2)

    terms = {
        "content·content": qk(qc, kc).float() * s,
        "content·position": qk(qc, kp).float() * s,
        "position·content": qk(qp, kc).float() * s,
        "position·position": qk(qp, kp).float() * s,
    }
    if enc.stages & Stage.TERMS:
        q, k = qc + qp, kc + kp
        zq, zk = torch.zeros_like(q), torch.zeros_like(k)

        def vector_terms(q_, k_):  # scale·score_terms, as posenc.scores splits them
            return scores(enc, q_, k_, pos, pos, qk_proj=(attn.q_proj, attn.k_proj), parts=True)["terms"]

        t00, tq0, t0k, tqk = vector_terms(zq, zk), vector_terms(q, zk), vector_terms(zq, k), vector_terms(q, k)
        terms["query·rel (c2p)"] = tq0 - t00
        terms["rel·key (p2c)"] = t0k - t00
        terms["rel·rel"] = t00
        terms["terms rest"] = tqk - tq0 - t0k + t00
    if enc.stages & Stage.BIAS:
        terms["bias"] = enc.bias(pos, pos, ctx=ctx).float().expand(B, -1, -1, -1)
    x = layer_inputs(model, tokens, pos)[layer]
    total = sum(score_parts(model.blocks[layer], x, pos).values())
    residual = float((total - sum(terms.values())).abs().max())
    return terms, how, residual


@torch.no_grad()
def run_decompose(subjects: list[Subject], *, length=64, batch=8, layer=0, seed=0) -> list[dict]:
    """Variance shares of every term for each subject (random tokens as content)."""
    results = []
    for sub in subjects:
        g = torch.Generator().manual_seed(seed)
        L = min(length, sub.model.max_len or length)
        tokens = torch.randint(0, sub.model.vocab_size, (batch, L), generator=g)
        terms, how, residual = decompose_terms(sub.model, tokens, layer=layer)
        mask = causal_mask(sub.model, L)
        var = {k: float(masked_values(v, mask).double().var()) for k, v in terms.items()}
        total_var = sum(var.values())
        shares = {k: (v / total_var if total_var > 0 else 0.0) for k, v in var.items()}
        # drop terms that are identically zero for this encoding (e.g. no position part)
        # (relative to the largest term, so float noise such as 1e-16 remainders is not a term)
        big = max(float(t.abs().max()) for t in terms.values())
        present = {k: shares[k] for k in TERM_ORDER if k in terms and float(terms[k].abs().max()) > 1e-6 * big}
        results.append(
            {
                "label": sub.label,
                "encoding": sub.name,
                "source": sub.source,
                "layer": layer,
                "length": L,
                "split": how,
                "shares": present,
                "variance": {k: var[k] for k in present},
                "residual_max_abs": residual,
            }
        )
    return results


def plot_decompose(results: list[dict], path, *, subtitle: str | None = None) -> None:
    plt = pyplot()
    names = [t for t in TERM_ORDER if any(t in r["shares"] for r in results)]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(results) + 1.6))
    colors = plt.get_cmap("tab10")
    for row, r in enumerate(results):
        left = 0.0
        for k, t in enumerate(names):
            w = r["shares"].get(t, 0.0)
            ax.barh(row, w, left=left, color=colors(k), label=t if row == 0 else None)
            left += w
    for k, t in enumerate(names):  # legend entries for terms absent from the first row
        ax.barh(0, 0, color=colors(k), label=t)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=True))
    fig.legend(uniq.values(), uniq.keys(), loc="outside lower center", ncol=4, fontsize=8)
    ax.set_yticks(range(len(results)), [_label(r) for r in results])
    ax.set_ylim(len(results) - 0.5, -0.5)  # first row on top
    ax.set_xlim(0, 1)
    ax.set_xlabel(f"share of logit variance, layer {results[0]['layer'] if results else 0}")
    save_figure(fig, path, title="Attention logits split into content and position terms", subtitle=subtitle)


def _label(r: dict) -> str:
    return r["label"] + (" (random)" if r["source"] == "random" else "")
