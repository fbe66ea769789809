"""One softmax per row from several parts: fused flash calls, strips and explicit bands.

:class:`SegmentAttention` runs a :class:`~posenc.kernels.plan.Plan`: each flash call
attends a block of rows to a key range with the fused CPU kernel (unmasked, or causal
top-left), strips and bands are computed explicitly (:mod:`.strip`, :mod:`.band`); the
parts are merged by log-sum-exp. Backward replays the plan: every flash call gets the
merged output and log-sum-exp (so its ``dS = P ∘ (dP - D)`` is that of the whole
softmax); strips and bands reuse their kept probabilities or recompute them. Saved for
backward: the inputs, the output, ``lse`` and (within ``keep_bytes``) the probabilities
of the explicit parts.

Far-field variants: a call on the ``"left"`` or ``"right"`` side uses that side's
``(q, k, v)`` (the caller folds constant terms into them, e.g. Shaw's ``k + aK[-K]``,
``v + aV[-K]``), or the base tensors when the caller passes none. With linear terms
(ALiBi) a call appends a key column ``slope·(j - J)/scale`` centred on its block's key
``J`` (queries get a column of ones, values one of zeros) and adds the row constant
``slope·(J - i + delta)`` to its log-sum-exp: magnitudes stay bounded by the distance to
the block, not the position. In bfloat16 and float16 the column is split into a high and
a low half (two columns) to keep float32 accuracy.

Keys too far to count (linear terms): with a decaying slope ``m`` (ALiBi) and no key
padding, row ``i``'s log-sum-exp is at least its own key's score ``scale·q_i·k_i`` (bias 0
at ``d = 0``), so a key at distance ``|d|`` has weight at most
``exp(2·scale·max|q|·max|k| − |m·d|)`` (Cauchy–Schwarz, per head). Each unmasked flash call
leaves out, per head, the keys where that bound is below ``e^-90``, under float32's
smallest normal ``2^-126``: their summed weight is below ``Lk·2^-126``, some ``2^-100``
of the output's own rounding at any practical ``Lk``, and they are exactly the keys whose
weights would be denormal (slow on x86 for a thread that does not flush them) or 0. The
steep heads then attend a band of ``(90 + 2·scale·max|q|·max|k|)/m`` keys instead of
every key (:func:`_cutoffs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .band import Tables, band_backward, band_forward
from .flash import flash_backward, flash_forward, flush_denormals, merge_into, safe_lse
from .plan import FlashCall, Plan
from .strip import StripTables, key_logits, key_logits_backward, strip_backward, strip_forward

__all__ = ["SegmentConfig", "SegmentAttention"]

_NAMES = ("q", "k", "v", "qL", "kL", "vL", "qR", "kR", "vR", "q_rel", "bias", "rel_k", "rel_q", "rel_v")


@dataclass
class SegmentConfig:
    """What the plan needs besides tensors with gradients."""

    plan: Plan
    tables: Tables  # band metadata (lo, n, clamp, rows); the tensors themselves are inputs
    scale: float
    key_padding_mask: Tensor | None = None  # (B, Lk) bool, True = attend
    slope_left: Tensor | None = None  # (H,) float32, linear terms only (no gradient)
    slope_right: Tensor | None = None
    keep_bytes: int = 256 * 2**20  # explicit parts whose probabilities fit are kept for backward
    cut_keys: bool = True  # linear terms: leave out keys whose weight is provably < 2^-126 (module doc)


# a key whose weight is provably below e^-CUT_LOGIT is left out: e^-90 < 2^-129, below
# float32's smallest normal 2^-126 with a margin for the kernel's own rounding of the score
CUT_LOGIT = 90.0


def _cutoffs(cfg: SegmentConfig, t: dict) -> tuple[list, list] | None:
    """Per head, the largest ``|d|`` still attended on the left and on the right (None: all).

    None for the whole call when the bound of the module doc does not hold: no linear
    call, key padding (a row's own key may be padded), or a row whose own key (``d = 0``)
    is not among its visible keys.
    """
    plan, g = cfg.plan, cfg.plan.geometry
    if not cfg.cut_keys or cfg.key_padding_mask is not None or cfg.slope_left is None:
        return None
    if not any(c.centre is not None and not c.causal for c in plan.calls):
        return None
    own_key = g.delta <= 0 and g.Lq - 1 - g.delta <= g.Lk - 1 and (not g.causal or -g.delta <= g.offset)
    if not own_key:
        return None
    with torch.no_grad():
        qn = t["q"].float().norm(dim=-1).amax(dim=(0, 2))  # (H,)
        kn = t["k"].float().norm(dim=-1).amax(dim=(0, 2))
        reach = (CUT_LOGIT + 2 * cfg.scale * qn * kn).tolist()
    left, right = cfg.slope_left.float().tolist(), cfg.slope_right.float().tolist()
    cut_l = [int(r / m) if m > 0 and math.isfinite(r / m) else None for r, m in zip(reach, left)]
    cut_r = [int(r / -m) if m < 0 and math.isfinite(r / -m) else None for r, m in zip(reach, right)]
    return cut_l, cut_r


def _head_groups(call: FlashCall, cuts, delta: int, H: int) -> list[tuple[slice, slice]]:
    """``(heads, keys within the call)`` pieces of one flash call: per head, the call's keys
    that some row of it still attends under ``cuts`` (:func:`_cutoffs`); runs of heads with
    the same range share a piece; heads with no key left get none."""
    n = call.k1 - call.k0
    if cuts is None or call.centre is None or call.causal or call.flip:
        return [(slice(None), slice(None))]
    cut = cuts[0] if call.side == "left" else cuts[1]
    ranges = []
    for h in range(H):
        a, b = 0, n
        if cut[h] is not None:
            if call.side == "left":  # key j is attended by row r0 iff r0 - j - delta <= cut
                a = min(n, max(0, call.r0 - delta - cut[h] - call.k0))
            else:  # key j is attended by row r1 - 1 iff j - (r1 - 1) + delta <= cut
                b = max(0, min(n, call.r1 - 1 - delta + cut[h] + 1 - call.k0))
        ranges.append((a, b))
    if all(r == (0, n) for r in ranges):
        return [(slice(None), slice(None))]
    groups, h0 = [], 0
    for h in range(1, H + 1):
        if h == H or ranges[h] != ranges[h0]:
            a, b = ranges[h0]
            if a < b:
                groups.append((slice(h0, h), slice(a, b)))
            h0 = h
    return groups


def _side(t: dict, side: str) -> tuple[str, str, str]:
    """Names of the tensors a call on ``side`` uses (the base ones where no variant is given)."""
    s = "L" if side == "left" else "R"
    return tuple(n + s if t[n + s] is not None else n for n in ("q", "k", "v"))


class _Operands:
    """The tensors of every flash call. With linear terms, ``q, k, v`` extended once by the
    column(s) each call rewrites in place before it runs; for the right staircase, the
    right variant reversed along the sequence, once."""

    def __init__(self, cfg: SegmentConfig, t: dict):
        self.cfg, self.t, self.ext, self.flipped = cfg, t, None, None
        calls = cfg.plan.calls
        if any(c.centre is not None for c in calls):
            q, k, v = t["q"], t["k"], t["v"]
            m = 1 if k.dtype == torch.float32 else 2  # bf16/fp16: a high and a low half
            self.ext = (
                torch.cat([q, q.new_ones(*q.shape[:-1], m)], -1),
                torch.cat([k, k.new_zeros(*k.shape[:-1], m)], -1),
                torch.cat([v, v.new_zeros(*v.shape[:-1], m)], -1),
            )
        if any(c.flip for c in calls):
            self.flipped = tuple(t[n].flip(2) for n in _side(t, "right"))

    def __call__(self, call: FlashCall):
        """``(q, k, v, lse shift or None)`` of one call, in its own (possibly reversed) order."""
        rows, keys = slice(call.r0, call.r1), slice(call.k0, call.k1)
        if call.flip:
            q, k, v = self.flipped
            return q[:, :, rows], k[:, :, keys], v[:, :, keys], None
        if call.centre is None:
            qn, kn, vn = _side(self.t, call.side)
            return self.t[qn][:, :, rows], self.t[kn][:, :, keys], self.t[vn][:, :, keys], None
        cfg = self.cfg
        q, k, v = self.ext
        dh = self.t["k"].shape[-1]
        slope = (cfg.slope_left if call.side == "left" else cfg.slope_right).float()
        H = slope.shape[0]
        j = torch.arange(call.k0 - call.centre, call.k1 - call.centre, device=k.device, dtype=torch.float32)
        col = (slope / cfg.scale).view(1, H, 1) * j  # (1, H, n): slope·(j - J)/scale
        hi = col.to(k.dtype)
        k[:, :, keys, dh] = hi
        if k.shape[-1] > dh + 1:
            k[:, :, keys, dh + 1] = (col - hi.float()).to(k.dtype)
        i = torch.arange(call.r0, call.r1, device=k.device, dtype=torch.float32)
        shift = slope.view(1, H, 1) * (call.centre + cfg.plan.geometry.delta - i)  # (1, H, c)
        return q[:, :, rows], k[:, :, keys], v[:, :, keys], shift

    def names(self, call: FlashCall) -> tuple[str, str, str]:
        return ("q", "k", "v") if call.centre is not None else _side(self.t, call.side)


def _global(call: FlashCall, Lq: int, Lk: int) -> tuple[slice, slice]:
    """The call's rows and keys in the sequence's own order."""
    if call.flip:
        return slice(Lq - call.r1, Lq - call.r0), slice(Lk - call.k1, Lk - call.k0)
    return slice(call.r0, call.r1), slice(call.k0, call.k1)


class _Masks:
    """Key padding as the calls need it: additive mask and prefix counts, forward and reversed."""

    def __init__(self, kpm: Tensor | None, dtype):
        self.kpm = kpm
        if kpm is None:
            return
        self.add = torch.zeros(kpm.shape[0], 1, 1, kpm.shape[1], dtype=dtype, device=kpm.device)
        self.add.masked_fill_(~kpm[:, None, None, :], float("-inf"))
        self.counts = F.pad(kpm.long().cumsum(-1), (1, 0))  # (B, Lk + 1)
        flipped = kpm.flip(-1)
        self.add_f = self.add.flip(-1)
        self.counts_f = F.pad(flipped.long().cumsum(-1), (1, 0))

    def mask(self, call: FlashCall) -> Tensor | None:
        if self.kpm is None:
            return None
        return (self.add_f if call.flip else self.add)[..., call.k0 : call.k1]

    def visible(self, call: FlashCall) -> Tensor | None:
        """Rows of ``call`` that see at least one unpadded key: ``(B, 1, c | 1)`` bool."""
        if self.kpm is None:
            return None
        counts = self.counts_f if call.flip else self.counts
        if call.causal:
            last = (torch.arange(call.r1 - call.r0, device=counts.device) + call.k0 + 1).clamp(max=call.k1)
            return (counts[:, last] - counts[:, call.k0 : call.k0 + 1] > 0).unsqueeze(1)
        return (counts[:, call.k1] - counts[:, call.k0] > 0).view(-1, 1, 1)


def _strip_padding(plan: Plan) -> tuple[int, int]:
    """Zero key rows needed before and after the keys so that no strip block leaves them."""
    if not plan.strips:
        return 0, 0
    first = min(s.r0 + s.first for s in plan.strips)
    last = max(s.r1 - 1 + s.first + s.width - 1 for s in plan.strips)
    return max(0, -first), max(0, last - (plan.geometry.Lk - 1))


def _pad_keys(x: Tensor | None, before: int, after: int) -> Tensor | None:
    if x is None or before == after == 0:
        return x
    return F.pad(x, (0, 0, before, after))


def _pad_cols(x: Tensor, width: int) -> Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


class SegmentAttention(torch.autograd.Function):
    """``apply(cfg, q, k, v, qL, kL, vL, qR, kR, vR, q_rel, bias, rel_k, rel_q, rel_v) -> (B, H, Lq, Dh)``.

    ``bias``/``rel_*`` are the band tables (:class:`~.band.Tables`) when the plan has
    bands, the strip's per-column tables (:class:`~.strip.StripTables`) when it has strips.
    """

    @staticmethod
    def forward(ctx, cfg: SegmentConfig, *tensors):
        with flush_denormals():
            return SegmentAttention._forward(ctx, cfg, *tensors)

    @staticmethod
    def backward(ctx, grad_out):
        with flush_denormals():
            return SegmentAttention._backward(ctx, grad_out)

    @staticmethod
    def _forward(ctx, cfg: SegmentConfig, *tensors):
        t = dict(zip(_NAMES, tensors))
        q, k, v = t["q"], t["k"], t["v"]
        plan, g = cfg.plan, cfg.plan.geometry
        B, H, Lq, Dv = *q.shape[:3], v.shape[-1]
        out = q.new_zeros(B, H, Lq, Dv, dtype=torch.float32)
        lse = torch.full((B, H, Lq), float("-inf"), device=q.device)
        masks = _Masks(cfg.key_padding_mask, q.dtype)
        operands = _Operands(cfg, t)
        cuts = _cutoffs(cfg, t)
        for call in plan.calls:
            qc, kc, vc, shift = operands(call)
            for hs, ks in _head_groups(call, cuts, g.delta, H):  # (no cut: one piece, all heads and keys)
                oc, lc = flash_forward(
                    qc[:, hs], kc[:, hs, ks], vc[:, hs, ks], scale=cfg.scale, causal=call.causal, mask=masks.mask(call)
                )
                if shift is not None:
                    lc = lc + shift[:, hs]
                vis = masks.visible(call)
                if vis is not None:
                    lc = lc.masked_fill(~vis, float("-inf"))
                oc = oc[..., :Dv]
                if call.flip:
                    oc, lc = oc.flip(2), lc.flip(-1)
                merge_into(out, lse, _global(call, Lq, g.Lk)[0], oc, lc, heads=hs)
        sizes = [b.size() for b in plan.bands] + [(s.r1 - s.r0) * s.width for s in plan.strips]
        keep = sum(sizes) * B * H * 4 <= cfg.keep_bytes
        kept = []
        for band in plan.bands:
            ob, lb, p = band_forward(
                (q, k, v, t["q_rel"]), band, _tables(cfg, t), scale=cfg.scale, geom=g, kpm=masks.kpm, keep=keep
            )
            merge_into(out, lse, slice(band.r0, band.r1), ob, lb)
            kept.append((p, lb))
        if plan.strips:
            before, after = _strip_padding(plan)
            x = (q, _pad_keys(k, before, after), _pad_keys(v, before, after), t["q_rel"])
            kpm_p = None if masks.kpm is None else F.pad(masks.kpm, (before, after))
            st = StripTables(t["bias"], t["rel_k"], t["rel_q"], t["rel_v"])
            rk = key_logits(x[1], st)
            for strip in plan.strips:
                ob, lb, p = strip_forward(
                    x, strip, st, scale=cfg.scale, geom=g, pad=before, kpm_padded=kpm_p, keep=keep, rk=rk
                )
                merge_into(out, lse, slice(strip.r0, strip.r1), ob, lb)
                kept.append((p, lb))
        out = out.to(q.dtype)
        ctx.cfg, ctx.kept, ctx.cuts = cfg, kept, cuts
        ctx.save_for_backward(*tensors, out, lse)
        return out

    @staticmethod
    def _backward(ctx, grad_out):
        cfg: SegmentConfig = ctx.cfg
        *tensors, out, lse = ctx.saved_tensors
        t = dict(zip(_NAMES, tensors))
        plan, g = cfg.plan, cfg.plan.geometry
        Lq = out.shape[2]
        need = dict(zip(_NAMES, ctx.needs_input_grad[1:]))
        grads = {n: (torch.zeros_like(t[n], dtype=torch.float32) if need[n] else None) for n in _NAMES}
        do = grad_out.to(out.dtype).contiguous()
        delta_rows = (do.float() * out.float()).sum(-1)  # D_i = Σ dO·O, (B, H, Lq)
        lse_safe = safe_lse(lse)
        masks = _Masks(cfg.key_padding_mask, out.dtype)
        operands = _Operands(cfg, t)
        width = operands.ext[2].shape[-1] if operands.ext is not None else out.shape[-1]
        fwd = (_pad_cols(do, width), _pad_cols(out, width), lse_safe)
        rev = tuple(x.flip(2) if x.dim() == 4 else x.flip(-1) for x in fwd) if operands.flipped else None
        for call in plan.calls:
            qc, kc, vc, shift = operands(call)
            rows = slice(call.r0, call.r1)
            do_c, out_c, lse_c = rev if call.flip else fwd
            lc = lse_c[:, :, rows] if shift is None else lse_c[:, :, rows] - shift
            grows, gkeys = _global(call, Lq, g.Lk)
            H = qc.shape[1]
            for hs, ks in _head_groups(call, ctx.cuts, g.delta, H):
                dq, dk, dv = flash_backward(
                    _pad_cols(do_c[:, hs, rows], vc.shape[-1]),  # a far-field variant may have a column
                    qc[:, hs],
                    kc[:, hs, ks],
                    vc[:, hs, ks],
                    _pad_cols(out_c[:, hs, rows], vc.shape[-1]),
                    lc[:, hs].contiguous(),
                    scale=cfg.scale,
                    causal=call.causal,
                    mask=masks.mask(call),
                )
                keys = gkeys if ks == slice(None) else slice(gkeys.start + ks.start, gkeys.start + ks.stop)
                for name, d, sl in zip(operands.names(call), (dq, dk, dv), (grows, keys, keys)):
                    if grads[name] is not None:
                        d = d[..., : t[name].shape[-1]]
                        grads[name][:, hs, sl] += d.flip(2) if call.flip else d
        kept = iter(ctx.kept)
        common = dict(scale=cfg.scale, geom=g)
        for band in plan.bands:
            p, band_lse = next(kept)
            rows = slice(band.r0, band.r1)
            band_backward(
                (t["q"], t["k"], t["v"], t["q_rel"]),
                band,
                _tables(cfg, t),
                grads,
                do=do[:, :, rows],
                lse=lse[:, :, rows],
                delta_rows=delta_rows[:, :, rows],
                kpm=masks.kpm,
                p=p,
                band_lse=band_lse,
                **common,
            )
        if plan.strips:
            before, after = _strip_padding(plan)
            x = (t["q"], _pad_keys(t["k"], before, after), _pad_keys(t["v"], before, after), t["q_rel"])
            kpm_p = None if masks.kpm is None else F.pad(masks.kpm, (before, after))
            sgrads = dict(grads, k=_pad_keys(grads["k"], before, after), v=_pad_keys(grads["v"], before, after))
            st = StripTables(t["bias"], t["rel_k"], t["rel_q"], t["rel_v"])
            rk = key_logits(x[1], st)
            d_rk = None if rk is None else torch.zeros_like(rk)
            for strip in plan.strips:
                p, own = next(kept)
                rows = slice(strip.r0, strip.r1)
                strip_backward(
                    x,
                    strip,
                    st,
                    sgrads,
                    do=do[:, :, rows],
                    lse=lse[:, :, rows],
                    delta_rows=delta_rows[:, :, rows],
                    pad=before,
                    kpm_padded=kpm_p,
                    p=p,
                    own_lse=own,
                    rk=rk,
                    d_rk=d_rk,
                    **common,
                )
            if d_rk is not None:
                key_logits_backward(d_rk, x[1], st, sgrads)
            for name in ("k", "v"):
                if grads[name] is not None and sgrads[name] is not grads[name]:
                    grads[name] = sgrads[name][:, :, before : before + g.Lk]
        return (None, *((grads[n].to(t[n].dtype) if grads[n] is not None else None) for n in _NAMES))


def _tables(cfg: SegmentConfig, t: dict) -> Tables:
    m = cfg.tables
    return Tables(m.lo, m.n, m.clamp, m.rows, t["bias"], t["rel_k"], t["rel_q"], t["rel_v"])
