"""Convolutional position information: a depthwise convolution over the sequence.

Islam, Jia, Bruce, "How Much Position Information Do Convolutional Neural Networks
Encode?", ICLR 2020: absolute position is decodable from zero-padded CNN features
because the padding marks the sequence boundary. Chu et al., "Conditional Positional
Encodings for Vision Transformers" (CPVT), 2021/ICLR 2023, use the same mechanism as a
position encoding (the PEG: ``x + DWConv(x)``). Here, on the embeddings::

    embed(x) = x + DWConv_k(x)      # depthwise over L, one kernel of size k per channel

``padding``: ``"zeros"`` (position leaks through the boundary), ``"circular"``
(bidirectional only: wrapping in causal mode would read future tokens; the model is then
exactly shift-equivariant on periodic inputs), ``"none"`` (no padding: tokens whose
window crosses the boundary get no conv term, ``embed(x) = x`` there). Causal mode pads
on the left only, so token ``t`` sees tokens ``t−k+1 .. t``; bidirectional mode needs an
odd ``k`` and pads ``(k−1)/2`` on each side.

The conv works by index, like the causal mask, with one use of ``pos``: a sequence starts
at position 0, so the window of a token at position ``p`` reaches at most ``p`` tokens back
(``"zeros"`` and ``"none"``; the earlier inputs count as padding). A left-padded row (pad
tokens first, positions starting at 0 on the first real token, the pads masked) then gives
its real tokens exactly the conv terms of the unpadded sequence instead of reading the
pads, and a packed document's first tokens do not read the previous document. With the
default positions (``p`` = the index, or more) nothing changes, so ``relative`` is True in
posenc's sense (shifting every position up changes nothing), though absolute position
leaks through the padding, which is the point of Islam et al.

KV-cache decoding: token ``t`` needs the inputs of the ``k−1`` tokens before it, which an
earlier call saw. The encoding needs ``input_context = k − 1`` (causal mode), so the
cache keeps those inputs and runs ``embed`` on them followed by the new ones
(:class:`posenc.layer.cache.InputHistory`); decoding token by token equals the full forward.
Checked against a direct transcription of the convolution sum (test).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base import PositionEncoding
from ..registry import register


@register
class Conv(PositionEncoding):
    """Depthwise convolution over the sequence added to the input; see the module doc."""

    name = "conv"
    paper = "Islam et al., How Much Position Information Do Convolutional Neural Networks Encode?"
    year = 2020

    def __init__(self, *, heads, head_dim, max_len=None, causal=True, kernel_size: int = 3, padding: str = "zeros"):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if padding not in ("zeros", "circular", "none"):
            raise ValueError(f"padding must be 'zeros', 'circular' or 'none', got {padding!r}")
        if not isinstance(kernel_size, int) or kernel_size < 1:
            raise ValueError(f"kernel_size must be a positive int, got {kernel_size!r}")
        if causal and padding == "circular":
            raise ValueError("padding='circular' wraps future tokens into the window; use it with causal=False")
        if not causal and kernel_size % 2 == 0:
            raise ValueError(f"bidirectional conv needs an odd kernel_size (centred window), got {kernel_size}")
        self.kernel_size, self.padding = kernel_size, padding
        # decoding reads the k - 1 inputs before each token (a centred window would need future ones)
        self.needs = self.needs.replace(input_context=kernel_size - 1 if causal else 0)
        self.conv = nn.Conv1d(self.dim, self.dim, kernel_size, groups=self.dim)  # depthwise

    @property
    def relative(self) -> bool:
        return True

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel_size={self.kernel_size}, padding={self.padding!r}"

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (B, L, {self.dim}), got {tuple(x.shape)}")
        B, L, _ = x.shape
        k = self.kernel_size
        w, b = self.conv.weight.to(x.dtype), self.conv.bias.to(x.dtype)
        if self.causal:
            xin = F.pad(x, (0, 0, k - 1, 0))  # (B, k−1+L, D): zero padding on the left only
            first = k - 1  # the first index whose window lies inside the sequence
        else:
            h = first = (k - 1) // 2
            if self.padding == "circular":
                xin = x[:, torch.arange(-h, L + h, device=x.device) % L]  # (B, L+2h, D), wrapped
            else:
                xin = F.pad(x, (0, 0, h, h))  # (B, L+2h, D), zeros
        out = F.conv1d(xin.transpose(1, 2), w, b, groups=self.dim).transpose(1, 2)  # (B, L, D)
        if self.padding == "circular":
            return x + out
        pos = pos.reshape(-1, L)  # (B|1, L)
        if self.padding == "none":
            index = torch.arange(L, device=x.device)
            inside = (index >= first) & (pos >= first)  # (B|1, L): the window starts at or after position 0
            if not self.causal:
                inside = inside & (index <= L - 1 - first)
            return x + out * inside.to(out.dtype).unsqueeze(-1)  # no conv term where the window leaves the sequence
        # zeros: take out the taps that reach before position 0 (d back from a token at position p < d).
        # Tap j of the causal window reads d = k-1-j back, of the centred one d = h-j; with default
        # positions those taps read the zero padding, so the correction is exactly 0 there.
        for d in range(1, first + 1):
            j = first - d
            before = (pos < d).to(x.dtype).unsqueeze(-1)  # (B|1, L, 1)
            out = out - xin[:, j : j + L] * w[:, 0, j] * before
        return x + out
