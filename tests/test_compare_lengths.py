"""Evaluation lengths as multiples of the training length (Press et al. 2022's Table 5:
1x .. 48x; issue 28 item 2), and the evaluation batch that keeps long lengths in memory."""

from __future__ import annotations

import json

import pytest
import torch
from tests.conftest import tolerance
from tests.test_compare import TINY, run_cli

from posenc.cli import make_parser
from posenc.compare.cli import build_config
from posenc.compare.config import resolve_eval_lens
from posenc.compare.evaluate import EvalSettings, batch_for, evaluate
from posenc.data import TextData, embedded_corpus
from posenc.model import TransformerLM


def _cfg(*argv: str):
    return build_config(make_parser().parse_args(["compare", "--encodings", "alibi", *argv]))


def test_multiples_resolve_against_the_training_length():
    assert resolve_eval_lens(["1x", 3, "48x"], 16) == [16, 3, 768]
    assert _cfg("--train-len", "16", "--eval-lens", "1x,2x,48x").eval_lens == [16, 32, 768]
    # the training length the preset settles on: the kaz tasks train at n = 8
    assert _cfg("--task", "kaz-sum", "--eval-lens", "1x,2x").eval_lens == [8, 16]
    # the order of the flags does not matter
    assert _cfg("--eval-lens", "4x", "--train-len", "32").eval_lens == [128]


def test_multiples_follow_a_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_cfg("--train-len", "24").to_dict()}))
    assert _cfg("--config", str(path), "--eval-lens", "1x,3x").eval_lens == [24, 72]


@pytest.mark.parametrize("bad", ["0x", True, "x", "2.5x", -1.0])
def test_bad_multiples_are_refused(bad):
    with pytest.raises(ValueError, match=r"eval_lens items must be ints or multiples of train_len such as '4x'"):
        resolve_eval_lens([bad], 16)


@pytest.mark.parametrize("value, message", [("2y", "expected comma-separated integers or multiples such as 4x"),
                                            ("0x", "--eval-lens items must be ints or multiples")])  # fmt: skip
def test_bad_multiples_on_the_command_line(value, message, capsys):
    try:
        code = run_cli("--eval-lens", value, "--encodings", "alibi")
    except SystemExit as e:  # argparse's own refusal
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_batch_shrinks_with_the_length_and_the_numbers_do_not_move():
    torch.manual_seed(0)
    model = TransformerLM(256, 16, 1, 2, encoding="alibi", max_len=16).eval()
    s = EvalSettings(batch_size=16, tokens=2048)
    assert batch_for(model, 64, s) == 16
    assert batch_for(model, 4096, s) == (1 << 30) // (4 * 2 * 4096 * 4096)  # 8: one layer's scores <= 1 GiB
    assert batch_for(model, 1 << 15, s) == 1  # never below one sequence
    source = TextData(embedded_corpus()[:60_000])
    small = EvalSettings(batch_size=16, tokens=2048, score_bytes=4 * 2 * 128 * 128 * 3)  # 3 sequences a batch
    assert batch_for(model, 128, small) == 3
    a = evaluate(model, source, 128, device=torch.device("cpu"), settings=s)
    b = evaluate(model, source, 128, device=torch.device("cpu"), settings=small)
    assert a.tokens == b.tokens == 2048
    tol = tolerance(n=16 + 128 + 16)
    assert a.loss == pytest.approx(b.loss, rel=tol["rtol"], abs=tol["atol"])


def test_a_run_evaluates_at_multiples(tmp_path):
    argv = [*TINY[: TINY.index("--eval-lens")], "--steps", "2", "--encodings", "alibi", "--eval-lens", "1x,4x",
            "--out", str(tmp_path)]  # fmt: skip
    assert run_cli(*argv) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["config"]["eval_lens"] == [16, 64]
    assert [e["length"] for e in res["runs"][0]["eval"]] == [16, 64]
