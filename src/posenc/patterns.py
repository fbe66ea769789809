"""Per-layer designs: patterns of layer specs and the named presets of 2025 LLMs.

A model's layers need not share one encoding. Each block is described by a
:class:`posenc.LayerSpec` (encoding, options, attention window, chunk, learned sinks), and
:func:`layers` builds the list from a short pattern::

    posenc.layers("rope*3,nope")                                  # SmolLM3-style
    posenc.layers("rope(base=1e4,window=1024)*5,rope(base=1e6)")  # Gemma 3
    posenc.layers("irope", chunk=32)                              # a preset, scaled down
    posenc.layers("(rope,nope)*2,alibi")                          # groups repeat too

Grammar (whitespace is ignored)::

    pattern := term ("," term)*
    term    := atom ["*" N]
    atom    := NAME ["(" key=value ("," key=value)* ")"]  |  "(" pattern ")"

``NAME`` is a registered encoding or a preset (:data:`PRESETS`). Inside the parentheses
``window``, ``chunk``, ``sinks``, ``kv_heads``, ``score_scale`` and ``softcap`` set the :class:`LayerSpec` fields; every other key is
an encoding option. After a preset name they are overrides (see :func:`layers`). Values
are numbers, ``true``/``false``/``none``, bare words (strings) or JSON objects/lists
(``rope_scaling={"rope_type": "linear", "factor": 2}``).

A model of ``depth`` blocks repeats a pattern cyclically (as HF's ``no_rope_layer_interval``
and ``sliding_window_pattern`` do); a pattern longer than ``depth`` is an error. Repeat
counts are checked against ``depth`` (or :data:`MAX_LAYERS` without one) before anything
is expanded, and groups nest at most :data:`MAX_NESTING` deep.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .layer.spec import SPEC_FIELDS, LayerSpec
from .registry import get_class, options_of, variant_hint

__all__ = ["Preset", "PRESETS", "MAX_LAYERS", "MAX_NESTING", "layers", "parse_pattern", "expand", "is_pattern"]

MAX_LAYERS = 10_000  # the most layers a pattern may describe when no depth bounds it
MAX_NESTING = 50  # the deepest nesting of groups "(...)" (and of JSON values) in a pattern


@dataclass(frozen=True)
class Preset:
    """A named pattern: the layer design of a published model."""

    name: str
    pattern: str
    model: str  # the model family it reproduces
    year: int
    source: str  # where the convention was read


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "irope",
            "rope(layout=interleaved,base=500000,chunk=8192)*3,nope-temperature(attn_scale=0.1,floor_scale=8192)",
            "Llama 4 (iRoPE): NoPE every 4th layer with a log-length query temperature, chunked RoPE elsewhere",
            2025,
            "HF transformers models/llama4/modeling_llama4.py",
        ),
        Preset(
            "smollm3",
            "rope(base=5000000)*3,nope",
            "SmolLM3: RoPE dropped in every 4th layer",
            2025,
            "HF transformers models/smollm3/configuration_smollm3.py",
        ),
        Preset(
            "gemma3",
            "rope(base=10000,window=1024)*5,rope(base=1000000)",
            "Gemma 3: five local layers (window 1024, θ = 10k), then one global (θ = 1M)",
            2025,
            "HF transformers models/gemma3/configuration_gemma3.py",
        ),
        Preset(
            "gpt-oss",
            'rope(base=150000,rope_scaling={"rope_type":"yarn","factor":32.0,"beta_fast":32.0,"beta_slow":1.0,'
            '"truncate":false,"original_max_position_embeddings":4096},window=128,sinks=true),'
            'rope(base=150000,rope_scaling={"rope_type":"yarn","factor":32.0,"beta_fast":32.0,"beta_slow":1.0,'
            '"truncate":false,"original_max_position_embeddings":4096},sinks=true)',
            "gpt-oss: sliding-window (128) and full layers alternating, YaRN RoPE, learned sinks",
            2025,
            "HF transformers models/gpt_oss/modeling_gpt_oss.py",
        ),
        Preset(
            "command-a",
            "rope(layout=interleaved,base=50000,window=4096)*3,nope",
            "Cohere Command A / Command R7B (Cohere 2): three sliding layers (window 4096) with interleaved RoPE, "
            "then one global layer without position encoding",
            2025,
            "HF transformers models/cohere2/modeling_cohere2.py (RoPE only where sliding_window is set), "
            "configuration_cohere2.py (sliding_window 4096, pattern 4); rope_theta 50000 of the released configs",
        ),
        Preset(
            "mistral-large4",
            'lerope(base=10000,rope_scaling={"rope_type":"yarn","factor":2048.0,"original_max_position_embeddings":512,'
            '"beta_fast":32.0,"beta_slow":1.0,"attention_factor":1.0})*3,nope',
            "Mistral Large 4: LeRoPE (learned per-frequency scale, starting at 1) under YaRN (factor 2048 over a "
            "512-token window, attention factor 1) on three layers, NoPE every 4th (the RoPE part of its MLA heads)",
            2026,
            "HF transformers models/mistral_large4/configuration_mistral_large4.py (rope_parameters, no_rope_layers)",
        ),
        Preset(
            "lfm3",
            'rope(base=1000000,partial_rotary_factor=0.5,rope_scaling={"rope_type":"proportional"}),'
            "rope(base=10000,window=256)",
            "LFM3's attention layers: proportional RoPE (θ = 1M, half the pairs) on full layers, alternating with "
            "sliding layers (window 256, θ = 10k); its convolution layers between them are not attention",
            2026,
            "HF transformers models/lfm3/configuration_lfm3.py (rope_parameters per layer type, layer_types)",
        ),
    )
}


# ------------------------------------------------------------------ parsing
_TOKEN = re.compile(r"\s*(?:(?P<punct>[(),*=])|(?P<word>[A-Za-z0-9_.+\-]+))")


class _Parser:
    def __init__(self, text: str, limit: int = MAX_LAYERS, bound: str = "") -> None:
        self.text, self.i = text, 0
        self.limit, self.bound = limit, bound or f"the {MAX_LAYERS} a pattern may describe"
        self.nesting = 0

    def check_count(self, n: int, shown: str | None = None) -> None:
        """Refuse ``n`` layers (written ``shown``) beyond the limit, before they are built."""
        if n > self.limit:
            raise self.error(f"the pattern has {shown or n} layers, more than {self.bound}")

    def error(self, what: str) -> ValueError:
        text = self.text if len(self.text) <= 80 else self.text[:77] + "..."
        return ValueError(f"bad layer pattern {text!r} at offset {self.i}: {what}")

    def peek(self) -> str | None:
        m = _TOKEN.match(self.text, self.i)
        if m is None:
            rest = self.text[self.i :].strip()
            if rest:
                raise self.error(f"unexpected {rest[0]!r}")
            return None
        return m.group("punct") or m.group("word")

    def take(self, expected: str | None = None, *, what: str = "a name") -> str:
        """The next token: ``expected`` punctuation, or a word when ``expected`` is None."""
        m = _TOKEN.match(self.text, self.i)
        tok = None if m is None else (m.group("punct") or m.group("word"))
        if tok is None or tok != (expected or m.group("word")):
            raise self.error(f"expected {expected and repr(expected) or what}, got {tok and repr(tok) or 'the end'}")
        self.i = m.end()
        return tok

    def pattern(self) -> list[LayerSpec]:
        out = self.term()
        self.check_count(len(out))
        while self.peek() == ",":
            self.take(",")
            out += self.term()
            self.check_count(len(out))
        return out

    def term(self) -> list[LayerSpec]:
        specs = self.atom()
        if self.peek() == "*":
            self.take("*")
            n = self.take(what="a repeat count")
            if not n.isdigit() or int(n.lstrip("0") or "0", 10) < 1:
                raise self.error(f"repeat count must be a positive int, got {n!r}")
            digits = n.lstrip("0")
            count = int(digits) if len(digits) <= 18 else 10**18  # (no parse of a huge int: 10**18 > any limit)
            self.check_count(len(specs) * count, None if len(digits) <= 18 else f"{len(specs)} × {n}")
            specs = [replace(s, options=dict(s.options)) for _ in range(count) for s in specs]
        return specs

    def atom(self) -> list[LayerSpec]:
        if self.peek() == "(":
            self.nesting += 1
            if self.nesting > MAX_NESTING:
                raise self.error(f"groups nest more than {MAX_NESTING} deep")
            self.take("(")
            specs = self.pattern()
            self.take(")")
            self.nesting -= 1
            return specs
        name = self.take(what="an encoding or preset name")
        args = self.args() if self.peek() == "(" else {}
        if name in PRESETS:
            return _override(parse_pattern(PRESETS[name].pattern), args, where=name)
        get_class(name)  # unknown names raise, listing the registered ones
        spec = {k: args.pop(k) for k in SPEC_FIELDS if k in args}
        return [_spec(name, args, spec)]

    def args(self) -> dict[str, Any]:
        self.take("(")
        out: dict[str, Any] = {}
        while True:
            key = self.take(what="an option name")
            self.take("=")
            if key in out:
                raise self.error(f"{key!r} given twice")
            out[key] = self.value()
            if self.peek() == ")":
                self.take(")")
                return out
            self.take(",")

    def value(self) -> Any:
        rest = self.text[self.i :].lstrip()
        if rest[:1] in ("{", "["):
            self.i = len(self.text) - len(rest)
            try:
                val, end = json.JSONDecoder().raw_decode(rest)
            except json.JSONDecodeError as e:
                raise self.error(f"bad JSON value: {e.msg}") from None
            except RecursionError:
                raise self.error(f"a JSON value nests more than {MAX_NESTING} deep") from None
            if _json_depth(val) > MAX_NESTING:
                raise self.error(f"a JSON value nests more than {MAX_NESTING} deep")
            self.i += end
            return val
        word = self.take(what="a value")
        low = word.lower()
        if low in ("true", "false"):
            return low == "true"
        if low == "none":
            return None
        for conv in (int, float):
            try:
                return conv(word)
            except ValueError:
                pass
        return word


def _json_depth(v: Any, depth: int = 0) -> int:
    """How deep ``v`` nests dicts and lists (stops counting past :data:`MAX_NESTING`)."""
    if depth > MAX_NESTING or not isinstance(v, (dict, list)):
        return depth
    items = v.values() if isinstance(v, dict) else v
    return max((_json_depth(x, depth + 1) for x in items), default=depth + 1)


def _spec(encoding: str, options: dict, spec: dict) -> LayerSpec:
    valid = options_of(get_class(encoding))
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for encoding {encoding!r} in a layer pattern; valid options: "
            f"{', '.join(valid) or '(none)'}, and the layer fields {', '.join(SPEC_FIELDS)}"
            + variant_hint(encoding, unknown)  # a variant's option: name the variant
        )
    return LayerSpec(encoding, dict(options), **spec)


def _override(specs: list[LayerSpec], args: dict[str, Any], *, where: str) -> list[LayerSpec]:
    """Apply ``args`` to ``specs``: a layer field to the layers that set it (``window`` resizes
    the windowed layers; ``sinks``, ``kv_heads``, ``score_scale``, ``softcap`` apply to all), an encoding option to the layers whose
    encoding accepts it. An argument that applies to no layer is an error."""
    out = [replace(s, options=dict(s.options)) for s in specs]
    for key, val in args.items():
        hit = False
        for s in out:
            if key in ("window", "chunk"):
                if getattr(s, key) is not None:
                    setattr(s, key, val)
                    hit = True
            elif key in ("sinks", "kv_heads", "score_scale", "softcap"):
                setattr(s, key, val)
                hit = True
            elif key in options_of(get_class(s.encoding)):
                s.options[key], hit = val, True
        if not hit:
            raise ValueError(
                f"{key}={val!r} applies to no layer of {where!r} ({', '.join(s.describe() for s in specs)})"
            )
    for s in out:
        s.__post_init__()
    return out


def parse_pattern(pattern: str, max_layers: int | None = None) -> list[LayerSpec]:
    """The layer specs a pattern string describes (one per layer, not yet repeated to a depth).

    ``max_layers``: refuse a pattern of more layers (a model's depth), checked before a
    repeat is expanded; None: :data:`MAX_LAYERS`.
    """
    if not isinstance(pattern, str):
        raise TypeError(f"a layer pattern must be a str, got {type(pattern).__name__}")
    p = _Parser(pattern) if max_layers is None else _Parser(pattern, max_layers, f"depth={max_layers}")
    specs = p.pattern()
    if p.peek() is not None:
        raise p.error(f"unexpected {p.peek()!r}")
    return specs


def layers(pattern: str | Sequence[str | LayerSpec], depth: int | None = None, **overrides) -> list[LayerSpec]:
    """Layer specs from a pattern, a preset name, or a list of names / specs.

    Args:
        pattern: ``"rope*3,nope"``, a preset (``"irope"``, ``"gemma3"``, ...), or a sequence
            of encoding names and :class:`LayerSpec`.
        depth: repeat the pattern cyclically to ``depth`` layers (None: as written).
        **overrides: as in ``preset(key=value)``: ``window``/``chunk`` resize the layers that
            have one, ``sinks`` applies to every layer, an encoding option goes to every layer
            whose encoding takes it (``posenc.layers("irope", chunk=32, floor_scale=16)``).

    Raises:
        ValueError: bad syntax, unknown names or options, an override that applies to no
            layer, or a pattern longer than ``depth``.
    """
    if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 1):
        raise ValueError(f"depth must be a positive int, got {depth!r}")
    if isinstance(pattern, str):
        specs = parse_pattern(pattern, depth)
    elif isinstance(pattern, Sequence) and pattern:
        specs = []
        for item in pattern:
            if isinstance(item, LayerSpec):
                specs.append(replace(item, options=dict(item.options)))
            elif isinstance(item, str):
                specs += parse_pattern(item, depth)
            else:
                raise TypeError(f"layer entries must be encoding names or LayerSpec, got {type(item).__name__}")
    else:
        raise TypeError(f"pattern must be a str or a non-empty sequence of names / LayerSpec, got {pattern!r}")
    if overrides:
        specs = _override(specs, overrides, where=pattern if isinstance(pattern, str) else "the pattern")
    return specs if depth is None else expand(specs, depth)


def expand(specs: Sequence[LayerSpec], depth: int) -> list[LayerSpec]:
    """Repeat ``specs`` cyclically to ``depth`` layers."""
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise ValueError(f"depth must be a positive int, got {depth!r}")
    if len(specs) > depth:
        raise ValueError(
            f"the layer pattern has {len(specs)} layers, more than depth={depth}: "
            f"{', '.join(s.describe() for s in specs)}"
        )
    return [replace(specs[i % len(specs)], options=dict(specs[i % len(specs)].options)) for i in range(depth)]


def is_pattern(name: str) -> bool:
    """True when ``name`` is a preset or pattern rather than one registered encoding."""
    return name in PRESETS or any(c in name for c in ",*()")
