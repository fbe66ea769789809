"""``rope-extension``: RoPE whose ``q·k`` term is ReRoPE's, Leaky ReRoPE's, Self-Extend's or
Dual Chunk Attention's (Su, "ReRoPE: Rectified Rotary Position Embeddings", 2023; Jin et al.,
"LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning", ICML 2024; An et al.,
"Training-Free Long-Context Scaling of Large Language Models", ICML 2024).

The methods themselves (the score maps merged by distance or by chunk, the references they are
checked against) are in :mod:`.rope_extension`. They change what the encoding *is*: there
is no q/k stage (the KV cache holds raw keys) and the whole ``q·k`` term comes from
:meth:`RoPEExtension.qk_scores`, the ``SCORES`` stage, which only the backends that
materialise scores run (``chunked``, ``eager``), and :meth:`RoPEExtension.score_maps`, the same
maps one by one for the ``maps`` backend (the CPU's fused kernel). So they are a registered class of their
own, built by its name (``posenc.build("rope-extension", rope_extension=...)``), beside
``rope`` on the common base :class:`~posenc.encodings.rotary.Rotary` (RoPE's tables,
no stage).
"""

from __future__ import annotations

from torch import Tensor

from ..registry import register
from .rope_extension import check_extension, extended_qk_scores, score_maps
from .rotary import Rotary

__all__ = ["RoPEExtension"]


@register
class RoPEExtension(Rotary):
    """RoPE under an inference-time extension of its attention pattern.

    Args:
        rope_extension: ReRoPE ``{"type": "rerope", "window": w}``, Leaky ReRoPE
            ``{"type": "leaky-rerope", "window": w, "factor": k}``, Self-Extend
            ``{"type": "self-extend", "window": W, "group_size": G}``, each with an optional
            ``"scale_base"`` (log-n query scaling; ReRoPE's default is ``max_len``, as in
            bojone/rerope; ``None`` turns it off); Dual Chunk Attention ``{"type": "dca",
            "chunk_size": c, "local_size": l}`` (vLLM's names). Default: ReRoPE with a window of
            ``max_len // 4`` (512 without ``max_len``).
        base, layout, partial_rotary_factor: RoPE's. Plain 1-D RoPE only: the extensions are
            defined without ``axes`` or ``rope_scaling`` (nor ``rope-value``'s rotated values).
    """

    name = "rope-extension"
    paper = "Su, ReRoPE (2023); Jin et al., LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning"
    year = 2024
    causal_only = True  # both references are decoders

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        base: float = 10000.0,
        layout: str | None = None,
        partial_rotary_factor: float = 1.0,
        rope_extension: dict | None = None,
    ):
        super().__init__(
            heads=heads,
            head_dim=head_dim,
            max_len=max_len,
            causal=causal,
            base=base,
            layout=layout,
            partial_rotary_factor=partial_rotary_factor,
        )
        if rope_extension is None:
            rope_extension = {"type": "rerope", "window": max(1, max_len // 4) if max_len else 512}
        self.rope_extension = check_extension(rope_extension, causal=causal, max_len=max_len)

    @property
    def relative(self) -> bool:
        # Self-Extend's groups floor(i/G), DCA's chunks floor(i/n) and the log-n scaling read
        # absolute positions
        ext = self.rope_extension
        return ext["type"] in ("rerope", "leaky-rerope") and ext["scale_base"] is None

    def extra_repr(self) -> str:
        return super().extra_repr() + f", rope_extension={self.rope_extension}"

    def qk_scores(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, ctx=None) -> Tensor:
        """The merged score maps, float32 ``(B, H, Lq, Lk)`` (unrotated ``q``, ``k``)."""
        return extended_qk_scores(self, q, k, q_pos, k_pos)

    def score_maps(self, ctx=None):
        """The same term as its score maps, each with the pairs it holds (the ``maps`` backend)."""
        return score_maps(self)
