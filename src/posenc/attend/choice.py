"""Which backends can run an encoding, and which one ``backend="auto"`` runs.

Kept apart from :mod:`posenc.attend.backends` (which re-exports every name here) so that the
backends themselves stay one readable file.
"""

from __future__ import annotations

from ..base import PositionEncoding, Stage
from ..validate import check_device_type

__all__ = [
    "BLOCKWISE_MIN_SCORES",
    "BLOCKWISE_MIN_SCORES_BIDIR",
    "FLEX_MIN_HEAD_DIM",
    "FLEX_MIN_QUERIES",
    "supported_backends",
    "require_backend",
    "select_backend",
]


# (class, capped) -> backends: stages are class facts (base.PositionEncoding), the soft-cap
# the one option that changes the list; kept because attend asks at every call of every layer
_SUPPORTED: dict[tuple[type, bool], tuple[str, ...]] = {}


def supported_backends(enc: PositionEncoding) -> list[str]:
    """Backends able to run ``enc`` (every one of them equals ``eager``)."""
    return list(_supported_once(enc))


def _supported_once(enc: PositionEncoding) -> tuple[str, ...]:
    key = (type(enc), enc.softcap is not None)
    found = _SUPPORTED.get(key)
    if found is None:
        found = _SUPPORTED[key] = tuple(_supported(enc))
    return found


def _supported(enc: PositionEncoding) -> list[str]:
    st = enc.stages
    vector = bool(st & (Stage.TERMS | Stage.VALUE | Stage.SCORES | Stage.NORM)) or enc.defines("rotate_value")
    if enc.softcap is not None:  # only a score_mod or the materialised scores can cap
        return (["flex"] if not vector else []) + ["chunked", "eager"]
    out = []
    if not st & Stage.BIAS and not vector:
        out.append("sdpa")
    if enc.defines("distance_terms") and not enc.defines("rotate_value"):
        out.append("blockwise")
    if st & Stage.BIAS and not vector:
        out += ["flex", "dense"]
    if enc.defines("score_maps"):
        out.append("maps")
    return out + ["chunked", "eager"]


def require_backend(enc: PositionEncoding, name: str) -> str:
    """``name`` when it can run ``enc``; else a ``ValueError`` listing the backends that can."""
    if name not in supported_backends(enc):
        raise ValueError(f"backend {name!r} cannot run encoding {enc.name!r}; supported: {supported_backends(enc)}")
    return name


# ``blockwise`` pays for its per-block fused calls only from about this many scores per
# head (q_len * k_len); below it the one-shot dense/chunked backends are faster (the
# measurements: docs/bench.md, "When auto picks blockwise").
BLOCKWISE_MIN_SCORES = 512 * 512
# Bidirectional calls pay more for blockwise's explicit parts (a band or strip on both
# sides of the diagonal, and the right far field's own fused calls), against a baseline
# kernel that skips nothing: there the one-shot backends win up to about 2048 x 2048
# (docs/bench.md, "When auto picks blockwise", bidirectional table).
BLOCKWISE_MIN_SCORES_BIDIR = 2048 * 2048


# FlexAttention's compiled CUDA kernel (Triton's tl.dot) needs q/k and v heads of at least 16
# channels: inductor refuses smaller ones at compile time ("NYI: embedding dimension of the
# query, key, and value must be at least 16"; seen on an H100 with torch 2.11, and the same
# check is in torch 2.13's torch/_inductor/kernel/flex/flex_attention.py).
FLEX_MIN_HEAD_DIM = 16

# posenc compiles FlexAttention for static shapes (posenc.attend.flex): every new (queries, keys) shape
# is a compile of seconds. A call with fewer queries than one FlexAttention block (decoding
# with the KV cache: one query over a key count that grows every step) would compile at every
# step, so auto runs ``dense`` there (its bias is only ``q_len x k_len`` per head).
FLEX_MIN_QUERIES = 128


def select_backend(
    enc: PositionEncoding,
    device_type: str,
    q_len: int | None = None,
    k_len: int | None = None,
    *,
    causal: bool | None = None,
    dropout: bool = False,
) -> str:
    """The backend ``"auto"`` runs for ``enc`` on ``device_type`` (``"cpu"``, ``"cuda"``, ...)
    for ``q_len`` queries over ``k_len`` keys (None: long; the choice for long sequences);
    ``dropout``: with attention dropout (never ``flex``, which has none).

    FlexAttention is chosen on CUDA only: on CPU it has no backward, and its compiled
    forward costs a long compile for each new shape; and only for heads of at least
    :data:`FLEX_MIN_HEAD_DIM` channels (``enc.head_dim``), which its compiled kernel needs, and
    for at least :data:`FLEX_MIN_QUERIES` queries (``q_len``; None counts as long): a shorter
    call (KV-cache decoding) runs ``dense`` instead of compiling FlexAttention for each new key count.
    ``maps`` (an encoding's score maps through the CPU's fused kernel) is chosen on CPU only.
    ``blockwise`` is chosen on CPU only (its fused calls are CPU SDPA's flash kernel), and only from
    :data:`BLOCKWISE_MIN_SCORES` scores per head (:data:`BLOCKWISE_MIN_SCORES_BIDIR` when
    ``causal`` is False), where it measured faster. ``causal=None`` (not known) takes the
    causal rule.
    """
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool or None, got {causal!r}")
    check_device_type(device_type)
    ok = _supported_once(enc)
    if "sdpa" in ok:
        return "sdpa"
    ok = list(ok)
    if dropout or enc.head_dim < FLEX_MIN_HEAD_DIM or (q_len is not None and q_len < FLEX_MIN_QUERIES):
        ok = [b for b in ok if b != "flex"]
    if "flex" in ok and (enc.defines("score_mod") or not enc.stages & Stage.BIAS) and device_type == "cuda":
        return "flex"
    least = BLOCKWISE_MIN_SCORES_BIDIR if causal is False else BLOCKWISE_MIN_SCORES
    short = q_len is not None and k_len is not None and q_len * k_len < least
    if "blockwise" in ok and device_type == "cpu" and not short:
        return "blockwise"
    if "maps" in ok and device_type == "cpu":
        return "maps"
    if "dense" in ok:
        return "dense"
    return "chunked"
