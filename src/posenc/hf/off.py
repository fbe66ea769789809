"""The model's own position handling, switched off: the stand-ins a converted model puts in its place.

A converted model runs posenc's encoding in the attention function, so what the stock model does
with positions is switched off where it happens:

* a rotary embedding: :class:`RotaryOff` returns the identity rotation (``cos = 1``, ``sin = 0``),
  marked (:data:`IDENTITY`) so that the modeling code's ``apply_rotary_pos_emb``, wrapped by
  :func:`skip_identity`, returns q and k as they are instead of computing ``q·1 + rotate_half(q)·0``;
  where sub-modules of the attention read the model's own rotation for something other than the
  layer's q/k (:attr:`posenc.hf.families.Family.own_rotation`: the DSA indexer of Mistral Large 4,
  which picks each query's keys with its own RoPE), the rotary module stays and a
  :class:`RotaryTap` hands the layers the identity and those sub-modules the stock ``cos``/``sin``;
* an absolute table (GPT-2's ``wpe``): :class:`PositionsOff` adds nothing;
* parts of the attention modules (:attr:`~posenc.hf.families.Family.off_parts`): :class:`PartOff`;
* q/k norms a model applies after its RoPE (:attr:`~posenc.hf.families.Family.norms_after`): their
  call from the module returns its input (a forward hook; the weights stay where they are), and the
  attention function runs them after posenc's rotation (:func:`norms_after`).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

__all__ = [
    "RotaryOff",
    "RotaryTap",
    "PositionsOff",
    "PartOff",
    "norms_after",
    "switch_off",
    "switch_off_parts",
    "rotary_stand_in",
    "skip_identity",
    "IDENTITY",
]

TAP = "posenc_tap"  # the attribute of a kept rotary module: its RotaryTap
IDENTITY = "posenc_identity"  # the attribute that marks the cos tensor of RotaryOff's identity rotation
SKIPS = "posenc_skips_identity"  # the attribute of a wrapped apply_rotary_pos_emb


class RotaryOff(nn.Module):
    """Stands in for a model's rotary embedding: the identity rotation, ``cos = 1``, ``sin = 0``.

    ``q·1 + rotate_half(q)·0`` is ``q`` exactly, so posenc rotates (or not) in the attention
    function instead. Takes what the family's rotary module takes (Gemma 3 and ModernBERT add
    a layer type). With ``complex_pairs`` it returns DeepSeek-V2's ``freqs_cis`` form, ``1 + 0i``.
    Multimodal position ids ``(A, B, L)`` (Qwen2-VL's ``t, h, w``, as the model
    built them) are kept in :attr:`positions` for the attention function of this forward.
    """

    def __init__(self, head_dim: int | dict, complex_pairs: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim  # or {layer_type: width} where layer types differ (Gemma 4)
        self.complex_pairs = complex_pairs  # DeepSeek-V2: one complex freqs_cis 1 + 0i per pair
        self.positions: Tensor | None = None
        self.past: Tensor | None = None  # (A, B, c): positions of the cached tokens (posenc.hf.history)

    def forward(self, x: Tensor, position_ids: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.positions = position_ids if position_ids.dim() == 3 else None
        width = self.head_dim
        if isinstance(width, dict):
            width = width[args[0] if args else kwargs["layer_type"]]
        shape = (*position_ids.shape[-2:], width)  # (B|1, L, Dh)
        if self.complex_pairs:  # (B|1, L, Dh/2) complex: x·(1 + 0i) = x exactly
            return torch.ones(*shape[:-1], width // 2, dtype=torch.complex64, device=x.device)
        cos = x.new_ones(shape)
        setattr(cos, IDENTITY, True)  # (skip_identity's wrapper returns q, k for it)
        return cos, x.new_zeros(shape)


def skip_identity(attentions: list[nn.Module]) -> None:
    """Wrap the ``apply_rotary_pos_emb(q, k, cos, sin, ...)`` that each attention module's
    ``forward`` calls (a global of the modeling module that defines it: HF's function, or the
    ``kernels`` package's module standing for it) so that a call with :class:`RotaryOff`'s marked
    identity returns ``(q, k)`` as they are: the values ``q·1 + rotate_half(q)·0`` has, without
    its four multiplies, two adds and two ``rotate_half`` per layer (a decoding step of a
    converted model would otherwise rotate twice where a stock one rotates once). Any other call
    (a stock model's in the same process, or any call under ``torch.compile``) runs what was there,
    after one check. Only a function whose first four parameters are ``q, k, cos, sin``, all
    required (HF's common form, which returns ``(q, k)``), is wrapped; elsewhere the identity is
    computed as before. Idempotent."""
    for attn in attentions:
        scope = getattr(inspect.unwrap(type(attn).forward), "__globals__", {})
        fn = scope.get("apply_rotary_pos_emb")
        if callable(fn) and not getattr(fn, SKIPS, False) and _takes_q_k_cos_sin(fn):
            scope["apply_rotary_pos_emb"] = _skipping(fn)


def _takes_q_k_cos_sin(fn) -> bool:
    try:  # (the kernels package's stand-in is a module; its forward has the function's signature)
        sig = inspect.signature(type(fn).forward if isinstance(fn, nn.Module) else fn)
    except (TypeError, ValueError):
        return False
    params = [p for p in sig.parameters.values() if p.name != "self"][:4]
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params] == ["q", "k", "cos", "sin"] and all(
        p.kind in plain and p.default is inspect.Parameter.empty for p in params
    )


def _skipping(fn):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if getattr(cos, IDENTITY, False) and not torch.compiler.is_compiling():
            # (HF's cache update concatenates the keys: contiguous ones, as a stock model's rotated
            # keys are, take torch.cat's plain copy; SmolLM2 at 2 048 cached rows: 40 µs less a layer)
            return q, k.contiguous()
        return fn(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__wrapped__ = fn
    setattr(apply_rotary_pos_emb, SKIPS, True)
    return apply_rotary_pos_emb


class PartOff(nn.Module):
    """Stands in for a part of an attention module that is the model's own position handling
    (:attr:`posenc.hf.families.Family.off_parts`): returns None (a bias HF then leaves out) or its
    first input unchanged (a position-dependent scale)."""

    def __init__(self, returns: str) -> None:
        super().__init__()
        if returns not in ("none", "input"):
            raise ValueError(f"a part's stand-in returns 'none' or 'input', got {returns!r}")
        self.returns = returns

    def forward(self, x, *args, **kwargs):
        return None if self.returns == "none" else x


def switch_off_parts(attentions: list[nn.Module], parts: tuple) -> None:
    """Replace each ``(path, returns)`` of ``parts`` under every attention module by a :class:`PartOff`
    (a module without that path keeps what it has)."""
    for attn in attentions:
        for path, returns in parts:
            owner_path, _, name = path.rpartition(".")
            try:
                owner = attn.get_submodule(owner_path) if owner_path else attn
            except AttributeError:
                continue
            if isinstance(getattr(owner, name, None), nn.Module):
                setattr(owner, name, PartOff(returns))


class PositionsOff(nn.Module):
    """Stands in for GPT-2's ``wpe``: adds nothing.

    Returns a 0-d float32 zero, which adds to embeddings of any float dtype without
    promoting them (and, holding no buffer, needs no initialisation when loaded).
    """

    def forward(self, position_ids: Tensor) -> Tensor:
        return torch.zeros((), device=position_ids.device)


class RotaryTap:
    """Forward hook of a rotary module the model keeps (:attr:`Family.own_rotation`): the layers get
    :attr:`off`'s identity rotation, and the sub-modules that read the model's own rotation the stock
    ``(cos, sin)`` of the same call through :meth:`give`, their forward pre-hook."""

    def __init__(self, off: RotaryOff) -> None:
        self.off = off
        self.stock: tuple | None = None  # this forward's (cos, sin), as the model computes them
        self.identity: tuple | None = None  # and what the layers received instead

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output):
        x = args[0] if args else kwargs["x"]
        position_ids = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
        self.stock = output
        self.identity = self.off(x, position_ids)
        return self.identity

    def give(self, module: nn.Module, args: tuple, kwargs: dict):
        """The stock ``(cos, sin)`` in place of the identity rotation among ``module``'s arguments."""
        if self.identity is None:
            return None
        args = tuple(self.stock if a is self.identity else a for a in args)
        kwargs = {k: self.stock if v is self.identity else v for k, v in kwargs.items()}
        return args, kwargs


def switch_off(base: nn.Module, attentions: list[nn.Module], family, width) -> RotaryOff | None:
    """Switch ``family``'s own position handling off in the language model ``base`` (its attention
    modules ``attentions``); ``width``: the rotary stand-in's ``cos``/``sin`` width
    (:meth:`Family.rotary_widths`). Returns the rotary stand-in the layer records keep (None: none)."""
    off = None
    if family.rotary_off:
        off = RotaryOff(width, complex_pairs=family.off == "complex")
        if not off.complex_pairs:
            skip_identity(attentions)
        if family.own_rotation:  # the model's rotary stays, for the sub-modules that read it
            tap = RotaryTap(off)
            rotary = getattr(base, family.positions)
            rotary.register_forward_hook(tap, with_kwargs=True)
            rotary.__dict__[TAP] = tap
            for attn in attentions:
                for path in family.own_rotation:
                    sub = getattr(attn, path, None)
                    if isinstance(sub, nn.Module):
                        sub.register_forward_pre_hook(tap.give, with_kwargs=True)
        else:
            setattr(base, family.positions, off)
    elif family.off != "none":
        setattr(base, family.positions, PositionsOff())
    switch_off_parts(attentions, family.off_parts)
    for attn in attentions:
        for norm in norms_after(attn, family.norms_after) or ():
            norm.register_forward_hook(_input_unchanged)
    return off


def _input_unchanged(module: nn.Module, args: tuple, output):
    """Forward hook of a q/k norm the attention function runs instead: the module's call is the identity."""
    return args[0]


def norms_after(attn: nn.Module, names: tuple) -> tuple[nn.Module, nn.Module] | None:
    """The ``(q norm, k norm)`` modules ``names`` of ``attn`` (None: no names, or a module without them)."""
    if not names:
        return None
    found = tuple(getattr(attn, n, None) for n in names)
    return found if all(isinstance(m, nn.Module) for m in found) else None


def rotary_stand_in(base: nn.Module, family) -> RotaryOff | None:
    """The rotary stand-in :func:`switch_off` put in ``base`` (None for a family without a rotary)."""
    if not family.rotary_off:
        return None
    module = getattr(base, family.positions)
    tap = module.__dict__.get(TAP)
    return tap.off if tap is not None else module
