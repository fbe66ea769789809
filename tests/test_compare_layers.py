"""``posenc compare`` with layer presets and named layer patterns (``--encodings "irope=rope*3,nope"``)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from tests.test_compare import TINY, run_cli

import posenc
from posenc.compare.checks import split_encodings
from posenc.compare.config import CompareConfig


def test_split_encodings():
    assert split_encodings("rope,alibi") == ["rope", "alibi"]
    assert split_encodings("irope=rope*3,nope") == ["irope=rope*3,nope"]
    assert split_encodings("rope,irope=rope*3,nope;alibi,gemma3") == ["rope", "irope=rope*3,nope", "alibi", "gemma3"]
    assert split_encodings("loc=rope(base=1e4,window=8)*3,rope;x=nope") == [
        "loc=rope(base=1e4,window=8)*3,rope",
        "x=nope",
    ]
    for empty in ("", ",", "rope,,alibi", "rope,", "x=rope;", "x=rope;;alibi"):  # the one list rule
        with pytest.raises(argparse.ArgumentTypeError, match="none empty"):
            split_encodings(empty)


def test_named_patterns_and_errors():
    cfg = CompareConfig(encodings=["rope", "hyb=rope*3,nope", "gemma3"], depth=6)  # a pattern fits the depth
    assert cfg.named_patterns() == {"hyb": "rope*3,nope"} and cfg.encoding_names() == ["rope", "hyb", "gemma3"]
    with pytest.raises(ValueError, match="expected NAME=PATTERN"):
        CompareConfig(encodings=["=rope"]).named_patterns()
    with pytest.raises(ValueError, match="give its options inside the pattern"):
        CompareConfig(encodings=["hyb=rope*3,nope"], encoding_options={"hyb": {"base": 10}}, depth=4)


def test_compare_runs_presets_and_named_patterns(tmp_path):
    out = tmp_path / "run"
    argv = ["--depth", "4", "--encodings", "rope,hyb=rope(window=8),nope;smollm3", "--steps", "3", "--out", str(out)]
    assert run_cli(*TINY, *argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert [r["encoding"] for r in res["runs"]] == ["rope", "hyb", "smollm3"]
    model, _ = posenc.load_checkpoint(out / "checkpoints" / "hyb.pt")
    assert [b.attn.encoding.name for b in model.blocks] == ["rope", "nope"] * 2 and model.blocks[0].attn.window == 8
    assert all(
        torch.isfinite(torch.tensor(e["loss"])) for r in res["runs"] for e in r["eval"] if e.get("loss") is not None
    )
    assert run_cli(*TINY, "--encodings", "bad=rope*0", "--out", str(tmp_path / "bad")) == 2
    assert run_cli(*TINY, "--encodings", "gemma3", "--out", str(tmp_path / "deep")) == 2  # 6 layers > depth 1


def test_a_pattern_longer_than_the_depth_is_refused_with_the_config():
    with pytest.raises(ValueError, match=r"encodings entry 'hyb': .*3 layers, more than depth=2"):
        CompareConfig(encodings=["hyb=rope*3,nope"], depth=2)
