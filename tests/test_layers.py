"""Layer patterns, presets and per-layer specs (``posenc.layers``)."""

from __future__ import annotations

import pytest

import posenc
from posenc.patterns import PRESETS, LayerSpec, expand, layers, parse_pattern


def _d(specs):
    return [s.describe() for s in specs]


def test_pattern_repeats_and_groups():
    assert _d(layers("rope*3,nope")) == ["rope", "rope", "rope", "nope"]
    assert _d(layers("(rope,nope)*2,alibi")) == ["rope", "nope", "rope", "nope", "alibi"]
    assert _d(layers(" rope ( base = 1e4 , window = 16 ) * 2 , nope ")) == ["rope(base=10000.0,window=16)"] * 2 + [
        "nope"
    ]


def test_values_parse_to_python_types():
    spec = layers('rope(base=500000,layout=interleaved,rope_mixed=true,rope_scaling={"rope_type":"linear","factor":2})')
    assert spec[0].options == {
        "base": 500000,
        "layout": "interleaved",
        "rope_mixed": True,
        "rope_scaling": {"rope_type": "linear", "factor": 2},
    }
    assert layers("rope(window=8,chunk=4,sinks=true)")[0] == LayerSpec("rope", {}, window=8, chunk=4, sinks=True)


def test_describe_round_trips():
    for name in PRESETS:
        specs = layers(name)
        assert parse_pattern(",".join(_d(specs))) == specs


def test_presets_follow_hf_layer_rules():
    # Llama 4 / SmolLM3: layer i has no RoPE iff (i + 1) % 4 == 0
    for name in ("irope", "smollm3"):
        specs = layers(name, depth=8)
        assert [s.encoding.startswith("nope") for s in specs] == [(i + 1) % 4 == 0 for i in range(8)]
    irope = layers("irope")
    assert all(s.chunk == 8192 and s.options["layout"] == "interleaved" for s in irope[:3])
    assert irope[3].chunk is None and irope[3].options == {"attn_scale": 0.1, "floor_scale": 8192}
    assert irope[3].encoding == "nope-temperature"  # the temperature is a class of its own
    # Gemma 3: layer i is local iff (i + 1) % 6 != 0 (HF's sliding_window_pattern = 6)
    g = layers("gemma3", depth=12)
    assert [s.window is not None for s in g] == [(i + 1) % 6 != 0 for i in range(12)]
    assert {s.options["base"] for s in g if s.window} == {10000} and {s.options["base"] for s in g if not s.window} == {
        1000000
    }
    # gpt-oss: even layers sliding (128), odd layers full, all with sinks
    o = layers("gpt-oss", depth=4)
    assert [s.window for s in o] == [128, None, 128, None] and all(s.sinks for s in o)


def test_overrides():
    assert [s.chunk for s in layers("irope", chunk=32)] == [32, 32, 32, None]
    assert layers("irope", floor_scale=16)[3].options["floor_scale"] == 16
    assert [s.window for s in layers("gemma3(window=16)")] == [16] * 5 + [None]
    assert all(s.sinks for s in layers("rope*2,nope", sinks=True))
    with pytest.raises(ValueError, match="chunk=4 applies to no layer of 'gemma3'"):
        layers("gemma3", chunk=4)
    with pytest.raises(ValueError, match="num_buckets=8 applies to no layer"):
        layers("irope(num_buckets=8)")


def test_expand_cycles_and_rejects_too_long():
    assert _d(expand(layers("rope,nope"), 5)) == ["rope", "nope", "rope", "nope", "rope"]
    with pytest.raises(ValueError, match="6 layers, more than depth=4"):
        layers("gemma3", depth=4)
    with pytest.raises(ValueError, match="depth must be a positive int"):
        expand(layers("rope"), 0)


def test_list_of_names_and_specs():
    specs = layers(["rope", LayerSpec("alibi", window=4), "nope*2"])
    assert _d(specs) == ["rope", "alibi(window=4)", "nope", "nope"]


@pytest.mark.parametrize(
    "bad,match",
    [
        ("", "expected an encoding or preset name, got the end"),
        ("rope,,nope", "expected an encoding or preset name, got ','"),
        ("rope*0", "repeat count must be a positive int, got '0'"),
        ("rope*", "expected a repeat count"),
        ("(rope", "expected '\\)'"),
        ("rope)", "unexpected '\\)'"),
        ("rope(base=)", "expected a value, got '\\)'"),
        ("rope(base=1,base=2)", "'base' given twice"),
        ("rope(rope_scaling={bad})", "bad JSON value"),
        ("rope(bogus=1)", "unknown option.*bogus.*valid options: base"),
        ("bogus", "unknown encoding 'bogus'"),
        ("rope(window=0)", "window must be a positive int or None, got 0"),
        ("rope(chunk=2.5)", "chunk must be a positive int or None, got 2.5"),
    ],
)
def test_bad_patterns_raise_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        layers(bad)


