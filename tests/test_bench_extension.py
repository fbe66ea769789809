"""``posenc bench --extension``: ReRoPE, Self-Extend and DCA against plain RoPE through the same path."""

from __future__ import annotations

import json

import pytest

from posenc.cli import main


def test_bench_extension_rows(tmp_path, one_thread):
    """Every length has rope's row and each method × backend's, with a time and the ratio to rope;
    the printed table and the Markdown report show them."""
    pytest.importorskip("transformers")
    out, md = tmp_path / "out", tmp_path / "R.md"
    argv = ["bench", "--encodings", "rope", "--lengths", "16", "--warmup", "0", "--repeats", "1", "--no-throughput"]
    argv += ["--no-references", "--no-memory", "--extension", "--extension-lengths", "48,64", "--extension-hf"]
    argv += ["--extension-chunk", "16", "--extension-rounds", "1", "--device", "cpu", "--out", str(out)]
    argv += ["--markdown", str(md), "--quiet"]
    assert main(argv) == 0
    rows = json.loads((out / "extension.json").read_text())["rows"]
    methods = ("rerope", "self-extend", "dca")
    cases = {"layer": [("rope", "auto")] + [(m, b) for m in methods for b in ("auto", "chunked")],
             "hf": [("rope", "auto")] + [(m, "auto") for m in methods]}  # fmt: skip
    want = [(p, *c, n) for p in ("layer", "hf") for n in (48, 64) for c in cases[p]]
    assert [(r["path"], r["method"], r["backend"], r["tokens"]) for r in rows] == want
    for r in rows:
        assert r["status"] == "ok" and r["ms_per_token"] > 0 and r["ratio"] > 0
        assert (r["chunk"], r["heads"], r["kv_heads"], r["dim"]) == (16, 9, 3, 576)
    assert all(r["ratio"] == 1.0 for r in rows if r["method"] == "rope")  # (its own baseline)
    assert (out / "extension.csv").read_text().startswith("chunk,")
    text = md.read_text()
    assert (
        "## Two-map extension methods against plain RoPE" in text and "| layer | `self-extend` | chunked | 64 |" in text
    )


def test_bench_extension_flags(tmp_path, capsys):
    base = ["bench", "--out", str(tmp_path / "o"), "--quiet"]
    assert main([*base, "--extension-lengths", "64"]) == 2
    assert "set the --extension run; add --extension" in capsys.readouterr().err
    assert main([*base, "--extension-hf"]) == 2
    assert "set the --extension run; add --extension" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([*base, "--extension", "--extension-chunk", "0"])
    assert e.value.code == 2
    assert "--extension-chunk: must be an integer in 1..1048576, got '0'" in capsys.readouterr().err


def test_bench_extension_on_a_checkpoint(tmp_path, one_thread):
    """``--extension-model DIR``: the hf path on that checkpoint (its vocabulary), every row measured."""
    pytest.importorskip("transformers")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    out = tmp_path / "out"
    argv = ["bench", "--encodings", "rope", "--lengths", "16", "--warmup", "0", "--repeats", "1", "--no-throughput"]
    argv += ["--no-references", "--no-memory", "--extension", "--extension-lengths", "40", "--extension-hf"]
    argv += ["--extension-model", str(tmp_path / "tiny"), "--extension-chunk", "16", "--extension-rounds", "1"]
    assert main([*argv, "--device", "cpu", "--out", str(out), "--quiet"]) == 0
    rows = [r for r in json.loads((out / "extension.json").read_text())["rows"] if r["path"] == "hf"]
    assert [r["method"] for r in rows] == ["rope", "rerope", "self-extend", "dca"]
    assert all(r["status"] == "ok" and r["ms_per_token"] > 0 and r["model"] == str(tmp_path / "tiny") for r in rows)
