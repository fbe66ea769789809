"""posenc compare --extend: inference-time extension of trained rotary models (issue 14 item 6)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tests.conftest import assert_close, lm_n
from tests.test_compare import TINY, run_cli

import posenc
from posenc.compare import preset_config
from posenc.extend.methods import EXTEND_METHODS, method_classes, method_options, with_options


def test_method_options_follow_the_papers_rules():
    o = {m: method_options(m, train_tokens=64, longest_tokens=512, base=10000.0, rotary_dim=16) for m in EXTEND_METHODS}
    assert o["none"] == {}
    assert o["linear"]["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert math.isclose(o["ntk"]["base"], 10000.0 * 8 ** (16 / 14))
    assert (
        o["yarn"]["rope_scaling"]["factor"] == 8.0
        and o["yarn"]["rope_scaling"]["original_max_position_embeddings"] == 64
    )
    re = o["rerope"]["rope_extension"]
    assert re == {"type": "rerope", "window": 32, "scale_base": 64}
    se = o["self-extend"]["rope_extension"]
    W, G = se["window"], se["group_size"]
    # Jin et al. 2024: (L - W)·G + W >= L_max, with the smallest such G
    assert (64 - W) * G + W >= 512 > (64 - W) * (G - 1) + W
    # ChunkLlama's replace_with_chunkllama: chunk_size = 3/4 of the pretraining length, local window 1/16
    assert o["dca"]["rope_extension"] == {"type": "dca", "chunk_size": 48, "local_size": 4}
    lk = o["leaky-rerope"]["rope_extension"]
    assert lk["window"] + (512 - lk["window"]) / lk["factor"] <= 64  # the longest distance maps inside L
    # not past the training length: no scaling, the smallest groups
    assert (
        method_options("linear", train_tokens=64, longest_tokens=64, base=1e4, rotary_dim=16)["rope_scaling"]["factor"]
        == 1.0
    )
    with pytest.raises(ValueError, match="extension method must be one of"):
        method_options("pi", train_tokens=64, longest_tokens=512, base=1e4, rotary_dim=16)


def test_with_options_keeps_the_weights():
    torch.manual_seed(0)
    lm = posenc.TransformerLM(32, 16, 2, 2, encoding="rope", max_len=8).eval()
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.2 * torch.randn_like(p))
    t = torch.randint(0, 32, (2, 12))
    n = lm_n(dim=16, depth=2, length=12)
    with torch.no_grad():
        ref = lm(t)
        assert_close(with_options(lm)(t), ref, n=n)
        # a window past every distance: exactly RoPE, so the weights came along; the extension is a
        # class of its own (rope-extension), which the method's rename names
        rename = method_classes("self-extend")
        assert rename == {"rope": "rope-extension"} and method_classes("yarn") == {}
        wide = with_options(lm, rename, rope_extension={"type": "self-extend", "window": 12, "group_size": 2})
        assert wide.blocks[0].attn.encoding.name == "rope-extension" and wide.config.encoding == "rope-extension"
        assert wide.blocks[0].attn.encoding.rope_extension is not None
        assert_close(wide(t), ref, n=n)
        narrow = with_options(lm, rename, rope_extension={"type": "rerope", "window": 2})
        assert not torch.allclose(narrow(t), ref, atol=1e-3)
        with pytest.raises(ValueError, match=r"\['rope_extension'\] for encoding 'rope';.*'rope-extension' takes them"):
            with_options(lm, rope_extension={"type": "rerope", "window": 2})  # rope itself takes none


def test_extend_run(tmp_path):
    out = tmp_path / "run"
    methods = ",".join(EXTEND_METHODS)
    assert run_cli(*TINY, "--steps", "3", "--encodings", "rope,xpos,alibi", "--extend", methods, "--out", str(out)) == 0
    res = json.loads((out / "results.json").read_text())
    got = [(e["encoding"], e["method"]) for e in res["extend"]]
    assert got == [("rope", m) for m in EXTEND_METHODS] + [("xpos", "none"), ("xpos", "ntk")]  # alibi: none applies
    runs = {r["encoding"]: r for r in res["runs"]}
    for e in res["extend"]:
        assert [x["length"] for x in e["eval"]] == [16, 32]
        if e["method"] == "none":  # the trained model as it is: the run's own numbers
            assert [x["loss"] for x in e["eval"]] == [x["loss"] for x in runs[e["encoding"]]["eval"]]
    by = {e["method"]: e for e in res["extend"] if e["encoding"] == "rope"}
    assert by["rerope"]["options"]["rope_extension"]["window"] == 8  # half the training length
    assert by["linear"]["eval"][1]["loss"] != by["none"]["eval"][1]["loss"]
    for f in ("extend.md", "extend.csv", "extend.png"):
        assert (out / f).stat().st_size > 0
    assert "`leaky-rerope`" in (out / "extend.md").read_text()


def test_extend_config():
    assert preset_config("quick").fingerprint() == preset_config("quick", extend=["none", "yarn"]).fingerprint()
    for bad in (["pi"], [], "yarn"):
        with pytest.raises(ValueError, match="extend must be a non-empty list of methods from none, linear"):
            preset_config("quick", extend=bad)


def test_extend_bad_method_is_exit_2(tmp_path, capsys):
    assert run_cli(*TINY, "--extend", "none,pi", "--out", str(tmp_path / "x")) == 2
    assert "--extend must be a non-empty list of methods from none, linear" in capsys.readouterr().err


def test_merge_extend_joins_shards_and_refuses_conflicts():
    from posenc.compare.extend import merge_extend
    from posenc.compare.results import RunResults

    def part(*rows):
        return RunResults.from_json({"config": {}, "runs": [], **({"extend": list(rows)} if rows else {})})

    row = {"encoding": "rope", "seed": 0, "method": "yarn", "options": {}, "setting": "s",
           "eval": [{"length": 64, "ppl": 3.0}]}  # fmt: skip
    other = {**row, "method": "rerope"}
    seed1 = {**row, "seed": 1}
    merged = merge_extend([part(row, other), part(seed1, row), part()])
    assert [r.to_json() for r in merged] == [row, other, seed1]
    clash = {**row, "eval": [{"length": 64, "ppl": 4.0}]}
    with pytest.raises(ValueError, match=r"different extend rows for rope seed 0 / yarn"):
        merge_extend([part(row), part(clash)])


def test_method_options_of_extend_only_methods():
    assert method_options("sink-window", train_tokens=64, longest_tokens=256) == {"sinks": 4, "window": 60}
    with pytest.raises(ValueError, match="longrope needs the model's searched short_factor/long_factor"):
        method_options("longrope", train_tokens=64, longest_tokens=256, base=1e4, rotary_dim=8)
    lr = method_options("longrope", train_tokens=64, longest_tokens=256,
                        longrope={"short_factor": [1.0] * 4, "long_factor": [2.0] * 4})  # fmt: skip
    assert lr == {"rope_scaling": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 64,
                                   "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}}  # fmt: skip
    with pytest.raises(ValueError, match="extension method must be one of"):
        method_options("warp", train_tokens=64, longest_tokens=256)


def test_extend_on_passkey_scores_every_depth(tmp_path):
    out = tmp_path / "pk"
    args = (
        *TINY,
        "--steps",
        "12",
        "--lr",
        "3e-3",
        "--task",
        "passkey",
        "--encodings",
        "rope",
        "--extend",
        "none,self-extend",
    )
    assert run_cli(*args, "--out", str(out)) == 0
    res = json.loads((out / "results.json").read_text())
    assert [e["method"] for e in res["extend"]] == ["none", "self-extend"]
    for e in res["extend"]:
        for x in e["eval"]:  # accuracy at every length, and per key depth as the run's own passkey heatmap
            assert 0 <= x["accuracy"] <= 1 and [d["depth"] for d in x["depths"]] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert "accuracy by evaluation length" in (out / "extend.md").read_text()


def test_merge_joins_the_extend_rows_of_shards(tmp_path):
    """--merge of sharded --extend runs: every shard's extend rows, extend.md and extend.png."""
    argv = [*TINY, "--encodings", "rope,xpos", "--steps", "2", "--extend", "none,ntk"]
    assert run_cli(*argv, "--shard", "1/2", "--out", str(tmp_path / "a")) == 0
    assert run_cli(*argv, "--shard", "2/2", "--out", str(tmp_path / "b")) == 0
    out = tmp_path / "merged"
    assert run_cli("--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)) == 0
    merged = json.loads((out / "results.json").read_text())
    rows = {(r["encoding"], r["method"]) for r in merged["extend"]}
    assert rows == {("rope", "none"), ("rope", "ntk"), ("xpos", "none"), ("xpos", "ntk")}
    assert (out / "extend.md").is_file() and (out / "extend.png").is_file()
    assert "xpos" in (out / "extend.md").read_text()


def test_methods_apply_by_the_encodings_class_not_its_option_names():
    """A ``base`` option does not make an encoding rotary (sinusoidal, Transformer-XL, PoPE and the
    multiplicative embedding have one): the methods are defined on RoPE's classes."""
    from posenc.extend.methods import METHODS, applies

    for name in ("sinusoidal", "xl", "pope", "multiplicative", "alibi", "nope"):
        assert [m for m in METHODS if applies(m, name)] == ["sink-window"], name
    assert [m for m in METHODS if applies(m, "rope")] == list(METHODS)
    assert [m for m in METHODS if applies(m, "xpos")] == ["none", "ntk", "sink-window"]
    assert "yarn" in [m for m in METHODS if applies(m, "mrope")] and not applies("rerope", "mrope")
    with pytest.raises(ValueError, match="extension method must be one of"):
        applies("warp", "rope")
