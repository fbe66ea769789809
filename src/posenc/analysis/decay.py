"""``decay``: how attention falls off with distance.

Three curves, each drawn for the encodings it applies to:

* ``bound`` — rotary encodings with angular frequencies ``inv_freq`` (RoPE at any base or
  ``rope_scaling``): Su et al. (RoFormer, 2021, §3.4.3) bound ``|Σ_k h_k e^{i m θ_k}|`` by
  Abel summation, ``≤ max_k |h_{k+1} - h_k| · Σ_j |S_j|`` with ``S_j = Σ_{k<j} e^{i m θ_k}``,
  and plot the *relative upper bound* ``(1/(d/2)) Σ_{j=1}^{d/2} |S_j|`` against the
  distance ``m``. It is computed here from the encoding's own ``inv_freq``.
* ``ones`` — every encoding with a q/k stage (RoPE, xPos, ...), through ``rotate`` only:
  ``q̃_m·k̃_0 / q·k`` for ``q = k = 1``, the all-equal ``h_k`` case of the bound; xPos's
  scale decay shows up here without knowing its formula.
* ``bias`` — scalar-bias encodings (ALiBi, T5, Kerple, FIRE): ``bias`` of the last query
  against every key, mean over heads, against ``i - j``; for a bias computed from the hidden
  state (FoX, Inkling), the first layer's, on random tokens, mean over the batch too.
* ``attention`` — every encoding: the measured attention ``a_ij`` times the number of
  keys query ``i`` sees (1 = uniform attention), averaged over batch, heads, layers and
  every query at distance ``i - j``, on random tokens.
"""

from __future__ import annotations

import torch

from ..base import Stage
from .models import Subject
from .scores import attention_probs, causal_mask, layer_inputs, score_parts
from .stats import distances


def su_bound(inv_freq: torch.Tensor, max_distance: int) -> torch.Tensor:
    """RoFormer's relative upper bound ``(1/K) Σ_{j=1}^{K} |Σ_{k<j} e^{i m θ_k}|``, m = 0..max_distance."""
    m = torch.arange(max_distance + 1, dtype=torch.float64)
    ang = m[:, None] * inv_freq.double()[None, :]  # (M, K)
    partial = torch.polar(torch.ones_like(ang), ang).cumsum(-1)  # S_j for j = 1..K, (M, K)
    return partial.abs().mean(-1)


@torch.no_grad()
def ones_curve(enc, max_distance: int) -> torch.Tensor:
    """``q̃_m·k̃_0 / q·k`` with ``q = k = 1`` through ``enc.rotate``, m = 0..max_distance."""
    M = max_distance + 1
    q = torch.ones(1, enc.heads, M, enc.head_dim)
    k = torch.ones(1, enc.heads, M, enc.head_dim)
    q_pos = torch.arange(M).unsqueeze(0)
    k_pos = torch.zeros(1, M, dtype=torch.long)
    qr, kr = enc.rotate(q, k, q_pos, k_pos)
    return ((qr * kr).sum(-1) / enc.head_dim).mean(1)[0].double()  # (M,)


@torch.no_grad()
def bias_curve(enc, length: int) -> torch.Tensor:
    """``bias`` of query ``L-1`` against keys ``L-1-d``, mean over heads, d = 0..L-1."""
    pos = torch.arange(length)
    b = enc.bias(pos[-1:], pos)  # (H, 1, L)
    return b[:, 0].float().mean(0).flip(0).double()  # index d = i - j


@torch.no_grad()
def input_bias_curve(model, tokens) -> torch.Tensor:
    """For a bias computed from the hidden state (FoX, Inkling): block 0's bias of the last
    query against keys ``L-1-d`` on ``tokens``, as its forward hands it the context, mean
    over batch and heads, d = 0..L-1."""
    pos = torch.arange(tokens.shape[1]).unsqueeze(0)
    b = score_parts(model.blocks[0], layer_inputs(model, tokens, pos)[0], pos)["bias"]  # (B, H, L, L)
    return b[:, :, -1].float().mean((0, 1)).flip(0).double()