def test_bad_types_raise_type_error():
    with pytest.raises(TypeError, match="sinks must be a bool"):
        layers("rope(sinks=1)")
    with pytest.raises(TypeError, match="encoding names or LayerSpec"):
        layers(["rope", 3])
    with pytest.raises(TypeError, match="non-empty sequence"):
        layers([])
    with pytest.raises(TypeError, match="encoding must be an encoding name"):
        LayerSpec(posenc.build("rope", heads=1, head_dim=2))


def test_model_takes_patterns_presets_and_specs():
    lm = posenc.TransformerLM(50, 16, 8, 2, "rope*3,nope", max_len=32)
    assert [b.attn.encoding.name for b in lm.blocks] == ["rope", "rope", "rope", "nope"] * 2
    g = posenc.TransformerLM(50, 16, 6, 2, "gemma3", max_len=32, window=4)
    assert [b.attn.window for b in g.blocks] == [4] * 5 + [None]
    assert [b.attn.encoding.base for b in g.blocks] == [10000] * 5 + [1000000]
    cfg = posenc.ModelConfig(50, 16, 4, 2, layers=posenc.layers("irope", depth=4, chunk=8))
    lm = posenc.TransformerLM(config=cfg)
    assert [b.attn.chunk for b in lm.blocks] == [8, 8, 8, None]
    # the config round-trips through JSON-ready dicts
    again = posenc.ModelConfig.from_dict(cfg.to_dict())
    assert again.layers == cfg.layers
    with pytest.raises(ValueError, match="more than depth=4"):
        posenc.TransformerLM(50, 16, 4, 2, "gemma3", max_len=32)
    with pytest.raises(ValueError, match="applies to no layer"):
        posenc.TransformerLM(50, 16, 4, 2, "rope*3,nope", max_len=32, window=3)


def test_encoding_list_and_posenc_list_presets(capsys):
    lm = posenc.TransformerLM(50, 16, 4, 2, ["rope", "rope", "rope(base=100)", "nope"], max_len=32)
    assert [b.attn.encoding.name for b in lm.blocks] == ["rope", "rope", "rope", "nope"]
    assert lm.blocks[2].attn.encoding.base == 100 and lm.config.encoding == "rope,rope,rope(base=100),nope"
    with pytest.raises(ValueError, match="not both"):
        posenc.ModelConfig(50, 16, 2, 2, encoding=["rope", "nope"], layers=posenc.layers("rope,nope"))
    from posenc.cli import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in posenc.PRESETS) and "layer presets" in out


def test_new_presets_follow_the_hf_configs_layer_rules():
    """command-a, mistral-large4 and lfm3 against the layer decisions of HF's own config classes."""
    t = pytest.importorskip("transformers")
    cohere = t.Cohere2Config(num_hidden_layers=8)
    specs = layers("command-a", depth=8)
    rotates = [s.encoding == "rope" for s in specs]
    assert rotates == [lt == "sliding_attention" for lt in cohere.layer_types]  # RoPE only on sliding layers
    assert all(s.window == cohere.sliding_window for s, r in zip(specs, rotates) if r)
    assert all(s.options["layout"] == "interleaved" for s in specs if s.encoding == "rope")
    from transformers.models.mistral_large4.configuration_mistral_large4 import MistralLarge4TextConfig

    large4 = MistralLarge4TextConfig(num_hidden_layers=8)
    specs = layers("mistral-large4", depth=8)
    assert [s.encoding == "lerope" for s in specs] == [bool(r) for r in large4.no_rope_layers]
    yarn = {k: v for k, v in large4.rope_parameters.items() if k not in ("rope_theta", "type")}
    assert specs[0].options["rope_scaling"] == yarn and specs[0].options["base"] == large4.rope_parameters["rope_theta"]
    lfm = t.Lfm3Config(num_hidden_layers=12)
    attention = [lt for lt in lfm.layer_types if lt != "conv"]
    specs = layers("lfm3", depth=len(attention))
    for spec, lt in zip(specs, attention):
        params = lfm.rope_parameters[lt]
        assert spec.options["base"] == params["rope_theta"]
        assert spec.options.get("rope_scaling", {"rope_type": "default"})["rope_type"] == params["rope_type"]
        assert spec.options.get("partial_rotary_factor", 1.0) == params.get("partial_rotary_factor", 1.0)
        assert spec.window == (lfm.sliding_window if lt == "sliding_attention" else None)
