"""``posenc bench --kv-cache``: the measured KV-cache memory of grouped k/v against full heads."""

from __future__ import annotations

import json

import pytest

from posenc.cli import main


def test_bench_kv_cache_measures_grouped_against_full_heads(tmp_path, one_thread):
    out, md = tmp_path / "out", tmp_path / "R.md"
    argv = ["bench", "--encodings", "rope", "--lengths", "16", "--warmup", "0", "--repeats", "1", "--no-throughput"]
    argv += ["--no-references", "--no-memory", "--kv-cache", "--kv-tokens", "24", "--train-dim", "256"]
    argv += ["--train-depth", "2", "--out", str(out), "--markdown", str(md), "--quiet", "--device", "cpu"]
    assert main(argv) == 0
    rows = json.loads((out / "kv_cache.json").read_text())["rows"]
    assert [(r["heads"], r["kv_heads"], r["status"]) for r in rows] == [(4, 4, "ok"), (4, 1, "ok")]
    T, depth, Dh = 24, 2, 64
    for r in rows:  # what the cache holds: k and v per layer (float32), positions (int64)
        assert r["cache_bytes"] == depth * (2 * r["kv_heads"] * T * Dh * 4 + T * 8)
        assert r["peak_bytes"] >= r["cache_bytes"]  # the decode allocated the cache, and more
    full, grouped = rows
    assert full["cache_bytes_ratio"] == 1.0 and 3.9 < grouped["cache_bytes_ratio"] < 4.0
    assert grouped["peak_bytes_ratio"] > 2.0
    assert "KV cache of grouped k/v against full heads" in md.read_text()


def test_bench_kv_cache_flags(tmp_path, capsys):
    base = ["bench", "--encodings", "rope", "--out", str(tmp_path), "--quiet", "--device", "cpu"]
    assert main([*base, "--kv-cache", "--kv-heads", "3"]) == 2
    assert "--kv-heads 3 must divide the 4 heads of the model (train_dim // 64)" in capsys.readouterr().err
    assert main([*base, "--kv-tokens", "8"]) == 2
    assert "--kv-heads/--kv-tokens set the --kv-cache run; add --kv-cache" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's own exit for a value out of range
        main([*base, "--kv-cache", "--kv-tokens", "0"])
    assert e.value.code == 2
    assert "argument --kv-tokens: must be an integer in 1..1048576, got '0'" in capsys.readouterr().err
