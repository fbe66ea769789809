"""``invariance``: how much do attention logits and probabilities change when every
position shifts by ``s``?

A relative encoding (``enc.relative``) leaves them unchanged up to float rounding; an
absolute one shows how far from translation invariant it is. For an additive absolute
encoding the change comes from the content·position and position·position terms (see
:mod:`.decompose`), the "noise" Ke et al. (TUPE, ICLR 2021) argue about; comparing a
random model with a trained one shows what training does to it.

Measured on every layer with the same random tokens at positions ``0..L-1`` and
``s..s+L-1``; the change is ``‖new - ref‖ / ‖ref‖`` over the visible entries, and the
reported number is the largest over layers. Encodings that do not extrapolate use
``L ≤ max_len / 2`` and are only shifted up to ``max_len - L``.

Encodings that read positions with axes (``mrope``, ``rope@{"axes": 2}``, ...) get grid
positions (:func:`posenc.positions.grid`, about ``L`` cells) and are shifted on every axis
at once (the headline number) and on each axis alone (``per_axis``): a relative encoding
is unchanged along each axis.
"""

from __future__ import annotations

import torch

from ..positions import grid
from .models import Subject
from .scores import attention_scores, causal_mask
from .stats import masked_values, rel_change

DEFAULT_SHIFTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@torch.no_grad()
def shift_change(
    model, tokens, shift: int, *, pos: torch.Tensor | None = None, axis: int | None = None
) -> tuple[list[float], list[float]]:
    """Per-layer relative change of logits and of probabilities under a shift of ``shift``.

    ``pos``: the reference positions, ``(1, L)`` (default ``arange``) or ``(1, L, A)``;
    ``axis``: shift only that coordinate of positions with axes (default: every one).
    """
    L = tokens.shape[1]
    pos = torch.arange(L).unsqueeze(0) if pos is None else pos
    moved = pos + shift
    if axis is not None:
        moved = pos.clone()
        moved[..., axis] += shift
    mask = causal_mask(model, L)
    ref = attention_scores(model, tokens, pos)
    new = attention_scores(model, tokens, moved)
    d_logit, d_prob = [], []
    for a, b in zip(ref, new, strict=True):
        d_logit.append(rel_change(masked_values(b, mask), masked_values(a, mask)))
        if mask is not None:
            a, b = a.masked_fill(~mask, float("-inf")), b.masked_fill(~mask, float("-inf"))
        d_prob.append(rel_change(torch.softmax(b, -1), torch.softmax(a, -1)))
    return d_logit, d_prob


def grid_positions(length: int, axes: int) -> torch.Tensor:
    """``(1, N, A)`` positions of a grid of about ``length`` cells: side ``ceil(length^(1/A))``."""
    side = max(1, round(length ** (1 / axes)))
    return grid(*([side] * axes)).unsqueeze(0)


def run_invariance(subjects: list[Subject], *, shifts=DEFAULT_SHIFTS, length=32, batch=4, seed=0) -> list[dict]:
    results = []
    for sub in subjects:
        m = sub.model
        axes = m.blocks[0].attn.encoding.axes
        pos = grid_positions(length, axes) if axes > 1 else None
        L = length if pos is None else pos.shape[1]
        limit = None
        if any(not e.extrapolates for e in m.encodings) and m.max_len:
            if pos is None:
                L = min(length, m.max_len // 2)  # leave room to shift inside the table
            limit = m.max_len - (L if pos is None else int(pos.max()) + 1)
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, m.vocab_size, (batch, L), generator=g)
        rows = []
        for s in shifts:
            if limit is not None and s > limit:
                continue
            d_logit, d_prob = shift_change(m, tokens, s, pos=pos)
            row = {"shift": s, "logits": max(d_logit), "probs": max(d_prob), "per_layer_logits": d_logit}
            if axes > 1:
                row["per_axis"] = []
                for a in range(axes):
                    a_logit, a_prob = shift_change(m, tokens, s, pos=pos, axis=a)
                    row["per_axis"].append({"axis": a, "logits": max(a_logit), "probs": max(a_prob)})
            rows.append(row)
        results.append(
            {
                "label": sub.label,
                "encoding": sub.name,
                "source": sub.source,
                "relative": bool(all(e.relative for e in m.encodings)),
                "axes": axes,
                "length": L,
                "max_shift": limit,
                "shifts": rows,
            }
        )
    return results


def plot_invariance(results: list[dict], path, *, floor=1e-9, subtitle: str | None = None) -> None:
    from ..output import length_axis, pyplot, readable_log_axis, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    names = list(dict.fromkeys(r["encoding"] for r in results))
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    for r in results:
        xs = [row["shift"] for row in r["shifts"]]
        style = "-" if r["source"] == "random" else "--"
        color = cmap(names.index(r["encoding"]) % cmap.N)
        kind = "relative" if r["relative"] else "absolute"
        for ax, key in zip(axes, ("logits", "probs"), strict=True):
            ys = [max(row[key], floor) for row in r["shifts"]]
            ax.plot(xs, ys, style, color=color, marker="o", ms=3, label=f"{r['label']} [{kind}]")
            for a in range(r.get("axes", 1) if r.get("axes", 1) > 1 else 0):  # each axis alone
                ys = [max(row["per_axis"][a][key], floor) for row in r["shifts"]]
                ax.plot(xs, ys, ":", color=color, marker="1234"[a % 4], ms=5, label=f"{r['label']} axis {a}")
    for ax, (k, key) in zip(axes, (("logits", "attention logits"), ("probs", "attention probabilities")), strict=True):
        length_axis(ax, [row["shift"] for r in results for row in r["shifts"]])
        readable_log_axis(ax, [max(row[k], floor) for r in results for row in r["shifts"]])
        ax.axhline(1e-5, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("shift s of every position")
        ax.set_ylabel(f"relative change of {key}")
        ax.set_title(f"{key}: ‖Δ‖/‖·‖ (floor {floor:g})")
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    title = (
        "Translation invariance (solid: random weights, dashed: trained; dotted with markers: one axis of "
        "grid positions shifted alone; grey line: 1e-5)"
    )
    save_figure(fig, path, title=title, subtitle=subtitle)
