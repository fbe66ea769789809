"""The encoding contract of issue 63 (part 2): stages are the stage methods a class defines, one
frozen record of needs, a kind derived from the stages, no class picked by option names, and
the posenc 0.x spellings working for one release with a ``DeprecationWarning``.
"""

from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch
from tests.conftest import assert_close, attention_n

import posenc
from posenc import PositionEncoding, Stage
from posenc.cli import KIND_ORDER, encoding_rows
from posenc.contract import HOOKS, KINDS, STAGE_OF, Needs, kind_of, stages_of
from posenc.layer.setup import build_for_layer

HEADS, HEAD_DIM = 2, 8
DIM = HEADS * HEAD_DIM


def _build(name: str, **options) -> PositionEncoding:
    return posenc.build(name, heads=HEADS, head_dim=HEAD_DIM, max_len=16, **options)


# ------------------------------------------------------------------ stages are the methods
@pytest.mark.parametrize("name", posenc.available())
def test_stages_are_the_stage_methods_the_class_defines(name):
    cls = posenc.get_class(name)
    defined = {m for m in HOOKS if getattr(cls, m) is not getattr(PositionEncoding, m)}
    assert {m for m in HOOKS if cls.defines(m)} == defined
    assert cls.stages == stages_of(frozenset(defined))
    for method, stage in STAGE_OF.items():  # every stage it has comes from a method it defines
        if cls.defines(method):
            assert cls.stages & stage, (name, method)
    assert cls.kind == kind_of(cls.stages) and cls.kind in KIND_ORDER
    # instance and class agree; nothing in the class body declares them
    enc = _build(name)
    assert enc.stages == cls.stages and enc.kind == cls.kind
    old = r"^    (stages|family|variants|input_at|input_context|cache_raw_keys|memory_len|share_across_layers)\s*="
    assert not re.search(old, inspect.getsource(cls), re.M), name


def test_the_kinds_of_the_registered_encodings():
    kinds = {n: posenc.get_class(n).kind for n in posenc.available()}
    assert kinds["nope"] == "none" and kinds["sinusoidal"] == kinds["conv"] == "input"
    assert kinds["rope"] == kinds["xpos"] == kinds["nope-temperature"] == kinds["rope-value"] == "qk"
    assert kinds["tupe"] == kinds["alibi"] == "bias"  # tupe: a bias stage (was family "absolute")
    assert kinds["cope"] == kinds["shaw"] == kinds["deberta-emd"] == "terms"  # cope: terms (was "bias")
    assert kinds["rope-extension"] == "scores" and kinds["fox"] == kinds["inkling-temperature"] == "hidden"
    assert [k for k, _ in KINDS][::-1] + ["none"] == list(KIND_ORDER[1:]) + ["none"]
    rows = encoding_rows()  # posenc list: grouped by kind, in the order position enters attention
    assert [KIND_ORDER.index(r["kind"]) for r in rows] == sorted(KIND_ORDER.index(r["kind"]) for r in rows)


def test_a_variant_never_inherits_a_stage_it_must_not_have():
    """rope-extension shares RoPE's tables through a common base, not RoPE's rotate; deberta has
    no embed of its own (the EMD's is deberta-emd's); inkling has no rotate (its temperature's)."""
    for name, method in (("rope-extension", "rotate"), ("deberta", "embed"), ("inkling", "rotate"), ("rope", "rotate_value")):  # fmt: skip
        assert not posenc.get_class(name).defines(method), name
    assert posenc.get_class("rope-extension").stages == Stage.SCORES
    assert posenc.get_class("inkling").stages == Stage.READ | Stage.BIAS
    assert posenc.get_class("inkling-temperature").stages == Stage.READ | Stage.QK | Stage.BIAS
    with pytest.raises(ValueError, match="defines\\(\\) answers for the stage methods"):
        posenc.get_class("rope").defines("forward")


