"""Rotary position embedding (RoPE) with its context-extension scalings (xPos: :mod:`.xpos`).

* ``rope`` — Su et al., "RoFormer: Enhanced Transformer with Rotary Position
  Embedding", 2021. Each pair of query/key dimensions is rotated by ``pos · θ_k``,
  ``θ_k = base^(-2k/Dr)``, so ``q̃_i·k̃_j`` depends on ``i - j`` only.

Two layouts of the pairs (``layout=``), converted into each other by
:func:`permute_for_layout` (a permutation of the rows of ``W_Q``/``W_K``):

* ``"half"``: pairs ``(x_k, x_{k+Dr/2})``, HF Llama ``rotate_half`` (also NeoX,
  Mistral, Qwen, Gemma);
* ``"interleaved"``: pairs ``(x_{2k}, x_{2k+1})``, RoFormer, GPT-J, Meta's Llama.

``rope_scaling`` takes HF's dict (``{"rope_type": "linear"|"dynamic"|"yarn"|
"longrope"|"llama3"|"proportional", "factor": …, …}``) and reproduces, operation for operation,
``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` (:mod:`.rope_scaling`): the
same float32 ``inv_freq`` and the same attention factor, which multiplies ``cos`` and ``sin``.

Length-dependent types (``dynamic``, ``longrope``) pick their frequencies from the
length ``s = max(position) + 1`` of the current call. They need ``raw_keys``:
the KV cache holds keys *before* rotation and all of them are rotated again, with
the frequencies of the current length, at every decoding step. A cached step at
length ``s`` therefore sees, in that layer, exactly the scores of a full forward
over the first ``s`` tokens (HF instead caches keys rotated with whatever base was
current when they were written, so one cache mixes several bases).

Angles are ``int64 position × float32 inv_freq`` formed in float64 and rounded once
(bit-identical to HF's float32 product below 2^24), cos/sin in float32 whatever the
activation dtype, and ``inv_freq`` stays float32 through ``model.to(torch.bfloat16)``.

Checked element-wise against HF ``ROPE_INIT_FUNCTIONS`` and Llama
``apply_rotary_pos_emb``, HF RoFormer ``apply_rotary_position_embeddings`` (also on
values), torchtune 0.6.1 ``RotaryPositionalEmbeddings`` / ``Llama3ScaledRoPE``, and
``rotary-embedding-torch``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import functional as PF
from ..base import PositionEncoding
from ..context import table
from ..registry import register
from .rope_scaling import ROPE_REGISTRY, ROPE_TYPES, check_scaling, rope_parameters, rotary_width

__all__ = ["Rotary", "RoPE", "RoPEValue", "ROPE_TYPES", "rope_parameters", "permute_for_layout"]


def permute_for_layout(weight: Tensor, *, heads: int, head_dim: int, to: str, rotary_dim: int | None = None) -> Tensor:
    """Convert a q/k projection between the two RoPE layouts.

    Permutes, within each head, the first ``rotary_dim`` output rows of ``weight``
    (``(H·Dh, D)`` for ``W_Q``/``W_K``, or ``(H·Dh,)`` for their biases) so that a model
    using ``layout="interleaved"`` gives the same scores with ``layout="half"``
    (``to="half"``) or back (``to="interleaved"``). This is the permutation of HF's
    Llama conversion script: ``perm = [0, 2, 4, …, 1, 3, 5, …]``.
    """
    if to not in ("half", "interleaved"):
        raise ValueError(f"to must be 'half' or 'interleaved', got {to!r}")
    r = head_dim if rotary_dim is None else rotary_dim
    if weight.shape[0] != heads * head_dim:
        raise ValueError(f"weight has {weight.shape[0]} rows, expected heads*head_dim = {heads * head_dim}")
    if r % 2 or not 0 < r <= head_dim:
        raise ValueError(f"rotary_dim must be even and in [2, {head_dim}], got {r}")
    perm = PF.interleaved_to_half_perm(r)
    if to == "interleaved":
        perm = torch.argsort(perm)
    perm = torch.cat((perm, torch.arange(r, head_dim))).to(weight.device)
    w = weight.reshape(heads, head_dim, *weight.shape[1:])  # (H, Dh, ...)
    return w[:, perm].reshape(weight.shape)


class Rotary(PositionEncoding):
    """RoPE's frequencies, cos/sin tables and rotation, with HF's scaling variants, and no stage:
    the common base of ``rope`` (:class:`RoPE`, which rotates queries and keys) and
    ``rope-extension`` (whose ``q·k`` term replaces the rotation).

    Args:
        base: ``θ`` (HF ``rope_theta``).
        layout: ``"half"`` (HF Llama / NeoX) or ``"interleaved"`` (RoFormer / GPT-J / Meta).
        partial_rotary_factor: rotate only the first ``Dr = int(Dh·factor)`` dimensions. With
            ``rope_type="proportional"`` (Gemma 4) the tables span all ``Dh`` dims instead, with
            the first ``int(p·Dh // 2)`` frequencies of the full-``Dh`` spectrum and zeros after.
        rope_scaling: HF's dict, ``None`` for plain RoPE. ``rope_theta`` and
            ``partial_rotary_factor`` keys in it override ``base`` and ``partial_rotary_factor``.
        axes: coordinates per position (Heo et al. 2024, "Rotary Position Embedding for
            Vision Transformer"). ``1``: a sequence. ``A = 2`` or ``3`` (axial RoPE): the
            ``Dr/2`` pairs split into ``A`` equal bands, band ``a`` a 1-D RoPE of ``Dr/A``
            dims on coordinate ``a`` (naver-ai/rope-vit ``compute_axial_cis``,
            rotary-embedding-torch ``get_axial_freqs``); positions ``(B|1, L, A)``.
        rope_mixed: RoPE-Mixed (Heo et al. 2024): every head learns its own frequencies,
            pair ``k`` of head ``h`` turning by ``Σ_a pos_a·freqs[a, h, k]``; initialised as
            the axial bands rotated by a random angle per head (``axes >= 2``). The paper
            uses ``base=10`` (mixed) and ``base=100`` (axial) on 14×14 ViT grids.

    Variants with other stages are classes of their own: ``rope-value`` (RoFormer's rotary
    values, :class:`RoPEValue`) and ``rope-extension`` (ReRoPE, Leaky ReRoPE, Self-Extend, Dual
    Chunk Attention: :class:`~posenc.encodings.rope_extended.RoPEExtension`, stage ``SCORES``).
    """

    paper = "Su et al., RoFormer: Enhanced Transformer with Rotary Position Embedding"
    year = 2021
    default_layout = "half"

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
        rope_scaling: dict | None = None,
        axes: int = 1,
        rope_mixed: bool = False,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        self.needs = self.needs.replace(axes=axes)
        self.rope_mixed = bool(rope_mixed)
        layout = self.default_layout if layout is None else layout
        if layout not in ("half", "interleaved"):
            raise ValueError(f"layout must be 'half' or 'interleaved', got {layout!r}")
        if isinstance(rope_scaling, dict):
            base = rope_scaling.get("rope_theta", base)
            partial_rotary_factor = rope_scaling.get("partial_rotary_factor", partial_rotary_factor)
        if not isinstance(partial_rotary_factor, (int, float)) or not 0.0 < partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial_rotary_factor!r}")
        rot = rotary_width(head_dim, partial_rotary_factor, rope_scaling)  # Dh for proportional
        if rot < 2 or rot % 2:
            raise ValueError(
                f"rotary dim head_dim*partial_rotary_factor = {head_dim}*{partial_rotary_factor} = {rot} "
                "must be even and >= 2"
            )
        if not isinstance(base, (int, float)) or base <= 1:
            raise ValueError(f"base must be a number > 1, got {base!r}")
        self.base, self.layout, self.rotary_dim = float(base), layout, rot
        self.partial_rotary_factor = partial_rotary_factor
        self.rope_scaling = check_scaling(rope_scaling, rot, max_len)
        self.rope_type = self.rope_scaling["rope_type"]
        # frequencies depend on the current length: keep raw keys in the KV cache
        self.length_dependent = ROPE_REGISTRY[self.rope_type].length_dependent
        self.needs = self.needs.replace(raw_keys=self.needs.raw_keys or self.length_dependent)
        self.original_max_len = self.rope_scaling.get("original_max_position_embeddings") or max_len
        self.register_buffer("inv_freq", torch.empty(rot // 2), persistent=False)
        self.attention_factor = 1.0
        if self.rope_type == "longrope":
            self.register_buffer("long_inv_freq", torch.empty(rot // 2), persistent=False)
        if self.axes > 1:
            self._check_axes()
            self.register_buffer("axis", torch.empty(rot // 2, dtype=torch.long), persistent=False)
        elif self.rope_mixed:
            raise ValueError("rope_mixed=True mixes the coordinates of several axes: it needs axes >= 2")
        self.init_buffers()
        if self.rope_mixed:  # learned (A, H, Dr/2), from the axial frequencies turned per head
            self.freqs = nn.Parameter(PF.mixed_frequencies(self.inv_freq, self.axes, heads))

    def _params(self, seq_len: int | None = None) -> tuple[Tensor, float]:
        return rope_parameters(
            self.rope_scaling,
            dim=self.rotary_dim,
            base=self.base,
            max_len=self.max_len,
            seq_len=seq_len,
            partial_rotary_factor=self.partial_rotary_factor,
        )

    def _check_axes(self) -> None:
        """Options that do not combine with positions with axes."""
        if self.length_dependent:
            raise ValueError(
                f"rope_type {self.rope_type!r} picks frequencies from the sequence length; with axes={self.axes} "
                "use a static type (linear, yarn, llama3) or none"
            )
        if (self.rotary_dim // 2) % self.axes:
            raise ValueError(
                f"axial RoPE splits the {self.rotary_dim // 2} rotary pairs into axes={self.axes} equal bands: "
                f"rotary dim {self.rotary_dim} must be a multiple of 2*axes = {2 * self.axes}"
            )

    def axis_frequencies(self) -> tuple[Tensor, Tensor, float]:
        """``(inv_freq, axis, attention_factor)``, ``(Dr/2,)`` each, for ``axes > 1``: pair ``k``
        turns by ``pos[axis[k]]·inv_freq[k]``. Axial: band ``a`` holds the 1-D frequencies of
        a ``Dr/A``-dim RoPE (``base^(-2k·A/Dr)``) on coordinate ``a``."""
        n = self.rotary_dim // 2 // self.axes
        inv, factor = rope_parameters(
            self.rope_scaling, dim=2 * n, base=self.base, max_len=self.max_len, partial_rotary_factor=1.0
        )
        return inv.repeat(self.axes), torch.arange(self.axes).repeat_interleave(n), factor

    def init_buffers(self) -> None:
        device = self.inv_freq.device
        if self.axes > 1:
            inv_freq, axis, self.attention_factor = self.axis_frequencies()
            self.inv_freq, self.axis = inv_freq.to(device), axis.to(device)
            self._mark_built()
            return
        inv_freq, self.attention_factor = self._params()
        self.inv_freq = inv_freq.to(device)
        if self.rope_type == "longrope":
            self.long_inv_freq = self._params(self.original_max_len + 1)[0].to(device)
        self._mark_built()

    # ------------------------------------------------------------------ per-call tables
    def _mark_built(self) -> None:
        """Remember the buffers :meth:`init_buffers` made from the options (see :meth:`table_key`)."""
        self._built = tuple(self._buffers.values())

    def table_key(self) -> tuple[object, str] | None:
        """``(owner, name)`` this instance's cos/sin tables are filed under in the call's memo.

        An instance of a class that declares its own ``_table_fields``, whose buffers are
        still the ones :meth:`init_buffers` built, is filed under its class and the values
        of those fields (and the device): layers with equal RoPE options compute their
        tables once per call, layers with different options never share. Otherwise (a
        subclass that does not say what fixes its tables, buffers replaced by hand) under
        the instance itself. None (no memo) for RoPE-Mixed: its angles are learned.
        """
        if self.rope_mixed:
            return None
        built, now = self.__dict__.get("_built", ()), tuple(self._buffers.values())
        memo = self.__dict__.get("_table_key_memo")  # (buffers, options, key): set an option, and it is dropped
        if memo is not None and len(memo[0]) == len(now) and all(a is b for a, b in zip(memo[0], now)):
            return memo[2]
        fields = type(self).__dict__.get("_table_fields")
        if fields is None or len(built) != len(now) or any(a is not b for a, b in zip(built, now)):
            return self, self.name
        values = (self.inv_freq.device, *(getattr(self, f) for f in fields))
        if memo is None or memo[1] != values:  # (the repr once per change of the options, not per call)
            memo = (now, values, (type(self), f"{self.name}:{values[0]}:{repr(values[1:])}"))
        self.__dict__["_table_key_memo"] = (now, values, memo[2])
        return memo[2]

    def __setattr__(self, name: str, value) -> None:
        if name in (type(self).__dict__.get("_table_fields") or ()):
            self.__dict__.pop("_table_key_memo", None)  # (table_key looks at the options again)
        super().__setattr__(name, value)

    def _tables(self, ctx, pos: Tensor, length: int, seq_len: int) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """``(positions with axes, (cos, sin))`` of ``pos`` for a tensor of ``length`` tokens, once
        per model call for the layers whose encodings share a :meth:`table_key`."""

        def make():
            p = self.axis_positions(pos, length) if self.axes > 1 else pos
            return p, self._cos_sin(p, self.frequencies(seq_len))

        key = self.table_key()
        if key is None:
            return make()
        return table(ctx, key[0], f"{key[1]}:{length}:{seq_len}", (pos,), make)

    @property
    def relative(self) -> bool:
        return True

    def extra_repr(self) -> str:
        s = super().extra_repr() + f", base={self.base}, layout={self.layout!r}, rotary_dim={self.rotary_dim}"
        s += f", axes={self.axes}" + (", rope_mixed=True" if self.rope_mixed else "") if self.axes > 1 else ""
        return s + (f", rope_scaling={self.rope_scaling}" if self.rope_type != "default" else "")

    # ------------------------------------------------------------------ rotation
    def frequencies(self, seq_len: int) -> Tensor:
        """``inv_freq`` used for a call whose longest position is ``seq_len - 1``."""
        if self.rope_type == "dynamic" and seq_len > self.original_max_len:
            return self._params(seq_len)[0].to(self.inv_freq.device)
        if self.rope_type == "longrope" and seq_len > self.original_max_len:
            return self.long_inv_freq
        return self.inv_freq

    def _cos_sin(self, pos: Tensor, inv_freq: Tensor, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Full-width tables ``(…, L, Dr)`` such that ``x̃ = x·cos + swap(x)·sin`` in this layout.

        ``swap`` exchanges the two members of each pair; the sign of the sine is folded into
        ``sin``, so a rotation is one copy, two products and a sum (few passes over ``x``,
        which matters on CPU, where each elementwise op costs a thread wake-up).
        """
        ang = self.angles(pos, inv_freq)  # (B|1, 1|H, L, Dr/2) or (L, Dr/2), float32
        cos, sin = ang.cos(), ang.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        if scale is not None:  # xPos: one factor per pair
            cos, sin = cos * scale, sin * scale
        if self.layout == "half":
            return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        return cos.repeat_interleave(2, -1), torch.stack((-sin, sin), -1).flatten(-2)

    def angles(self, pos: Tensor, inv_freq: Tensor) -> Tensor:
        """Rotation angles: ``(L, Dr/2)`` for ``(L,)`` positions, ``(B|1, 1, L, Dr/2)`` for ``(B|1, L)``
        and, with axes, ``(B|1, 1, L, Dr/2)`` (axial, M-RoPE) or ``(B|1, H, L, Dr/2)`` (mixed)."""
        if self.axes == 1:
            ang = PF.rope_angles(pos, inv_freq)  # (B|1, L, Dr/2) or (L, Dr/2), float32
            return ang.unsqueeze(1) if pos.dim() == 2 else ang
        if self.rope_mixed:
            return PF.mixed_rope_angles(pos, self.freqs)
        return PF.axial_rope_angles(pos, inv_freq, self.axis).unsqueeze(1)

    def _swap(self, x: Tensor) -> Tensor:
        if self.layout == "half":  # [x1 | x2] -> [x2 | x1]: one op (each costs a launch on CPU)
            return x.roll(x.shape[-1] // 2, dims=-1)
        return torch.stack((x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

    def _rotate_one(self, x: Tensor, pos: Tensor, tables: tuple[Tensor, Tensor]) -> Tensor:
        if x.dim() != 4:
            raise ValueError(f"expected a (B, H, L, Dh) tensor, got shape {tuple(x.shape)}")
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"expected head dim {self.head_dim}, got shape {tuple(x.shape)}")
        n = pos.shape[-2] if self.axes > 1 else pos.shape[-1]
        if x.shape[-2] != n:
            raise ValueError(f"positions of length {n} for a tensor of length {x.shape[-2]}")
        cos, sin = tables
        r = self.rotary_dim
        xr = x[..., :r].float() if r < x.shape[-1] else x.float()
        out = (xr * cos + self._swap(xr) * sin).to(x.dtype)  # (two products and a sum: HF's rounding, bit for bit)
        return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)

    def _seq_len(self, *positions: Tensor) -> int:
        if not self.length_dependent:
            return 0
        return max(int(p.max()) for p in positions if p.numel()) + 1


# Queries and keys of at most this many elements together (a decoding step's new rows) are
# rotated as one tensor: each elementwise op on CPU costs a few microseconds to launch whatever
# its size, so one rotation instead of two is what counts there (a copy of both is the price,
# which only small tensors can afford).
JOINT_MAX = 1 << 14


@register
class RoPE(Rotary):
    """Rotary embedding (``rope``): queries and keys rotated by their positions. Options (see
    :class:`Rotary`): ``base``, ``layout``, ``partial_rotary_factor``, ``rope_scaling``, ``axes``
    (axial RoPE), ``rope_mixed``."""

    name = "rope"

    # the options that fix this class's tables (with the buffers init_buffers builds from
    # them); a subclass shares tables across instances only if it declares its own tuple
    _table_fields = (
        "base",
        "layout",
        "rotary_dim",
        "head_dim",
        "partial_rotary_factor",
        "rope_scaling",
        "max_len",
        "original_max_len",
        "axes",
        "attention_factor",
    )

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, ctx=None) -> tuple[Tensor, Tensor]:
        seq_len = self._seq_len(q_pos, k_pos)  # (length-dependent types only: none with axes)
        qp, q_tab = self._tables(ctx, q_pos, q.shape[-2], seq_len)
        # without a cache the keys are the queries: one table
        if k_pos is not q_pos:
            kp, k_tab = self._tables(ctx, k_pos, k.shape[-2], seq_len)
            return self._rotate_one(q, qp, q_tab), self._rotate_one(k, kp, k_tab)
        cos = q_tab[0]  # (one table for every head; RoPE-Mixed's differ per head)
        same = q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:] and q.dtype == k.dtype
        if same and q.numel() + k.numel() <= JOINT_MAX and (cos.dim() < 4 or cos.shape[1] == 1):
            both = self._rotate_one(torch.cat((q, k), 1), qp, q_tab)  # (one pass: decoding's few rows)
            return both[:, : q.shape[1]], both[:, q.shape[1] :]
        return self._rotate_one(q, qp, q_tab), self._rotate_one(k, qp, q_tab)


@register
class RoPEValue(RoPE):
    """``rope-value``: RoPE that also rotates the values by their key position (RoFormer's
    ``rotary_value``; HF RoFormer ``apply_rotary_position_embeddings`` on ``v``). Options as
    ``rope``'s (``axes`` included).

    Not ``relative``: the output turns with the keys' absolute positions
    (``o_i = Σ_j a_ij R_j v_j``; shifting every position by ``s`` gives ``R_s o_i``).
    """

    name = "rope-value"
    _table_fields = RoPE._table_fields  # the same tables as rope's: shared with equal options

    @property
    def relative(self) -> bool:
        return False

    def rotate_value(self, v: Tensor, k_pos: Tensor, ctx=None) -> Tensor:
        kp, tab = self._tables(ctx, k_pos, v.shape[-2], self._seq_len(k_pos))
        return self._rotate_one(v, kp, tab)
