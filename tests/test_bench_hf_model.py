"""``posenc bench --hf-model``: a local HF checkpoint through posenc.hf against stock HF, same process."""

from __future__ import annotations

import json

import pytest

from posenc.cli import main

pytest.importorskip("transformers")


@pytest.fixture
def checkpoint(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    path = tmp_path / "tiny"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_bench_hf_model_rows(tmp_path, checkpoint, one_thread):
    """Each method × length × phase has stock and posenc times and their ratio; the report shows them."""
    out, md = tmp_path / "out", tmp_path / "R.md"
    argv = ["bench", "--encodings", "rope", "--lengths", "16", "--warmup", "0", "--repeats", "1", "--no-throughput"]
    argv += ["--no-references", "--no-memory", "--hf-model", str(checkpoint), "--hf-methods", "rope,yarn,ntk"]
    argv += ["--hf-lengths", "24,40", "--hf-steps", "3", "--hf-rounds", "3", "--device", "cpu"]
    argv += ["--out", str(out), "--markdown", str(md), "--quiet"]
    assert main(argv) == 0
    rows = json.loads((out / "hf_model.json").read_text())["rows"]
    got = [(r["method"], r["tokens"], r["phase"]) for r in rows]
    assert got == [(m, n, p) for m in ("rope", "yarn", "ntk") for n in (24, 40) for p in ("prefill", "decode")]
    for r in rows:
        assert r["status"] == "ok" and r["stock_ms"] > 0 and r["posenc_ms"] > 0 and r["ratio"] > 0
        s, p = r["stock_rounds_ms"], r["posenc_rounds_ms"]  # each round's times: the medians' and the ratio's data
        assert len(s) == len(p) == 3 and sorted(s)[1] == r["stock_ms"] and sorted(p)[1] == r["posenc_ms"]
        assert abs(sorted(b / a for a, b in zip(s, p))[1] - r["ratio"]) < 2e-3
    assert "stock_rounds_ms" in (out / "hf_model.csv").read_text().splitlines()[0]
    assert "A real checkpoint: posenc.hf.convert against stock HF" in md.read_text()


def test_stock_rope_parameters_of_each_method():
    """The stock configs the rows compare against: HF's own rope types, NTK as a new θ (bloc97 2023)."""
    from transformers import LlamaConfig

    from posenc.bench.hf_model import rope_parameters

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=128)
    theta = cfg.rope_parameters["rope_theta"]
    assert rope_parameters(cfg, "rope", 2.0) is None
    assert rope_parameters(cfg, "yarn", 4.0) == {
        "rope_type": "yarn", "rope_theta": theta, "factor": 4.0, "original_max_position_embeddings": 128,
    }  # fmt: skip
    assert rope_parameters(cfg, "ntk", 2.0) == {"rope_type": "default", "rope_theta": theta * 2.0 ** (16 / 14)}


def test_bench_hf_model_flags(tmp_path, capsys, checkpoint):
    base = ["bench", "--out", str(tmp_path / "o"), "--quiet"]
    assert main([*base, "--hf-lengths", "64"]) == 2
    assert "set the --hf-model run; add --hf-model DIR" in capsys.readouterr().err
    assert main([*base, "--hf-model", str(tmp_path)]) == 2
    assert "no config.json there" in capsys.readouterr().err
    assert main([*base, "--hf-model", str(checkpoint), "--hf-methods", "rope,nosuch"]) == 2
    assert "--hf-methods" in (err := capsys.readouterr().err) and "nosuch" in err


def test_the_model_that_runs_first_alternates(checkpoint, monkeypatch):
    """The second model of a round runs slower: each round swaps the order (stock first in even rounds)."""
    from posenc.bench import hf_model

    order = []

    def fake_time(model, tokens, steps, clock):
        order.append("posenc" if model.config._attn_implementation == "posenc" else "stock")
        return 1.0, 1.0

    monkeypatch.setattr(hf_model, "_time", fake_time)
    cfg = hf_model.HFModelConfig(str(checkpoint), methods=("rope",), lengths=(8,), steps=1, rounds=4)
    rows = hf_model.run_hf_model(cfg)
    assert order == ["stock", "posenc", "posenc", "stock"] * 2
    assert [r["ratio"] for r in rows] == [1.0, 1.0]
