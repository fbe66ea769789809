"""``attention-maps``: attention of trained models at their training length and at 4×.

The input is one sequence of a random block repeated (period 7, the kind of data
:func:`~.models.train_tiny` trains on; ``--data random`` for i.i.d. tokens), so a model
that learned to look back one period shows off-diagonal stripes. Each map is the mean
over heads of one layer. Two numbers per map: the mean attention entropy divided by
``log(#visible keys)`` (1 = uniform) and the mean attended distance ``Σ_j a_ij (i - j)``.
An encoding that does not extrapolate gets a note at 4× instead of a map.
"""

from __future__ import annotations

import torch

from ..output import panel_grid, save_figure
from .models import Subject
from .scores import attention_probs, causal_mask
from .stats import distances


def sequence(kind: str, length: int, vocab: int, seed: int, period: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randint(0, vocab, (1, length), generator=g)
    if kind != "repeat":
        raise ValueError(f"data must be 'repeat' or 'random', got {kind!r}")
    block = torch.randint(0, vocab, (period,), generator=g)
    return block.repeat(length // period + 1)[:length].unsqueeze(0)


@torch.no_grad()
def map_stats(model, tokens: torch.Tensor, layer: int) -> tuple[torch.Tensor, float, float]:
    """``(L, L)`` head-mean attention of ``layer``, normalised entropy, mean distance."""
    L = tokens.shape[1]
    p = attention_probs(model, tokens)[layer][0].double()  # (H, L, L)
    mask = causal_mask(model, L)
    n_visible = mask.sum(-1).double() if mask is not None else torch.full((L,), float(L))
    ent = -(p * p.clamp_min(1e-30).log()).sum(-1)  # (H, L)
    norm = torch.where(n_visible > 1, n_visible.log(), torch.ones_like(n_visible))
    rows = n_visible > 1
    entropy = float((ent / norm)[:, rows].mean())
    dist = float((p * distances(L).abs().double()).sum(-1).mean())
    return p.mean(0).float(), entropy, dist


def run_attention_maps(subjects: list[Subject], notes: list[str], *, factor=4, layer=-1, data="repeat", seed=0):
    results = []
    for sub in subjects:
        m = sub.model
        lay = layer % m.depth
        entry = {"label": sub.label, "encoding": sub.name, "source": sub.source, "layer": lay, "maps": []}
        for L in (sub.train_len, factor * sub.train_len):
            tokens = sequence(data, L, m.vocab_size, seed)
            try:
                att, ent, dist = map_stats(m, tokens, lay)
            except ValueError as e:  # past max_len of an encoding that does not extrapolate
                notes.append(f"{sub.label} at L={L}: {e}")
                entry["maps"].append({"length": L, "error": str(e)})
                continue
            entry["maps"].append({"length": L, "entropy": ent, "mean_distance": dist, "attention": att.tolist()})
        results.append(entry)
    return results


def plot_attention_maps(results: list[dict], path, *, subtitle: str | None = None) -> None:
    fig, axes_of = panel_grid(len(results), 2, 2, size=(3.6, 3.2))
    for row, r in enumerate(results):
        for col, mp in enumerate(r["maps"]):
            ax = axes_of(row)[col]
            ax.set_xticks([])
            ax.set_yticks([])
            if "error" in mp:
                ax.text(0.5, 0.5, f"{r['label']}, L={mp['length']}:\ndoes not extrapolate", ha="center", va="center")
                ax.set_frame_on(False)
                continue
            a = torch.tensor(mp["attention"]).clamp_min(1e-4).log10().numpy()
            im = ax.imshow(a, cmap="magma", vmin=-4, vmax=0)
            ax.set_title(
                f"{r['label']} L={mp['length']} layer {r['layer']}\n"
                f"entropy {mp['entropy']:.2f}, mean dist {mp['mean_distance']:.1f}",
                fontsize=8,
            )
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02, label="log10 attention")
    save_figure(fig, path, title=f"Attention at the training length and at {_factor(results)}× it", subtitle=subtitle)


def _factor(results: list[dict]) -> str:
    for r in results:
        if len(r["maps"]) == 2:
            return f"{r['maps'][1]['length'] / r['maps'][0]['length']:g}"
    return "?"
