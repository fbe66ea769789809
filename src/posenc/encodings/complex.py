"""Complex Order: word embeddings as complex waves over positions.

Wang, Zhao, Li, Hou, Hu, Simonsen, "Encoding Word Order in Complex Embeddings", ICLR
2020. Word ``j`` has an amplitude ``r_j``, a frequency ``ω_j`` and an initial phase
``θ_j`` (vectors of ``D/2`` complex features); at position ``k``::

    f(j, k) = r_j ⊙ exp(i·(ω_j·k + θ_j))

so ``f(j, k + s) = f(j, k) ⊙ exp(i·ω_j·s)``: moving a word multiplies it by a phase that
depends on the distance only. ``share_frequency`` / ``share_phase`` use one ``ω`` / ``θ``
for every word (the paper's lighter variants). Checked against the formula written out
in the test, and the two properties above.

Two ways to use it:

* here, real-ified: ``[Re f | Im f]`` of width ``D`` is the token embedding of any real
  model. With a vocabulary the input stage builds the embedding (``input_at =
  "tokens"``: :class:`posenc.TransformerLM` passes its ``vocab_size`` and calls
  ``embed(tokens, pos)``). Built without one (``vocab_size=None``, e.g. in a bare
  :class:`posenc.Attention`, which sees vectors, not token ids), it is the
  word-independent form: the input ``x`` read as ``[Re | Im]`` is the complex word
  vector ``r_j·e^{iθ_j}`` and ``embed(x, pos) = x ⊙ e^{iω·k}`` with one shared ``ω``;
* :mod:`posenc.complex_model`: the paper's complex-valued attention and LM.

Initialisation follows the authors' code: ``ω`` starts at the sinusoidal frequencies
``10000^(−2k/D)`` (every word alike), ``θ = 0``, ``r ~ N(0, init_std²)``. Angles are
formed in float64 from int64 positions and rounded once to float32.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import functional as PF
from ..base import Needs, PositionEncoding
from ..registry import register


@register
class ComplexOrder(PositionEncoding):
    """Complex Order embedding, real-ified to ``[Re | Im]``; see the module doc.

    With ``vocab_size`` it owns per-word ``r``, ``ω``, ``θ`` tables and ``embed(tokens, pos)``
    builds the token embedding; without, it owns one shared ``ω`` and ``embed(x, pos)``
    rotates the given complex vectors (``share_frequency``/``share_phase`` then do not
    apply: the input carries amplitude and phase).
    """

    name = "complex-order"
    paper = "Wang et al., Encoding Word Order in Complex Embeddings"
    year = 2020
    needs = Needs(vocab=True)  # takes the model's vocab_size

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        vocab_size: int | None = None,
        share_frequency: bool = False,
        share_phase: bool = False,
        init_std: float = 0.02,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if self.dim % 2:
            raise ValueError(f"complex-order needs an even width heads*head_dim (Re | Im halves), got {self.dim}")
        if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
            raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
        n = self.dim // 2
        self.vocab_size = vocab_size
        self.share_frequency, self.share_phase = bool(share_frequency), bool(share_phase)
        if vocab_size is not None:  # it builds the token embedding; without a vocabulary it only rotates
            self.needs = self.needs.replace(input_at="tokens")
        rows_w = 1 if share_frequency or vocab_size is None else vocab_size
        self.frequency = nn.Parameter(PF.sinusoidal_inv_freq(self.dim).expand(rows_w, n).clone())  # (V|1, D/2)
        if vocab_size is not None:
            self.amplitude = nn.Embedding(vocab_size, n)
            nn.init.normal_(self.amplitude.weight, std=init_std)
            self.phase = nn.Parameter(torch.zeros(1 if share_phase else vocab_size, n))  # (V|1, D/2)

    @property
    def relative(self) -> bool:
        return False

    def _rows(self, table: Tensor, tokens: Tensor) -> Tensor:
        return table[0].expand(*tokens.shape, -1) if table.shape[0] == 1 else table[tokens]

    def complex_embedding(self, tokens: Tensor, pos: Tensor) -> Tensor:
        """Needs ``vocab_size``. ``f(tokens, pos)``: complex64 ``(B, L, D/2)`` for ``tokens`` ``(B, L)``, ``pos`` ``(L,)|(B|1, L)``."""
        if self.vocab_size is None:
            raise ValueError("complex-order was built without vocab_size; it cannot embed token ids")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be an integer tensor, got {tokens.dtype}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {self.vocab_size - 1}] (vocab_size={self.vocab_size}), "
                f"got range [{int(tokens.min())}, {int(tokens.max())}]"
            )
        r = self.amplitude(tokens).float()  # (B, L, D/2)
        w = self._rows(self.frequency, tokens).double()  # (B, L, D/2)
        theta = self._rows(self.phase, tokens).float()
        angle = (pos.double().unsqueeze(-1) * w).float() + theta  # ω·k + θ
        return torch.complex(r * angle.cos(), r * angle.sin())

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        """With a vocabulary: ``x`` is token ids ``(B, L)`` -> ``[Re f | Im f]`` ``(B, L, D)``.

        Without: ``x`` ``(B, L, D)`` read as ``[Re | Im]``, rotated by ``e^{iω·k}``.
        """
        if self.vocab_size is not None:
            if x.dim() != 2:
                raise ValueError(
                    f"complex-order with a vocabulary builds the embedding: pass token ids (B, L), got shape {tuple(x.shape)}"
                )
            z = self.complex_embedding(x, pos)
            return torch.cat((z.real, z.imag), dim=-1).to(self.amplitude.weight.dtype)  # (B, L, D)
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (B, L, {self.dim}), got {tuple(x.shape)}")
        n = self.dim // 2
        angle = (pos.double().unsqueeze(-1) * self.frequency[0].double()).float()  # (B|1, L, D/2)
        cos, sin = angle.cos(), angle.sin()
        re, im = x[..., :n].float(), x[..., n:].float()
        return torch.cat((re * cos - im * sin, re * sin + im * cos), dim=-1).to(x.dtype)
