"""compare's learning-rate schedules: cosine (the default) and warmup-stable-decay.

The warmup-stable-decay rates are checked against the schedule as its papers write it, not
against posenc's code: Hu et al. 2024 (MiniCPM, section 4.1), a constant rate after the warmup
and a decay over the last steps; Hägele et al. 2024 ("Scaling Laws and Compute-Optimal Training
Beyond Fixed Training Durations", section 3), the cooldown ``1 - (n - N_start) / N_cd`` (linear)
or ``1 - sqrt((n - N_start) / N_cd)`` over its ``N_cd`` steps.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from posenc.cli import main
from posenc.compare.config import CompareConfig, from_dict, preset_config
from posenc.compare.train import lr_schedule
from posenc.train import cosine_schedule, wsd_schedule

TINY = ["--dim", "16", "--depth", "1", "--heads", "4", "--train-len", "16", "--batch-size", "4", "--warmup", "2",
        "--eval-lens", "16", "--eval-tokens", "128", "--steps", "10", "--lr", "0.01", "--no-progress",
        "--workers", "1", "--encodings", "nope", "--val-points", "0"]  # fmt: skip


def _paper_wsd(lr, steps, warmup, fraction, floor, sqrt):
    """The rates of steps 0 .. steps - 1, written out from the papers' definition."""
    n_cd = round(fraction * steps)  # the cooldown's steps N_cd: the last fraction of the run
    rates = []
    for n in range(steps):
        if n < warmup:
            rates.append(lr * (n + 1) / warmup)
        elif n < steps - n_cd:
            rates.append(lr)
        else:
            x = (n - (steps - n_cd)) / n_cd
            rates.append(lr * (floor + (1 - floor) * (1 - (math.sqrt(x) if sqrt else x))))
    return rates


@pytest.mark.parametrize("shape", ["linear", "sqrt"])
@pytest.mark.parametrize(
    ("steps", "warmup", "fraction", "floor"), [(100, 10, 0.2, 0.0), (50, 0, 0.5, 0.1), (7, 2, 1 / 7, 0.0)]
)
def test_wsd_matches_the_papers_schedule(shape, steps, warmup, fraction, floor):
    lr_at = wsd_schedule(3e-3, steps, warmup, fraction, floor, shape=shape)
    want = _paper_wsd(3e-3, steps, warmup, fraction, floor, shape == "sqrt")
    assert [lr_at(n) for n in range(steps)] == pytest.approx(want, rel=1e-12, abs=0)


def test_wsd_cooldown_starts_after_the_warmup_and_ends_at_the_floor():
    lr_at = wsd_schedule(1.0, 10, warmup=8, decay_fraction=0.5)  # the cooldown would start at 5
    assert [lr_at(n) for n in range(8)] == pytest.approx([(n + 1) / 8 for n in range(8)])
    assert lr_at(8) == 1.0 and lr_at(9) == pytest.approx(0.5)
    assert wsd_schedule(1.0, 10, decay_fraction=1.0, min_lr_ratio=0.1)(10) == pytest.approx(0.1)
    for bad in ({"decay_fraction": 0.0}, {"decay_fraction": 1.5}, {"shape": "cosine"}):
        with pytest.raises(ValueError, match="decay_fraction must be in|shape must be"):
            wsd_schedule(1.0, 10, **bad)


def test_the_config_picks_the_schedule():
    base = {"steps": 100, "warmup": 10, "lr": 1.0, "min_lr_ratio": 0.05}
    cos = cosine_schedule(1.0, 100, 10, 0.05)
    assert [lr_schedule(CompareConfig(**base))(n) for n in range(100)] == [cos(n) for n in range(100)]
    for name, sqrt in (("wsd", False), ("wsd-sqrt", True)):
        lr_at = lr_schedule(CompareConfig(**base, schedule=name, decay_fraction=0.3))
        assert [lr_at(n) for n in range(100)] == pytest.approx(_paper_wsd(1.0, 100, 10, 0.3, 0.05, sqrt))


def test_defaults_leave_old_configs_and_fingerprints_unchanged():
    d = preset_config("quick").to_dict()
    assert not {"schedule", "decay_fraction"} & set(d)
    assert from_dict(d).fingerprint() == preset_config("quick").fingerprint()
    wsd = preset_config("quick", schedule="wsd")
    assert wsd.to_dict()["schedule"] == "wsd" and wsd.fingerprint() != preset_config("quick").fingerprint()
    assert preset_config("quick", schedule="wsd", decay_fraction=0.3).fingerprint() != wsd.fingerprint()


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "wsd-sqrt"])
def test_the_run_trains_with_the_schedule_it_names(tmp_path, schedule):
    out = tmp_path / "run"
    extra = [] if schedule == "cosine" else ["--decay-fraction", "0.5"]
    assert main(["compare", *TINY, "--task", "copy", "--schedule", schedule, *extra, "--out", str(out)]) == 0
    cfg = json.loads((out / "results.json").read_text())["config"]
    assert cfg.get("schedule", "cosine") == schedule
    (ckpt,) = (out / "checkpoints").glob("*.pt")
    last = torch.load(ckpt, weights_only=True, map_location="cpu")["optimizer"]["param_groups"][0]["lr"]
    # the rate of the last step (9 of 0..9): warmup 2, cooldown over steps 5..9
    want = {
        "cosine": 0.01 * 0.5 * (1 + math.cos(math.pi * 7 / 8)),
        "wsd": 0.01 * (1 - 4 / 5),
        "wsd-sqrt": 0.01 * (1 - math.sqrt(4 / 5)),
    }[schedule]
    assert last == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schedule", "linear"], "--schedule must be one of cosine, wsd, wsd-sqrt, got 'linear'"),
        (["--schedule", "wsd", "--decay-fraction", "0"], "--decay-fraction must be a finite number in (0, 1], got 0.0"),
        (
            ["--schedule", "wsd", "--decay-fraction", "1.5"],
            "--decay-fraction must be a finite number in (0, 1], got 1.5",
        ),
        (["--decay-fraction", "0.3"], "--decay-fraction applies to schedule wsd or wsd-sqrt only"),
    ],
)
def test_bad_schedule_fields_are_one_line_exit_2(tmp_path, capsys, argv, message):
    assert main(["compare", *TINY, *argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x").exists()
