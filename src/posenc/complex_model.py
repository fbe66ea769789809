"""The complex-valued Transformer of Complex Order (Wang et al., ICLR 2020).

Wang, Zhao, Li, Hou, Hu, Simonsen, "Encoding Word Order in Complex Embeddings", ICLR
2020, section 3.3 and the authors' ``attention_complex.py``. Activations are complex
(``complex64``); every layer follows the authors' definitions:

* linear layers are complex: ``W = A + iB``, ``zW = (xA − yB) + i(xB + yA)`` for
  ``z = x + iy`` (the paper's complex-valued Transformer);
* attention score: the modulus of the complex dot product, **without** conjugation, as
  in the authors' code (``scores_real = qr·krᵀ − qi·kiᵀ``, ``scores_imag = qr·kiᵀ + qi·krᵀ``,
  ``score = sqrt(real² + imag²)/sqrt(Dh)``)::

      s_ij = |Σ_d q_id·k_jd| / sqrt(Dh),   a = softmax_j(s + mask),   o_i = Σ_j a_ij v_j

  ``conjugate=True`` uses ``|q_i·conj(k_j)|`` instead (the Hermitian product, under which
  the Complex Order phases cancel to ``ω·(i − j)``);
* layer norm and the MLP's activation act on the real and imaginary parts separately;
* the output layer reads ``[Re | Im]``.

Checked against a direct loop transcription of the score in the test. Decoding with a
KV cache (:meth:`ComplexTransformerLM.init_cache`, complex keys and values) equals the
full forward, as for every causal model in posenc.

Not in the encoding registry, on purpose: the registry holds :class:`~posenc.PositionEncoding`
stages that run inside :class:`posenc.Attention` and :class:`posenc.TransformerLM`; this
is a different model (complex activations, a modulus score no backend computes). It
stands beside :mod:`posenc.model`, above the encodings, and uses the encoding
``complex-order`` (:mod:`posenc.encodings.complex`), whose real-ified form is the registered one.

Shape notation as in :mod:`posenc`; ``D`` here is the number of complex features.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import as_positions
from .encodings.complex import ComplexOrder
from .layer.cache import KVCache, ModelCache
from .mask import AttentionMask

__all__ = ["ComplexLinear", "ComplexAttention", "ComplexTransformerLM"]


class ComplexLinear(nn.Module):
    """``z ↦ z·(A + iB)ᵀ (+ b)`` with real parameters ``A``, ``B`` (and complex bias ``b``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.real = nn.Linear(in_features, out_features, bias=bias)
        self.imag = nn.Linear(in_features, out_features, bias=bias)
        for m in (self.real, self.imag):  # Var[W] = 1/in overall (half in each part)
            nn.init.normal_(m.weight, std=(2 * in_features) ** -0.5)
            if bias:
                nn.init.zeros_(m.bias)

    def forward(self, z: Tensor) -> Tensor:
        x, y = z.real, z.imag
        re = self.real(x) - F.linear(y, self.imag.weight)
        im = self.imag(x) + F.linear(y, self.real.weight)
        return torch.complex(re, im)


class ComplexLayerNorm(nn.Module):
    """LayerNorm on the real and on the imaginary part separately."""

    def __init__(self, dim: int):
        super().__init__()
        self.real, self.imag = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, z: Tensor) -> Tensor:
        return torch.complex(self.real(z.real), self.imag(z.imag))