def test_an_instance_cannot_change_its_stages_kind_or_needs():
    enc = _build("rope")
    for name, value in (("stages", Stage.BIAS), ("kind", "bias")):
        with pytest.raises(AttributeError, match=f"{name} follows the stage methods its class defines"):
            setattr(enc, name, value)
    with pytest.raises(AttributeError, match="needs is fixed at construction"):
        enc.needs = Needs(raw_keys=True)
    with pytest.raises(AttributeError, match="cache_raw_keys is fixed at construction"):
        enc.cache_raw_keys = True
    with pytest.raises(dataclass_frozen_error()):
        enc.needs.raw_keys = True
    assert enc.stages == Stage.QK and not enc.needs.raw_keys


def dataclass_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_score_mod_without_bias_is_refused_at_class_creation():
    with pytest.raises(TypeError, match="defines score_mod without bias"):

        class Half(PositionEncoding):
            def score_mod(self, q_pos, k_pos):
                return lambda score, b, h, i, j: score


# ------------------------------------------------------------------ needs
@pytest.mark.parametrize(
    "name,options,field,value",
    [
        ("rope", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "raw_keys", True),
        ("rope", {}, "raw_keys", False),
        ("xpos", {}, "raw_keys", True),
        ("pope", {}, "raw_keys", True),
        ("conv", {"kernel_size": 5}, "input_context", 4),
        ("xl", {"memory_len": 6}, "memory_len", 6),
        ("complex-order", {"vocab_size": 11}, "input_at", "tokens"),
        ("complex-order", {}, "input_at", 0),
        ("deberta-emd", {"absolute_from_layer": 2}, "input_at", 2),
        ("floater", {}, "input_at", "layer"),
        ("inkling", {"sconv_kernel": 3}, "per_head_keys", True),
        ("inkling", {}, "per_head_keys", False),
        ("learned", {"axes": 2, "axial_shape": (4, 4), "axial_dims": (8, 8)}, "axes", 2),
        ("mrope", {}, "axes", 3),
        ("t5", {}, "share_across_layers", True),
        ("deberta", {}, "shared_modules", ("rel_embeddings", "rel_norm", "absolute")),
    ],
)
def test_needs_come_from_the_class_and_its_options(name, options, field, value):
    enc = _build(name, **options)
    assert getattr(enc.needs, field) == value
    old = {"raw_keys": "cache_raw_keys"}.get(field, field)  # the old spelling reads the record
    assert getattr(enc, old) == value


