"""Adaptive input (Baevski & Auli 2019) and the adaptive softmax output of a large-vocabulary LM.

The vocabulary (ids sorted by frequency) is cut into bands at ``cutoffs``: band ``i`` holds
ids ``[c_{i-1}, c_i)`` (``c_{-1} = 0``, the last band ends at ``vocab_size``).

* :class:`AdaptiveInput` — fairseq's ``AdaptiveInput``: band ``i`` embeds its ids in
  ``int(dim // factor**i)`` dimensions and projects them to ``dim`` with a bias-free linear
  map; embeddings start N(0, 1/dim_i), projections Xavier-uniform (fairseq's init). No
  padding row: an LM stream has no padding.
* :func:`adaptive_head` — ``torch.nn.AdaptiveLogSoftmaxWithLoss`` with the same cutoffs and
  ``div_value = factor`` (fairseq's ``adaptive_softmax_factor`` 4), no head bias (fairseq's
  head has none). ``tie_bands`` shares each tail band's output matrix with the input
  band's embedding (fairseq's ``tie_adaptive_weights`` for bands 1..n, the same tensor).
  Not tied, unlike fairseq's ``transformer_lm_wiki103``: the head's shortlist with input
  band 0 (torch's head is one matrix holding the shortlist and the cluster rows) and the
  projections (``tie_adaptive_proj``: torch's tail projection is the transpose of the input
  projection's layout). fairseq's adaptive-softmax dropout (0.2 between a tail's two maps)
  has no place in torch's module either.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["AdaptiveInput", "adaptive_head", "check_cutoffs", "tie_bands"]


def check_cutoffs(cutoffs, vocab_size: int) -> list[int]:
    """``cutoffs`` as a list of ints, strictly increasing in ``(0, vocab_size)``.

    Raises:
        ValueError: not a non-empty list of such ints (the message names the range).
    """
    ok = isinstance(cutoffs, (list, tuple)) and len(cutoffs) > 0
    ok = ok and all(isinstance(c, int) and not isinstance(c, bool) for c in cutoffs)
    ok = ok and all(a < b for a, b in zip([0, *cutoffs], [*cutoffs, vocab_size], strict=True))
    if not ok:
        raise ValueError(
            f"adaptive_cutoffs must be a non-empty list of ints strictly increasing in (0, vocab_size={vocab_size}), "
            f"got {cutoffs!r}"
        )
    return list(cutoffs)


def _band_dim(dim: int, factor: float, i: int) -> int:
    d = int(dim // (factor**i))
    if d < 1:
        raise ValueError(f"adaptive band {i} would have dim {dim} // {factor}**{i} = {d} < 1: use fewer cutoffs")
    return d


class AdaptiveInput(nn.Module):
    """Token embeddings of width ``dim`` from per-band embeddings of width ``dim // factor**i``.

    Shapes: ``tokens`` ``(B, L)`` int -> ``(B, L, dim)``.
    """

    def __init__(self, vocab_size: int, dim: int, cutoffs: list[int], factor: float = 4.0) -> None:
        super().__init__()
        self.cutoffs = check_cutoffs(cutoffs, vocab_size)
        self.edges = [0, *self.cutoffs, vocab_size]
        self.dim = dim
        self.embeddings = nn.ModuleList()
        self.projections = nn.ModuleList()
        for i, (lo, hi) in enumerate(zip(self.edges[:-1], self.edges[1:], strict=True)):
            d = _band_dim(dim, factor, i)
            self.embeddings.append(nn.Embedding(hi - lo, d))
            self.projections.append(nn.Linear(d, dim, bias=False))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """fairseq's init: embeddings N(0, 1/dim_i), projections Xavier-uniform."""
        for emb, proj in zip(self.embeddings, self.projections, strict=True):
            nn.init.normal_(emb.weight, std=emb.weight.shape[1] ** -0.5)
            nn.init.xavier_uniform_(proj.weight)

    def forward(self, tokens: Tensor) -> Tensor:
        if bool(((tokens < 0) | (tokens >= self.edges[-1])).any()):
            raise IndexError(f"token id out of range [0, {self.edges[-1]})")
        out: Tensor | None = None
        for i, (emb, proj) in enumerate(zip(self.embeddings, self.projections, strict=True)):
            lo, hi = self.edges[i], self.edges[i + 1]
            mask = (tokens >= lo) & (tokens < hi)
            y = proj(emb(tokens[mask] - lo))  # (n_i, dim); no host sync on an empty band
            if out is None:
                out = y.new_zeros(*tokens.shape, self.dim)
            out = out.index_put((mask,), y.to(out.dtype))
        return out


def adaptive_head(dim: int, vocab_size: int, cutoffs: list[int], factor: float = 4.0):
    """``torch.nn.AdaptiveLogSoftmaxWithLoss(dim, vocab_size, cutoffs, div_value=factor, head_bias=False)``."""
    cutoffs = check_cutoffs(cutoffs, vocab_size)
    for i in range(1, len(cutoffs) + 1):
        _band_dim(dim, factor, i)
    return nn.AdaptiveLogSoftmaxWithLoss(dim, vocab_size, cutoffs, div_value=float(factor), head_bias=False)


def tie_bands(head: nn.AdaptiveLogSoftmaxWithLoss, inputs: AdaptiveInput) -> None:
    """Share tail band ``i``'s output matrix with input band ``i + 1``'s embedding (one tensor)."""
    for i, tail in enumerate(head.tail):
        out = tail[1]
        emb = inputs.embeddings[i + 1]
        if out.weight.shape != emb.weight.shape:  # equal by construction (same sizes, same dims)
            raise ValueError(f"band {i + 1}: tail {tuple(out.weight.shape)} != input {tuple(emb.weight.shape)}")
        out.weight = emb.weight
