"""compare's attention fields: grouped k/v, q/k norms, score scale and soft-capping reach the models."""

from __future__ import annotations

import json

import pytest

from posenc.cli import main
from posenc.compare.config import CompareConfig, from_dict, preset_config
from posenc.compare.runner import make_source
from posenc.compare.train import build_model

TINY = ["--dim", "16", "--depth", "1", "--heads", "4", "--train-len", "16", "--batch-size", "4", "--warmup", "2",
        "--eval-lens", "16", "--eval-tokens", "128", "--steps", "2", "--no-progress", "--workers", "1"]  # fmt: skip


def test_attention_fields_reach_every_layer(tmp_path):
    out = tmp_path / "run"
    argv = [*TINY, "--encodings", "rope,alibi", "--kv-heads", "2", "--qk-norm", "rms", "--softcap", "20"]
    assert main(["compare", *argv, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    cfg = results["config"]
    assert (cfg["kv_heads"], cfg["qk_norm"], cfg["softcap"]) == (2, "rms", 20)
    assert [r["encoding"] for r in results["runs"]] == ["rope", "alibi"]
    config = from_dict(cfg)
    model = build_model(config, make_source(config), "alibi")
    attn = model.blocks[0].attn
    assert attn.kv_heads == 2 and attn.k_proj.out_features == 2 * 4  # head_dim 4
    assert attn.q_norm is not None and attn.encoding.softcap == 20


def test_defaults_leave_old_configs_and_fingerprints_unchanged():
    d = preset_config("quick").to_dict()
    assert not {"kv_heads", "qk_norm", "qk_norm_position", "score_scale", "softcap"} & set(d)
    assert CompareConfig(kv_heads=None).fingerprint() == CompareConfig().fingerprint()
    assert CompareConfig(kv_heads=2).fingerprint() != CompareConfig().fingerprint()


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--kv-heads", "3", "--kv-heads must be an int in [1, heads=4] that divides heads, got 3"),
        ("--kv-heads", "8", "--kv-heads must be an int in [1, heads=4] that divides heads, got 8"),
        ("--qk-norm", "layer", "--qk-norm must be one of rms, gemma-rms, l2 or unset, got 'layer'"),
        ("--qk-norm-position", "middle", "--qk-norm-position must be one of before, after, got 'middle'"),
        ("--softcap", "0", "--softcap must be a finite number > 0 or unset, got 0.0"),
        ("--score-scale", "nan", "--score-scale must be a finite number > 0 or unset, got nan"),
    ],
)
def test_bad_attention_fields_are_one_line_exit_2(tmp_path, capsys, flag, value, message):
    assert main(["compare", *TINY, flag, value, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x").exists()
