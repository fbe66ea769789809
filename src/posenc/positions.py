"""Position tensors: grids, Qwen2-VL text + image positions, and training-time samplers.

* :func:`grid` — ``(row, column)`` or ``(time, row, column)`` positions of a flattened
  image or video, for encodings that read several axes (``rope`` with ``axes=``,
  ``mrope``, ``sinusoidal``/``learned`` with ``axes=``).
* :func:`mrope_positions` — Qwen2-VL's position ids for a sequence mixing text and
  images/videos (Wang et al., "Qwen2-VL", 2024; HF ``Qwen2VLModel.get_rope_index``).
* :func:`randomized_positions` — Ruoss et al. 2023, below.
* :func:`pose_positions` — PoSE (Zhu et al., ICLR 2024): chunked skips inside the target window.
* :func:`document_positions` / :func:`documents_from_positions` — packed sequences:
  positions that restart at every document, and the documents of such positions (the
  ``document_ids`` of :class:`posenc.TransformerLM`, :class:`posenc.AttentionMask`).

Ruoss, Delétang, Genewein, Grau-Moya, Csordás, Bennani, Legg, Veness, "Randomized
Positional Encodings Boost Length Generalization of Transformers", ACL 2023. During
training, the positions of a length-``L`` sequence are an increasing random sample of
``L`` distinct integers from ``[0, L_max)`` (``L_max`` much larger than the training
length), drawn afresh for every sequence; at evaluation they are ``arange(L)``. The
model then sees every position up to ``L_max`` during training while keeping their
order, so a longer test sequence holds no unseen position. It is not an encoding of its
own but a choice of the ``pos`` argument, so it works with every encoding::

    pos = randomized_positions(B, L, max_pos=4 * L, generator=g)  # (B, L) int64
    logits = lm(tokens, pos=pos)

Reference: ``randomized_positional_encodings`` in google-deepmind/randomized_positional_encodings
(``np.sort(rng.permutation(max_len)[:length])`` per sequence).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "grid",
    "mrope_positions",
    "randomized_positions",
    "pose_positions",
    "document_positions",
    "documents_from_positions",
]


def _positive(**kw) -> None:
    for arg, val in kw.items():
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{arg} must be a positive int, got {val!r}")


def grid(*sizes: int, start: int = 0, device=None) -> Tensor:
    """Positions of a flattened grid, row-major: ``(N, A)`` int64 with ``N = Π sizes``, ``A = len(sizes)``.

    ``grid(h, w)`` gives ``(row, column)`` for the ``h·w`` patches of an image read row by
    row (``[(0,0), (0,1), …, (0,w-1), (1,0), …]``); ``grid(t, h, w)`` gives ``(time, row,
    column)`` for a video. ``start`` is added to every coordinate. Pass the result (or a
    ``(B, N, A)`` stack of them) as ``pos`` to a model whose encoding reads ``axes = A``.

    Raises:
        ValueError: no size, more than 3 sizes, or a size that is not a positive int.
    """
    if not 1 <= len(sizes) <= 3:
        raise ValueError(f"grid takes 1 to 3 sizes ((n,), (h, w) or (t, h, w)), got {len(sizes)}: {sizes}")
    for i, n in enumerate(sizes):
        _positive(**{f"size {i}": n})
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    axes = torch.meshgrid(*(torch.arange(n, device=device) for n in sizes), indexing="ij")
    return torch.stack(axes, dim=-1).reshape(-1, len(sizes)) + start  # (N, A)


def mrope_positions(*segments: int | tuple[int, ...], start: int = 0, device=None) -> Tensor:
    """Qwen2-VL's 3-axis ``(t, h, w)`` positions for a sequence of text and vision segments: ``(L, 3)``.

    Each segment is an ``int`` (that many text tokens), an ``(h, w)`` image or a
    ``(t, h, w)`` video, in LLM grid units (after the vision encoder's spatial merge). Text
    tokens carry the same position on the three axes and count up by one; a vision
    segment starting at ``s`` carries ``(s + i, s + r, s + c)`` for time step ``i``, row
    ``r`` and column ``c``, and the next segment starts one past the largest position used
    so far. This is ``get_rope_index`` of the Qwen2-VL release; transformers 5.x advances
    by ``max(h, w)`` after a vision segment instead, which is the same whenever ``t <=
    max(h, w)`` (always for images).

    ``start``: position of the first token; continue a prefix with
    ``start=int(prefix.max()) + 1`` (HF's ``rope_deltas``).

    Raises:
        ValueError: no segment, or a segment that is not a positive int, ``(h, w)`` or ``(t, h, w)``.
    """
    if not segments:
        raise ValueError("mrope_positions needs at least one segment (an int for text, (h, w) or (t, h, w))")
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    parts, nxt = [], start
    for i, seg in enumerate(segments):
        if isinstance(seg, int) and not isinstance(seg, bool):
            _positive(**{f"text segment {i}": seg})
            p = torch.arange(seg, device=device).unsqueeze(-1).expand(seg, 3)  # t = h = w
        elif isinstance(seg, tuple) and len(seg) in (2, 3):
            p = grid(*((1,) + seg if len(seg) == 2 else seg), device=device)  # (t·h·w, 3)
        else:
            raise ValueError(f"segment {i} must be an int (text) or (h, w) / (t, h, w) (vision), got {seg!r}")
        parts.append(p + nxt)
        nxt = int(parts[-1].max()) + 1
    return torch.cat(parts)  # (L, 3)


def randomized_positions(
    batch: int, length: int, max_pos: int, generator: torch.Generator | None = None, *, device=None
) -> Tensor:
    """Sorted random positions: ``(batch, length)`` int64, distinct, increasing, in ``[0, max_pos)``.

    Every row is an independent uniform sample without replacement of ``length``
    positions out of ``max_pos``, sorted. With ``max_pos == length`` it is ``arange``.

    Args:
        batch: number of rows ``B``.
        length: sequence length ``L``.
        max_pos: ``L_max``, the exclusive upper bound; at least ``length``. An encoding
            with a table (``learned``) needs ``max_len >= max_pos``.
        generator: a ``torch.Generator`` for reproducible draws (on the CPU).
        device: where the result goes.

    Raises:
        ValueError: a non-positive size, or ``max_pos < length``.
    """
    for arg, val in (("batch", batch), ("length", length), ("max_pos", max_pos)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{arg} must be a positive int, got {val!r}")
    if max_pos < length:
        raise ValueError(
            f"max_pos must be >= length to draw distinct positions, got max_pos={max_pos} < length={length}"
        )
    # a random permutation per row, keep the first L, sort: uniform over L-subsets
    keys = torch.rand(batch, max_pos, generator=generator)  # (B, L_max)
    pos = keys.argsort(dim=-1)[:, :length].sort(dim=-1).values  # (B, L)
    return pos.to(device) if device is not None else pos


def pose_positions(
    batch: int,
    length: int,
    target_len: int,
    *,
    chunks: int = 2,
    generator: torch.Generator | None = None,
    device=None,
) -> Tensor:
    """PoSE positions (Zhu et al., "PoSE: Efficient Context Window Extension of LLMs via
    Positional Skip-wise Training", ICLR 2024): ``(batch, length)`` int64 in ``[0, target_len)``.

    A training window of ``L = length`` tokens is cut into ``chunks`` contiguous pieces of
    random lengths ``l_0 … l_{N-1}`` (``N - 1`` distinct cut points drawn uniformly from
    ``1 … L-1``), and chunk ``i`` is moved right by a skip ``u_i``: ``u_0 = 0``,
    ``u_i`` uniform in ``{u_{i-1}, …, target_len - L}``. Positions stay increasing, every
    chunk stays contiguous (local distances as at inference), and the distances between
    chunks cover the whole target window, so a model trained at ``L`` sees every relative
    position up to ``target_len``. Drawn afresh per row. With ``chunks=2`` this is the
    official ``train_preprocess_function_pose`` (dwzhu-pku/PoSE, with its revision
    ``lt = 0``), except that there the first chunk is at most ``ceil(L/2)`` long. The
    paper also takes chunk 2's *tokens* from further on in the document; that is the
    data's business: this function gives the positions.

    Args:
        batch, length: ``B`` and ``L``.
        target_len: the context window to reach, ``>= length``; ``target_len == length``
            gives ``arange``.
        chunks: ``N``, between 1 and ``length``.
        generator: a ``torch.Generator`` for reproducible draws (on the CPU).
        device: where the result goes.

    Raises:
        ValueError: a non-positive size, ``target_len < length`` or ``chunks > length``.
    """
    _positive(batch=batch, length=length, target_len=target_len, chunks=chunks)
    if target_len < length:
        raise ValueError(f"target_len must be >= length, got target_len={target_len} < length={length}")
    if chunks > length:
        raise ValueError(f"chunks must be <= length (each chunk holds a token), got chunks={chunks} > length={length}")
    slack = target_len - length
    # cut points: N-1 distinct values of 1..L-1 per row (a uniform random composition of L)
    cuts = torch.rand(batch, length - 1, generator=generator).argsort(-1)[:, : chunks - 1] + 1  # (B, N-1)
    cuts = cuts.sort(-1).values
    # chunk of every token: how many cut points lie at or before it
    chunk_of = (torch.arange(length).view(1, -1, 1) >= cuts.unsqueeze(1)).sum(-1)  # (B, L) in [0, N)
    skips = torch.zeros(batch, chunks, dtype=torch.long)
    for i in range(1, chunks):  # u_i uniform in {u_{i-1}, ..., slack}
        lo = skips[:, i - 1]
        skips[:, i] = lo + (torch.rand(batch, generator=generator) * (slack - lo + 1)).long().clamp(max=slack - lo)
    pos = torch.arange(length).unsqueeze(0) + skips.gather(1, chunk_of)  # (B, L)
    return pos.to(device) if device is not None else pos


def _check_ids(ids, name: str) -> Tensor:
    if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.dim() not in (1, 2) or ids.shape[-1] < 1:
        raise ValueError(f"{name} must have shape (L,) or (B, L) with L >= 1, got {tuple(ids.shape)}")
    return ids


def document_positions(document_ids: Tensor) -> Tensor:
    """Positions that restart at 0 wherever the document id changes: ``(B, L)`` or ``(L,)`` int64.

    ``document_ids`` ``(B, L)`` or ``(L,)``: equal ids in a run are one document, e.g.
    ``[0, 0, 0, 1, 1]`` -> ``[0, 1, 2, 0, 1]``. Each document of a packed row then sees the
    positions it would have alone.
    """
    ids = _check_ids(document_ids, "document_ids")
    idx = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)  # (B, L)
    new = torch.ones_like(ids, dtype=torch.bool)
    new[..., 1:] = ids[..., 1:] != ids[..., :-1]
    start = torch.where(new, idx, torch.zeros_like(idx)).cummax(dim=-1).values  # first token of each one's document
    return idx - start


def documents_from_positions(pos: Tensor) -> Tensor:
    """Document ids ``0, 1, ...`` of packed positions: a document starts wherever a
    position is not the previous one plus 1 (the rule of HF's ``DataCollatorWithFlattening``
    output, ``transformers.masking_utils.find_packed_sequence_indices``).

    ``pos`` ``(B, L)`` or ``(L,)`` int -> ``(B, L)`` or ``(L,)`` int64; e.g.
    ``[0, 1, 2, 0, 1, 0]`` -> ``[0, 0, 0, 1, 1, 2]``.
    """
    pos = _check_ids(pos, "pos")
    new = torch.zeros_like(pos, dtype=torch.long)
    new[..., 1:] = (pos[..., 1:] != pos[..., :-1] + 1).long()
    return new.cumsum(dim=-1)
