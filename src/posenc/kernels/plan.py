"""Which keys of each query run where: fused flash calls, a strip or a band.

Positions are consecutive (``q_pos = q0 + i``, ``k_pos = k0 + j``), so the distance of a
pair is ``d = k_pos_j - q_pos_i = j - i + delta`` with ``delta = k0 - q0``, the same for
every row. A causal query ``i`` sees keys ``j <= i + offset`` (``offset`` = keys cached
before the call).

An encoding's terms are either

* ``"clamp"``: constant in ``d`` for ``d <= lo`` and for ``d >= hi`` (Shaw's clip, T5's and
  DeBERTa's saturated buckets). Row ``i``'s far keys ``j <= i + lo - delta`` are one
  *staircase*: a causal flash call on the far-field variant of ``(q, k, v)`` (plus an
  unmasked one when a cache puts the first step past key 0); the far keys on the right
  are the same staircase on the reversed sequence. The ``W`` keys left in between are a
  *strip*: column ``t`` of row ``i`` is key ``i + lo - delta + 1 + t``, so every column
  has one distance and the terms are plain matmuls against ``W`` table rows;
* ``"linear"``: ``bias = slope_left·d`` for ``d <= lo`` and ``slope_right·d`` for
  ``d >= hi`` (ALiBi): per query block, the keys on each side run in one unmasked flash
  call with a key column ``slope·(j - J)`` centred on the block (a causal block's own
  triangle is one more call, causal), the rest is a band;
* ``"none"``: no structure (Transformer-XL, Kerple): every visible key is in the band.

A *band* is a rectangle of keys for a block of rows, computed explicitly with the
causal and padding masks. Every call, strip and band is a part of one softmax per row,
merged by log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Geometry", "FlashCall", "Band", "Strip", "Plan", "make_plan"]


@dataclass(frozen=True)
class Geometry:
    """Index geometry of one attention call (see the module docstring)."""

    Lq: int
    Lk: int
    causal: bool
    offset: int = 0
    delta: int = 0

    def key_end(self, last_row: int) -> int:
        """One past the last key row ``last_row`` sees."""
        return min(self.Lk, last_row + self.offset + 1) if self.causal else self.Lk


@dataclass(frozen=True)
class FlashCall:
    """Rows ``[r0, r1)`` against keys ``[k0, k1)`` in one fused call.

    ``side``: which far-field variant of ``(q, k, v)`` it uses (``"left"``, ``"right"``);
    ``causal``: top-left causal within the call; ``centre``: key index the linear column
    is centred on (linear terms only); ``flip``: rows and keys count from the end (the
    right staircase runs on the reversed sequence).
    """

    r0: int
    r1: int
    k0: int
    k1: int
    side: str
    causal: bool = False
    centre: int | None = None
    flip: bool = False


@dataclass(frozen=True)
class Band:
    """Rows ``[r0, r1)`` against keys ``[k0, k1)``, computed explicitly."""

    r0: int
    r1: int
    k0: int
    k1: int

    def size(self) -> int:
        return (self.r1 - self.r0) * (self.k1 - self.k0)


@dataclass(frozen=True)
class Strip:
    """Rows ``[r0, r1)``; row ``i``'s column ``t < width`` is key ``i + first + t``."""

    r0: int
    r1: int
    first: int
    width: int


@dataclass(frozen=True)
class Plan:
    geometry: Geometry
    calls: tuple[FlashCall, ...]
    bands: tuple[Band, ...] = ()
    strips: tuple[Strip, ...] = ()

    def distance_range(self) -> tuple[int, int] | None:
        """Smallest and largest ``d`` of any band or strip pair (None without either)."""
        g = self.geometry
        los = [b.k0 - (b.r1 - 1) for b in self.bands] + [s.first for s in self.strips]
        his = [(b.k1 - 1) - b.r0 for b in self.bands] + [s.first + s.width - 1 for s in self.strips]
        if not los:
            return None
        return min(los) + g.delta, max(his) + g.delta