def test_width_and_vocab_are_declared_not_sniffed():
    takes = {n for n in posenc.available() if posenc.get_class(n).needs.width}
    assert takes == {"deberta", "deberta-emd", "fox", "inkling", "inkling-temperature", "path"}
    assert {n for n in posenc.available() if posenc.get_class(n).needs.vocab} == {"complex-order"}
    enc = build_for_layer("fox", {}, heads=2, head_dim=4, dim=24, max_len=None, causal=True)
    assert enc.hidden_size == 24 and (enc.heads, enc.head_dim) == (2, 4)
    enc = build_for_layer("complex-order", {}, heads=2, head_dim=4, dim=8, max_len=None, causal=True, vocab_size=7)
    assert enc.vocab_size == 7 and enc.needs.input_at == "tokens"
    with pytest.raises(TypeError, match="declares needs.width but takes no hidden_size option"):

        class Wide(PositionEncoding):
            needs = Needs(width=True)

            def __init__(self, *, heads, head_dim, max_len=None, causal=True):
                super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("input_at", "top", "input_at must be a block index >= 0, 'layer' or 'tokens'"),
        ("axes", 0, r"axes must be a positive int \(1 for a sequence"),
        ("memory_len", -1, "memory_len must be an int >= 0"),
        ("raw_keys", 1, "raw_keys must be a bool"),
        ("shared_modules", ["a"], "shared_modules must be a tuple"),
    ],
)
def test_needs_refuses_bad_values(field, value, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Needs(**{field: value})


# ------------------------------------------------------------------ no kind from option names
@pytest.mark.parametrize(
    "name,options,variant",
    [
        ("nope", {"attn_scale": 0.1}, "nope-temperature"),
        ("rope", {"rope_extension": {"type": "rerope", "window": 4}}, "rope-extension"),
        ("deberta", {"absolute_from_layer": 1}, "deberta-emd"),
        ("inkling", {"log_scaling_n_floor": 8}, "inkling-temperature"),
    ],
)
def test_a_variants_option_raises_naming_the_variant(name, options, variant):
    """One line, naming the class to build; the same for build, Attention and a layer pattern."""
    for make in (
        lambda: _build(name, **options),
        lambda: posenc.Attention(DIM, HEADS, name, max_len=16, **options),
    ):
        with pytest.raises(ValueError, match=f"unknown option.* for encoding '{name}';.*; '{variant}' takes them") as e:
            make()
        assert "\n" not in str(e.value)
    assert _build(variant, **options).name == variant  # built by its name, the options are its own
    assert set(options) <= set(posenc.registry.options_of(posenc.get_class(variant)))
    assert not set(options) & set(posenc.registry.options_of(posenc.get_class(name)))


def test_old_configs_that_named_a_variant_by_its_option_still_load():
    """A config saved while build() picked the variant from the options names the variant on load."""
    from posenc.checkpoint import upgrade_config

    old = posenc.ModelConfig(32, DIM, 4, HEADS, encoding="irope", max_len=16).to_dict()
    old["layers"][3]["encoding"] = "nope"  # as posenc 0.x's irope preset wrote it
    cfg = upgrade_config(old)
    assert [s.encoding for s in cfg.layers] == ["rope"] * 3 + ["nope-temperature"]
    flat = upgrade_config({"vocab_size": 32, "dim": DIM, "depth": 1, "heads": HEADS, "encoding": "rope",
                           "rope_extension": {"type": "rerope", "window": 4}})  # fmt: skip
    assert flat.encoding == "rope-extension" and flat.options == {"rope_extension": {"type": "rerope", "window": 4}}
    assert upgrade_config({"vocab_size": 32, "dim": DIM, "depth": 1, "heads": HEADS}).encoding == "rope"


# ------------------------------------------------------------------ posenc 0.x spellings
def _old_style():
    """An encoding written against posenc 0.x: declared stages and family, declarations as class
    attributes and set in __init__, set_axes, a hidden_size found by signature, variants."""

    class OldBias(PositionEncoding):
        name = "_test-old-bias"
        family = "bias"
        stages = Stage.BIAS
        share_across_layers = True
        variants = ("_test-none",)

        def __init__(self, *, heads, head_dim, max_len=None, causal=True, slope: float = 0.5, hidden_size=None):
            super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
            self.slope, self.hidden_size = slope, hidden_size
            self.cache_raw_keys = True
            self.input_context = 0
            self.set_axes(1)

        @property
        def relative(self) -> bool:
            return True

        def bias(self, q_pos, k_pos):
            return -self.slope * (q_pos[..., :, None] - k_pos[..., None, :]).abs().float().expand(self.heads, -1, -1)

    return OldBias


class NewBias(PositionEncoding):
    """The same encoding in the new spelling: no warning."""

    name = "_test-new-bias"
    needs = Needs(share_across_layers=True, raw_keys=True, width=True)

    def __init__(self, *, heads, head_dim, max_len=None, causal=True, slope: float = 0.5, hidden_size=None):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        self.slope, self.hidden_size = slope, hidden_size

    @property
    def relative(self) -> bool:
        return True

    def bias(self, q_pos, k_pos):
        return -self.slope * (q_pos[..., :, None] - k_pos[..., None, :]).abs().float().expand(self.heads, -1, -1)


def test_an_encoding_written_for_posenc_0x_works_for_one_release_with_warnings():
    with pytest.warns(DeprecationWarning) as declared:
        OldBias = _old_style()
    said = " ".join(str(w.message) for w in declared)
    assert "OldBias declaring stages, share_across_layers, family, variants as class attributes is deprecated" in said
    assert "declare needs = Needs(share_across_layers=True)" in said and "needs.width" in said
    assert all(w.filename == __file__ for w in declared)  # pointed at the class statement
    with pytest.warns(DeprecationWarning) as built:
        old = OldBias(heads=HEADS, head_dim=HEAD_DIM)
    said = " ".join(str(w.message) for w in built)
    assert "setting self.cache_raw_keys in __init__" in said and "needs.replace(raw_keys=...)" in said
    assert "set_axes(axes) is deprecated" in said
    assert all(w.filename == __file__ for w in built)
    assert OldBias.stages == Stage.BIAS and OldBias.kind == "bias"
    assert old.needs == Needs(share_across_layers=True, raw_keys=True, width=True)
    assert old.share_across_layers and old.cache_raw_keys and OldBias.share_across_layers
    # the twin flags and family: still answered, with a warning naming the new form
    with pytest.warns(DeprecationWarning, match=r'reads_input is deprecated; use enc.defines\("read_input"\)'):
        assert old.reads_input is False
    with pytest.warns(DeprecationWarning, match="has_score_mod is deprecated"):
        assert old.has_score_mod is False
    with pytest.warns(DeprecationWarning, match="rotates_value is deprecated"):
        assert old.rotates_value is False
    with pytest.warns(DeprecationWarning, match="family is deprecated; use kind"):
        assert OldBias.family == "bias"
    # and it runs as the same encoding in the new spelling does (which warns nowhere), with a cache
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new_attn = posenc.Attention(DIM, HEADS, NewBias(heads=HEADS, head_dim=HEAD_DIM, hidden_size=DIM))
    with pytest.warns(DeprecationWarning):
        old_attn = posenc.Attention(DIM, HEADS, OldBias(heads=HEADS, head_dim=HEAD_DIM, hidden_size=DIM))
    old_attn.load_state_dict(new_attn.state_dict())
    x, n = torch.randn(2, 7, DIM), attention_n(dim=DIM, head_dim=HEAD_DIM, length=7)
    with torch.no_grad():
        full = new_attn(x)
        assert_close(old_attn(x), full, n=n)
        cache = old_attn.init_cache(2, 7)
        assert_close(torch.cat([old_attn(x[:, :4], cache=cache), old_attn(x[:, 4:], cache=cache)], 1), full, n=n)


def test_setting_stages_in_init_raises():
    """posenc 0.x let an option add a stage (inkling's temperature did): now a variant class."""

    class Optional(PositionEncoding):
        def __init__(self, *, heads, head_dim, max_len=None, causal=True, temperature: bool = False):
            super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
            if temperature:
                self.stages = Stage.QK

    Optional(heads=HEADS, head_dim=HEAD_DIM)
    with pytest.raises(AttributeError, match="an instance cannot set it"):
        Optional(heads=HEADS, head_dim=HEAD_DIM, temperature=True)


@pytest.mark.parametrize("name", posenc.available())
def test_posenc_itself_raises_no_deprecation_warning(name):
    """Every registered encoding, built by name and run in a model with a KV cache, uses only the
    new spellings (the layer's remaining reads of the old names are not yet switched, and exempt)."""
    causal = True
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        lm = posenc.TransformerLM(32, DIM, 1, HEADS, encoding=name, max_len=16, causal=causal)
        t = torch.randint(0, 32, (1, 5))
        with torch.no_grad():
            lm(t)
            cache = lm.init_cache(batch_size=1, max_len=8)
            lm(t[:, :3], cache=cache)
            lm(t[:, 3:], cache=cache)
        posenc.supported_backends(lm.encodings[0])
        posenc.select_backend(lm.encodings[0], "cuda")