class ComplexAttention(nn.Module):
    """Complex-valued multi-head attention; the score is in the module doc.

    Shapes: ``z`` ``(B, L, D)`` complex64 -> ``(B, L, D)`` complex64.
    """

    def __init__(self, dim: int, heads: int, *, causal: bool = True, conjugate: bool = False):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}")
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.causal, self.conjugate = causal, conjugate
        self.q_proj, self.k_proj = ComplexLinear(dim, dim), ComplexLinear(dim, dim)
        self.v_proj, self.o_proj = ComplexLinear(dim, dim), ComplexLinear(dim, dim)

    def scores(self, q: Tensor, k: Tensor) -> Tensor:
        """``|q·kᵀ|/sqrt(Dh)`` (or with ``conj(k)``): ``(B, H, Lq, Lk)`` float32."""
        k = k.conj() if self.conjugate else k
        return (q @ k.transpose(-1, -2)).abs() / math.sqrt(self.head_dim)

    def init_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty cache of complex keys and values."""
        w = self.q_proj.real.weight
        return KVCache(batch_size, max_len, self.heads, self.head_dim, dtype=torch.complex64, device=w.device)

    def forward(self, z: Tensor, cache: KVCache | None = None) -> Tensor:
        if not z.is_complex() or z.dim() != 3 or z.shape[-1] != self.dim:
            raise ValueError(f"z must be complex of shape (B, L, {self.dim}), got {z.dtype} {tuple(z.shape)}")
        B, L, _ = z.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(B, L, self.heads, self.head_dim).transpose(1, 2)  # (B, H, L, Dh)

        q, k, v = heads(self.q_proj(z)), heads(self.k_proj(z)), heads(self.v_proj(z))
        if cache is not None:
            k, v, _ = cache.update(k, v, torch.zeros(1, L, dtype=torch.long, device=z.device))  # (B, H, Lk, Dh)
        Lk = k.shape[2]
        s = self.scores(q, k)  # (B, H, L, Lk)
        mask = AttentionMask(causal=self.causal, offset=Lk - L).dense(L, Lk, z.device)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        a = torch.softmax(s, dim=-1).to(v.dtype)
        out = (a @ v).transpose(1, 2).reshape(B, L, self.dim)  # (B, L, D)
        return self.o_proj(out)


class ComplexBlock(nn.Module):
    """Pre-norm block with complex attention and a split-activation complex MLP."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, causal: bool, conjugate: bool):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.ln1, self.ln2 = ComplexLayerNorm(dim), ComplexLayerNorm(dim)
        self.attn = ComplexAttention(dim, heads, causal=causal, conjugate=conjugate)
        self.fc, self.proj = ComplexLinear(dim, hidden, bias=True), ComplexLinear(hidden, dim, bias=True)

    def forward(self, z: Tensor, cache: KVCache | None = None) -> Tensor:
        z = z + self.attn(self.ln1(z), cache)
        h = self.fc(self.ln2(z))
        h = torch.complex(F.gelu(h.real), F.gelu(h.imag))
        return z + self.proj(h)


class ComplexTransformerLM(nn.Module):
    """Language model on Complex Order embeddings with complex-valued layers.

    Args:
        vocab_size: number of token ids.
        dim: complex width ``D`` (the real-ified width is ``2D``).
        depth, heads: blocks and attention heads.
        causal: causal LM or bidirectional encoder.
        share_frequency, share_phase: Complex Order options.
        conjugate: Hermitian score (see :class:`ComplexAttention`).

    Shapes: ``tokens`` ``(B, L)`` int64 -> logits ``(B, L, vocab_size)`` float32.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        depth: int,
        heads: int,
        *,
        causal: bool = True,
        mlp_ratio: float = 4.0,
        share_frequency: bool = False,
        share_phase: bool = False,
        conjugate: bool = False,
    ):
        super().__init__()
        self.embedding = ComplexOrder(
            heads=1,
            head_dim=2 * dim,
            causal=causal,
            vocab_size=vocab_size,
            share_frequency=share_frequency,
            share_phase=share_phase,
        )
        self.blocks = nn.ModuleList(ComplexBlock(dim, heads, mlp_ratio, causal, conjugate) for _ in range(depth))
        self.ln_f = ComplexLayerNorm(dim)
        self.head = nn.Linear(2 * dim, vocab_size, bias=False)

    def init_cache(self, batch_size: int, max_len: int) -> ModelCache:
        """An empty KV cache (complex keys and values) for ``batch_size`` sequences of up to ``max_len`` tokens."""
        return ModelCache([b.attn.init_cache(batch_size, max_len) for b in self.blocks])

    def forward(self, tokens: Tensor, pos: Tensor | None = None, cache: ModelCache | None = None) -> Tensor:
        """Logits; with ``cache``, append to it (positions continue from the cached tokens)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (B, L), got {tuple(tokens.shape)}")
        if cache is not None and len(cache.layers) != len(self.blocks):
            raise ValueError(f"cache has {len(cache.layers)} layers, model has {len(self.blocks)}")
        offset = cache.length if cache is not None else 0
        pos = as_positions(pos, tokens.shape[1], offset=offset, device=tokens.device, batch=tokens.shape[0])
        z = self.embedding.complex_embedding(tokens, pos)  # (B, L, D) complex64
        for i, block in enumerate(self.blocks):
            z = block(z, cache.layers[i] if cache is not None else None)
        z = self.ln_f(z)
        return self.head(torch.cat((z.real, z.imag), dim=-1))