@torch.no_grad()
def attention_curve(model, tokens) -> torch.Tensor:
    """Mean of ``a_ij × #visible keys`` per distance ``d = i - j ≥ 0`` over layers, heads, batch."""
    L = tokens.shape[1]
    mask = causal_mask(model, L)
    visible = mask.sum(-1, keepdim=True).double() if mask is not None else torch.full((L, 1), float(L))
    d = distances(L)  # (L, L) i - j
    keep = d >= 0
    sums = torch.zeros(L, dtype=torch.float64)
    count = 0
    for p in attention_probs(model, tokens):
        rel = (p.double() * visible).mean((0, 1))  # (L, L)
        sums += torch.zeros(L, dtype=torch.float64).index_add_(0, d[keep], rel[keep])
        count += 1
    n = torch.zeros(L, dtype=torch.float64).index_add_(0, d[keep], torch.ones(int(keep.sum()), dtype=torch.float64))
    return sums / (n * count)


def run_decay(subjects: list[Subject], notes: list[str], *, length=256, max_distance=2048, batch=2, seed=0):
    results = []
    for sub in subjects:
        m = sub.model
        enc = m.blocks[0].attn.encoding
        entry = {"label": sub.label, "encoding": sub.name, "source": sub.source}
        if enc.stages & Stage.QK:
            if isinstance(getattr(enc, "inv_freq", None), torch.Tensor):
                entry["bound"] = su_bound(enc.inv_freq, max_distance).tolist()
            else:
                notes.append(f"{sub.label}: no inv_freq, so no RoFormer bound (the 'ones' curve still applies)")
            entry["ones"] = ones_curve(enc, max_distance).tolist()
        L = min(length, m.max_len or length)
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, m.vocab_size, (batch, L), generator=g)
        if enc.stages & Stage.BIAS:
            curve = input_bias_curve(m, tokens) if enc.defines("read_input") else bias_curve(enc, length)
            entry["bias"] = curve.tolist()
        entry["attention"] = attention_curve(m, tokens).tolist()
        results.append(entry)
    return results


def summarize(entry: dict) -> dict:
    """A few numbers per curve for the printed table."""
    out = {}
    if "bound" in entry:
        b = entry["bound"]
        out["bound@0"] = b[0]
        for d in (64, 512, 2048):
            if d < len(b):
                out[f"bound@{d}"] = b[d]
    if "ones" in entry:
        o = entry["ones"]
        for d in (64, 512):
            if d < len(o):
                out[f"ones@{d}"] = o[d]
    if "bias" in entry:
        b = entry["bias"]
        out["bias@1-bias@0"] = b[1] - b[0] if len(b) > 1 else 0.0
        out[f"bias@{len(b) - 1}-bias@0"] = b[-1] - b[0]
    a = entry["attention"]
    out["attn@0"] = a[0]
    out[f"attn@{len(a) - 1}"] = a[-1]
    return out


def plot_decay(results: list[dict], path, *, subtitle: str | None = None) -> None:
    from ..output import pyplot, readable_log_axis, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = [
        ("bound", axes[0][0], "RoFormer relative upper bound (1/K)Σ|S_j|", "linear"),
        ("ones", axes[0][1], "q̃_m·k̃_0 / q·k with q = k = 1 (through rotate)", "linear"),
        ("bias", axes[1][0], "bias vs distance i - j (mean over heads)", "linear"),
        ("attention", axes[1][1], "measured attention × visible keys (1 = uniform)", "log"),
    ]
    for key, ax, title, yscale in panels:
        drawn = False
        for r in results:
            if key in r:
                ax.plot(r[key], lw=1, label=r["label"])
                drawn = True
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("distance m = i - j")
        ax.set_xscale("symlog", linthresh=16)
        if yscale == "log":
            readable_log_axis(ax, [v for r in results for v in r.get(key, [])])
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no encoding with this stage", ha="center", va="center", transform=ax.transAxes)
    save_figure(fig, path, title="Long-range decay", subtitle=subtitle)