def _staircase(Lq: int, Lk: int, a: int, side: str, flip: bool) -> list[FlashCall]:
    """Calls giving row ``i`` the keys ``0 .. min(i + a, Lk - 1)`` (none when ``i + a < 0``)."""
    i0 = max(0, -a)
    if i0 >= Lq or Lk <= 0:
        return []
    if a <= 0:  # row i0 sees key 0: top-left causal from there
        return [FlashCall(i0, Lq, 0, Lk, side, causal=True, flip=flip)]
    calls = [FlashCall(0, Lq, 0, min(a + 1, Lk), side, flip=flip)]  # keys 0..a, seen by every row
    if a + 1 < Lk and Lq > 1:
        calls.append(FlashCall(1, Lq, a + 1, Lk, side, causal=True, flip=flip))
    return calls


def _clamp_plan(geom: Geometry, lo: int, hi: int, block: int) -> Plan:
    a = lo - geom.delta  # far on the left: j <= i + a
    if geom.causal:
        a = min(a, geom.offset)  # never past the last visible key
    b = max(hi - geom.delta, a + 1)  # far on the right: j >= i + b
    calls = _staircase(geom.Lq, geom.Lk, a, "left", False)
    last = geom.offset if geom.causal else b - 1  # the strip's last key: i + last
    if not geom.causal:  # j >= i + b on the reversed sequence: j' <= i' + (Lk - Lq - b)
        calls += _staircase(geom.Lq, geom.Lk, geom.Lk - geom.Lq - b, "right", True)
    width = last - a
    strips = []
    if width > 0:
        strips = [Strip(s, min(s + block, geom.Lq), a + 1, width) for s in range(0, geom.Lq, block)]
    return Plan(geom, tuple(calls), (), tuple(strips))


def make_plan(geom: Geometry, kind: str, far: tuple[int, int] | None, block: int, band_keys: int | None = None) -> Plan:
    """Split the work of one call into flash calls, strips and bands.

    ``kind``: ``"clamp"``, ``"linear"`` or ``"none"`` (module docstring); ``far = (lo, hi)``:
    the terms have their far-field form for ``d <= lo`` and for ``d >= hi``; ``band_keys``:
    at most this many keys per band (a block's keys become several bands, merged like the
    other parts), so that a band's ``(B, H, block, keys)`` scores stay in cache.
    """
    if kind not in ("clamp", "linear", "none"):
        raise ValueError(f"kind must be 'clamp', 'linear' or 'none', got {kind!r}")
    if kind != "none" and (far is None or far[0] > far[1]):
        raise ValueError(f"kind={kind!r} needs far=(lo, hi) with lo <= hi, got {far!r}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if band_keys is not None and band_keys < 1:
        raise ValueError(f"band_keys must be >= 1 or None, got {band_keys}")
    span = band_keys or geom.Lk
    if kind == "clamp":
        return _clamp_plan(geom, far[0], far[1], block)
    calls: list[FlashCall] = []
    bands: list[Band] = []
    for s in range(0, geom.Lq, block):
        e = min(s + block, geom.Lq)
        kend = geom.key_end(e - 1)
        if kend <= 0:
            continue  # no row of this block sees a key (a causal call with keys all ahead)
        if kind == "none":
            bands += [Band(s, e, k, min(k + span, kend)) for k in range(0, kend, span)]
            continue
        lo, hi = far
        centre = (s + e - 1) // 2 - geom.delta
        # keys on the left for every row of the block: j <= s + lo - delta
        fl = max(0, min(s + lo - geom.delta + 1, kend))
        triangle = geom.causal and geom.offset + geom.delta <= lo and s + geom.offset >= 0
        if triangle:  # every visible pair is linear: the block's own triangle is one causal call
            fl = min(s + geom.offset, kend)
        if fl > 0:
            calls.append(FlashCall(s, e, 0, fl, "left", centre=centre))
        if geom.causal:
            fr = kend
            if triangle and fl < kend:
                calls.append(FlashCall(s, e, fl, kend, "left", causal=True, centre=centre))
                fl = kend
        else:
            # keys on the right for every row: j >= (e - 1) + hi - delta
            fr = min(max(e - 1 + hi - geom.delta, fl), kend)
            if fr < kend:
                calls.append(FlashCall(s, e, fr, kend, "right", centre=centre))
        if fl < fr:
            bands.append(Band(s, e, fl, fr))
    return Plan(geom, tuple(calls), tuple(bands))
