"""Position tensors for training: randomized positions (Ruoss et al.).

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

__all__ = ["randomized_positions"]


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
