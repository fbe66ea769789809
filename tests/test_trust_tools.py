"""Issue 24, items 6, 10, 12 and 14 for ``posenc analyze``, ``posenc bench`` and ``posenc list``:
every bad flag value is one line and exit 2, an output folder is locked and checked before
the work, every file is written atomically, a cached or run-folder checkpoint is used only
when it is the model asked for, Ctrl-C is exit 130."""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import posenc
from posenc.analysis import models, specs
from posenc.cli import main, make_parser
from posenc.compare.config import preset_config

SRC = str(Path(__file__).resolve().parents[1] / "src")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def run(argv: list[str]) -> int:
    """``posenc.cli.main`` in-process: argparse's errors raise SystemExit, the tools return."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def no_work(monkeypatch):
    """Any analysis, benchmark or training that starts fails the test at once (and fast)."""

    def started(*a, **k):
        raise AssertionError("the work started")

    for mod, name in [("posenc.bench.cli", "run_layers"), ("posenc.bench.cli", "run_throughput"),
                      ("posenc.analysis.models", "train_tiny"), ("posenc.analysis.decompose", "run_decompose"),
                      ("posenc.analysis.invariance", "run_invariance"), ("posenc.analysis.similarity", "run_similarity"),
                      ("posenc.analysis.decay", "run_decay"), ("posenc.analysis.padding", "run_padding"),
                      ("posenc.analysis.attention_maps", "run_attention_maps"),
                      ("posenc.compare.runner", "train_encoding"), ("posenc.compare.runner", "run_jobs")]:  # fmt: skip
        monkeypatch.setattr(f"{mod}.{name}", started)


# ============================================================================ every flag, bad values
HUGE = "1" + "0" * 30
POS = ["", "0", "-1", "nan", "inf", "-inf", "1e999", HUGE, "abc", "1.5", "0x10"]  # integers >= 1
NONNEG = ["", "-1", "nan", "inf", HUGE, "abc", "1.5"]  # integers >= 0
ANYINT = ["", "nan", "inf", HUGE, "abc", "1.5"]
INTS = ["", ",", "0", "-1", "nan", "inf", HUGE, "abc", "1,,x", "8,0", "512,,1024", "8,"]  # integers >= 1
CHOICE = ["", "x"]
NAMES = ["", ",", "nosuch", "rope,,alibi", "rope,"]  # the list rule: no empty item, in any comma list
PATH = [""]
ANALYZE = {"--out": PATH, "--seed": NONNEG, "--threads": POS}
MODELS = {"--encodings": ["", ",", "nosuch", 'rope@{"base": -1}', "rope@{", "rope@[1]", "rope,,alibi"],
          "--checkpoint": ["", "<missing>"],
          "--train-steps": NONNEG, "--train-dir": ["", "<file>"], "--max-len": POS}  # fmt: skip
FLAGS: dict[str, dict[str, list[str]]] = {
    "analyze decompose": {**ANALYZE, **MODELS, "--length": [*POS, "1", "4097"], "--layer": [*ANYINT, "5", "-3"]},
    "analyze invariance": {**ANALYZE, **MODELS, "--length": [*POS, "1"], "--shifts": POS},
    "analyze similarity": {**ANALYZE, **MODELS, "--length": POS},
    "analyze decay": {**ANALYZE, **MODELS, "--length": POS, "--max-distance": POS, "--head-dim": [*POS, "3"]},
    "analyze padding-probe": {
        **ANALYZE,
        "--length": [*POS, "1", "3"],
        "--depth": POS,
        "--channels": POS,
        "--kernel": [*POS, "4"],
        "--task": CHOICE,
        "--train-steps": NONNEG,
        "--probe-steps": POS,
    },  # fmt: skip
    "analyze attention-maps": {
        **ANALYZE,
        **MODELS,
        "--factor": POS,
        "--layer": ANYINT,
        "--data": CHOICE,
        "--train-len": [*POS, "1"],
    },  # fmt: skip
    "analyze all": {**ANALYZE, **MODELS, "--train-len": POS},
    "bench": {
        "--encodings": NAMES,
        "--lengths": INTS,
        "--kv-heads": [*POS, "3"],  # must divide the bench model's heads
        "--kv-tokens": POS,
        "--memory-lengths": INTS,
        "--memory-method": CHOICE,
        "--batch": POS,
        "--heads": POS,
        "--head-dim": [*POS, "3"],  # rotary encodings and the references rotate pairs of dims
        "--windows": INTS,
        "--masks": [*NAMES, "causal,,bidir"],
        "--device": ["", "tpu", "cuda:x", "cpu:0", "cuda:99"],
        "--dtype": CHOICE,
        "--threads": POS,
        "--allocator": CHOICE,
        "--modes": [*NAMES, "fwd,,fwd+bwd"],
        "--warmup": NONNEG,
        "--repeats": POS,
        "--backends": [*NAMES, "auto,,eager"],
        "--chunk-size": POS,
        "--max-seconds": ["", "0", "-1", "nan", "inf", "-inf", "1e999", "abc"],
        "--train-len": POS,
        "--train-batch": POS,
        "--train-dim": [*POS, "3", "200", "16", "100"],  # H = train_dim // 64 heads of 64 dims
        "--train-depth": POS,
        "--out": [*PATH, "<file>"],
        "--markdown": [*PATH, "<dir>"],
        "--hf-model": [*PATH, "<dir>"],  # (a folder without config.json)
        "--hf-methods": [*NAMES, "rope,,yarn"],
        "--hf-lengths": INTS,
        "--hf-steps": POS,
        "--hf-rounds": POS,
        "--extension-lengths": INTS,
        "--extension-chunk": POS,
        "--extension-rounds": POS,
        "--extension-model": [*PATH, "<dir>"],  # (a folder without config.json)
    },  # fmt: skip
    "compare": {
        "--out": PATH,
        "--config": ["", "<missing>", "<file>", "<dir>"],
        "--merge": ["", "<missing>", "<file>"],
        "--encodings": [
            "",
            ",",
            "nosuch",
            "a/b=rope",
            "../x=rope",
            "/tmp/x=rope",
            "x=rope;x=alibi",
            "rope=alibi",
            "rope,rope",
            "rope,,alibi",
            "rope;",
            "x=rope;;alibi",
            "rope*99999999999",
            "x=rope*99999999999",
            "x=" + "(" * 3000 + "rope" + ")" * 3000,
        ],
        "--preset": CHOICE,
        "--text": ["", "<missing>", "<dir>"],
        "--dataset": [""],
        "--dataset-config": ["", "x"],  # without --dataset: it would do nothing
        "--dataset-split": ["", "x"],
        "--dataset-field": ["", "x"],
        "--task": ["", "nosuch"],
        "--val-fraction": ["", "0", "1", "-0.1", "nan", "inf", "abc"],
        "--dim": [*POS, "3"],
        "--depth": POS,
        "--heads": [*POS, "3"],
        "--mlp-ratio": ["", "0", "-1", "nan", "inf", "abc"],
        "--dropout": ["", "-0.1", "1", "nan", "inf", "abc"],
        "--attn-dropout": ["", "-0.1", "1", "nan", "inf", "abc"],
        "--activation-dropout": ["", "-0.1", "1", "nan", "inf", "abc"],
        "--embed-std": ["", "0", "-1", "nan", "inf", "abc"],
        "--encoding-options": [
            "",
            "rope",
            "rope.base",
            "rope.base=nan",
            "rope.base=1e400",
            "rope.base=-1",
            "rope.base=true",
            "nosuch.x=1",
            "rope.nosuch=1",
            "rope.base=500,,t5.max_distance=8",
        ],
        "--train-len": [*POS, "99999999"],
        "--steps": [*POS, "100000000000000000000"],
        "--batch-size": POS,
        "--lr": ["", "0", "-1", "nan", "inf", "-inf", "1e999", "abc"],
        "--warmup": NONNEG,
        "--min-lr-ratio": ["", "-0.1", "1.5", "nan", "abc"],
        "--schedule": CHOICE,
        "--decay-fraction": ["", "0", "-0.1", "1.5", "nan", "abc"],
        "--weight-decay": ["", "-1", "nan", "inf", "abc"],
        "--grad-clip": ["", "-1", "nan", "-inf", "abc"],
        "--seeds": ["", ",", "-1", "0,,1", "0,0", "abc", "1.5", "nan"],
        "--device": ["", "tpu", "cuda:x"],
        "--dtype": ["", "float16", "x"],
        "--max-pos": ["", "0", "-1", "nan", "abc", "1000000000000"],
        "--eval-lens": [*INTS, "16,99999999"],
        "--eval-tokens": POS,
        "--eval-samples": POS,
        "--eval-batch-size": POS,
        "--stride": POS,
        "--position-buckets": POS,
        "--val-points": NONNEG,
        "--extend": ["", ",", "nosuch", "none,,yarn"],
        "--checkpoint-every": POS,
        "--workers": NONNEG,
        "--shard": ["", "0/2", "3/2", "a/b", "1/0", "1"],
        "--kv-heads": [*POS, "3", "16"],  # must divide --heads (8)
        "--qk-norm": CHOICE,
        "--qk-norm-position": CHOICE,
        "--score-scale": ["", "0", "-1", "nan", "inf", "abc"],
        "--softcap": ["", "0", "-1", "nan", "inf", "abc"],
        "--data-dir": ["", "<missing>", "<file>"],
        "--tokens-per-update": POS,
        "--micro-batch": POS,
        "--adaptive-cutoffs": INTS,
    },  # fmt: skip
    "list": {"--format": CHOICE},
    "study answer-errors": {"--seed": NONNEG, "--samples": POS},
}
FREE_TEXT = {("bench", "--notes")}  # any text is fine
# the smallest run of each command: only the flag under test is wrong
BASE = {"analyze all": ["--checkpoint", "<missing>"], "analyze padding-probe": [], "bench": ["--lengths", "8"],
        "list": [], "study answer-errors": ["<missing>", "nope", "5"]}  # fmt: skip
CASES = [(cmd, flag, v) for cmd, flags in FLAGS.items() for flag, values in flags.items() for v in values]


@pytest.mark.parametrize("cmd,flag,value", CASES, ids=[f"{c}-{f}={v!r}"[:60] for c, f, v in CASES])
def test_every_flag_refuses_bad_values_in_one_line(cmd, flag, value, tmp_path, capsys, no_work):
    """Exit 2, one line on stderr naming the flag, no traceback, nothing written."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    subs = {"<file>": str(tmp_path / "file"), "<dir>": str(tmp_path / "dir"), "<missing>": str(tmp_path / "nope")}
    out = tmp_path / "out"
    base = BASE.get(cmd, ["--encodings", "rope"])
    if (cmd == "analyze all" and flag == "--checkpoint") or (cmd, flag) in {
        ("compare", "--merge"),
        ("compare", "--encodings"),
    }:
        base = []
    if cmd == "compare" and flag == "--max-pos":
        base = [*base, "--randomized-positions"]
    where = [] if cmd == "list" or cmd.startswith("study") or flag == "--out" else ["--out", str(out)]
    argv = [*cmd.split(), *where, *[subs.get(a, a) for a in base], f"{flag}={subs.get(value, value)}"]
    if cmd == "bench":
        argv += ["--device", "cpu", "--quiet"] if flag != "--device" else ["--quiet"]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert run(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert flag in line and line.startswith(f"posenc {cmd.split()[0]}"), line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == before


def _value_flags(parser) -> set[str]:
    return {a.option_strings[-1] for a in parser._actions if a.option_strings and a.nargs != 0}


def test_the_flag_table_covers_every_flag():
    """A new flag of any command gets bad values above (or is listed as free text)."""
    top = make_parser()._subparsers._group_actions[0].choices
    found = {(cmd, f) for cmd in ("bench", "compare", "list") for f in _value_flags(top[cmd])}
    for group in ("analyze", "study"):
        for name, sub in top[group]._subparsers._group_actions[0].choices.items():
            found |= {(f"{group} {name}", f) for f in _value_flags(sub)}
    table = {(cmd, f) for cmd, flags in FLAGS.items() for f in flags}
    assert found - FREE_TEXT == table


def _is_list_flag(action) -> bool:
    """A comma-separated flag: its type is a list declaration's parser, or a list parser of its own."""
    from posenc.cli_types import spec_list
    from posenc.compare.checks import eval_lens_flag, parse_encoding_options, split_encodings
    from posenc.fields import ListOf

    own = (eval_lens_flag, parse_encoding_options, split_encodings, spec_list)
    return isinstance(getattr(action.type, "__self__", None), ListOf) or action.type in own


def test_every_comma_flag_is_fuzzed_with_an_empty_item():
    """Issue 62 item 4: one list rule in every command; each comma flag's bad values hold one
    with an empty item between two others (``512,,1024``), refused like ``compare --seeds 0,,1``."""
    top = make_parser()._subparsers._group_actions[0].choices
    parsers = {cmd: top[cmd] for cmd in ("bench", "compare", "list")}
    for group in ("analyze", "study"):
        parsers |= {f"{group} {n}": p for n, p in top[group]._subparsers._group_actions[0].choices.items()}
    lists = {(cmd, a.option_strings[-1]) for cmd, p in parsers.items() for a in p._actions if _is_list_flag(a)}
    assert {
        ("bench", "--lengths"),
        ("bench", "--memory-lengths"),
        ("bench", "--windows"),
        ("compare", "--seeds"),
    } <= lists
    missing = {(cmd, f) for cmd, f in lists if not any(",," in v[1:-1] for v in FLAGS[cmd][f])}
    assert missing == set()


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["analyze", "decompose", "--encodings", "rope", "--train-dir", "d"], "--train-dir"),  # needs --train-steps
        (["analyze", "attention-maps", "--train-steps", "0"], "--train-steps"),  # no model at all
        (["analyze", "attention-maps", "--checkpoint", "x.pt", "--max-len", "64"], "--max-len"),  # would be ignored
        (["bench", "--memory-only"], "--memory-lengths"),
        (["bench", "--memory-method", "rss"], "--memory-lengths"),
        (["bench", "--no-throughput", "--train-hf"], "--train-hf"),
        (["bench", "--memory-only", "--memory-lengths", "8", "--profile"], "--profile"),
        (["bench", "--extension-rounds", "3"], "--extension"),  # sets a run that is not asked for
        (["bench", "--extension-hf"], "--extension"),
        (["bench", "--extension", "--extension-model", "."], "--extension-hf"),
        # issue 61: a value that only the other flags make wrong, refused before the work
        (["compare", "--encodings", "rope", "--steps", "20", "--warmup", "1000"], "--warmup"),  # item 1
        (["compare", "--encodings", "rope", "--config", "<quick>", "--steps", "20"], "warmup in"),  # the file's 100
        (["compare", "--encodings", "rope", "--sliding", "--stride", "100", "--eval-lens", "64,128"], "--stride"),
        (["compare", "--encodings", "rope", "--sliding", "--stride", "32", "--train-len", "16"], "--stride"),
        (["compare", "--encodings", "rope", "--stride", "8"], "--stride"),  # without --sliding: nothing
        (["compare", "--encodings", "rope", "--task", "copy", "--sliding"], "--sliding"),  # problems, not windows
        (["compare", "--encodings", "rope", "--steps", "20", "--val-points", "1000"], "--val-points"),  # item 3
        (["compare", "--encodings", "rope", "--fsdp", "--val-points", "0"], "--fsdp"),  # item 4: no torchrun
        (["compare", "--encodings", "rope", "--task", "count", "--eval-lens", "16,300000"], "--eval-lens"),  # item 6
        (["compare", "--encodings", "rope", "--task", "grid", "--eval-lens", "8,2000"], "--eval-lens"),
        (["compare", "--encodings", "rope", "--task", "grid", "--train-len", "1100"], "--train-len"),
        (
            ["compare", "--encodings", "rope", "--task", "count", "--randomized-positions", "--max-pos", "300000"],
            "--max-pos",
        ),
    ],
)
def test_flags_that_do_nothing_together_are_refused(argv, flag, tmp_path, capsys, monkeypatch, no_work):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # not under torchrun
    if "<quick>" in argv:  # a config file of the quick preset (its warmup: 100 steps)
        preset_config("quick").save(tmp_path / "quick.json")
        argv = [str(tmp_path / "quick.json") if a == "<quick>" else a for a in argv]
    argv = [*argv, "--out", str(tmp_path / "out")] + (["--quiet", "--device", "cpu"] if argv[0] == "bench" else [])
    assert run(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert flag in line and not (tmp_path / "out").exists()


def test_train_hf_without_transformers_names_the_package(tmp_path, capsys, monkeypatch, no_work):
    """Item 12: the HF rows vanished, exit 0."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a))
    assert run(["bench", "--train-hf", "--out", str(tmp_path / "o"), "--quiet", "--device", "cpu"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--train-hf" in line and "'transformers'" in line
    from posenc.bench.throughput import ThroughputConfig

    with pytest.raises(ValueError, match="transformers"):
        ThroughputConfig(["rope"], hf=True)


def test_library_configs_refuse_what_the_flags_refuse():
    from posenc.bench.runner import BenchConfig

    with pytest.raises(ValueError, match=r"repeats must be an integer >= 1, got 0"):
        BenchConfig(encodings=["rope"], lengths=[8], repeats=0)
    with pytest.raises(ValueError, match=r"batch must be an integer >= 1, got 0"):
        BenchConfig(encodings=["rope"], lengths=[8], batch=0)
    with pytest.raises(ValueError, match="modes must be a non-empty subset"):
        BenchConfig(encodings=["rope"], lengths=[8], modes=())
    with pytest.raises(ValueError, match="encodings is empty"):
        BenchConfig(encodings=[], lengths=[8])
    from posenc.analysis.padding import probe_padding

    with pytest.raises(ValueError, match=r"channels must be an integer >= 1, got 0"):
        probe_padding("zeros", channels=0)
    with pytest.raises(ValueError, match=r"length must be an integer >= max\(2, kernel // 2\) = 4"):
        probe_padding("circular", length=3)


# ============================================================================ item 6: lock, atomic, checked first
FAST_DECAY = ["analyze", "decay", "--encodings", "rope", "--length", "8", "--max-distance", "16", "--head-dim", "8"]
FAST_BENCH = ["bench", "--encodings", "rope", "--lengths", "8", "--repeats", "1", "--warmup", "0", "--no-throughput",
              "--no-references", "--modes", "fwd", "--heads", "1", "--head-dim", "8", "--device", "cpu", "--quiet"]  # fmt: skip


@pytest.mark.parametrize("argv", [FAST_DECAY, FAST_BENCH], ids=["analyze", "bench"])
def test_a_held_folder_is_refused_naming_the_lock(argv, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)  # as compare's RunDir and OutputFolder take it
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert run([*argv, "--out", str(out)]) == 2
        line = one_line(capsys.readouterr().err)
        assert "in use" in line and str(out / ".lock") in line
        assert sorted(p.name for p in out.iterdir()) == [".lock"]
    finally:
        os.close(fd)
    assert run([*argv, "--out", str(out)]) == 0  # free again: the run goes ahead
    assert (out / ".lock").exists()  # a lock file that was there stays


@pytest.mark.parametrize("argv", [FAST_DECAY, FAST_BENCH], ids=["analyze", "bench"])
def test_a_write_that_fails_leaves_no_partial_file(argv, tmp_path, capsys, monkeypatch):
    """A full disk at the end: exit 2, one line naming the file, no 0-byte or temporary file."""
    out = tmp_path / "out"

    real = os.replace

    def full(src, dst):
        if str(tmp_path) not in str(dst):
            return real(src, dst)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    assert run([*argv, "--out", str(out)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "No space left on device" in line and str(out) in line
    left = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert left == [], left  # no partial file, no temporary, and the lock it took is gone


def test_atomic_write_keeps_the_old_file(tmp_path, monkeypatch):
    from posenc.output import OutputError, write_csv, write_json

    path = tmp_path / "r.json"
    write_json(path, {"a": 1})

    def broken(fd):
        raise OSError(errno.EIO, "I/O")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OutputError, match=r"cannot write '.*r\.json': I/O") as e:
        write_json(path, {"a": 2})
    assert e.value.errno == errno.EIO and isinstance(e.value, ValueError)
    with pytest.raises(OutputError, match="r.csv"):
        write_csv(tmp_path / "r.csv", [{"a": 1}])
    assert json.loads(path.read_text()) == {"a": 1} and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


class _CtrlCAt:
    """A file whose ``at``-th writes (1-based) each send this process a Ctrl-C (SIGINT)."""

    def __init__(self, f, *at):
        self.f, self.at, self.n = f, at, 0

    def write(self, data):
        self.n += 1
        if self.n in self.at:
            os.kill(os.getpid(), signal.SIGINT)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


@pytest.fixture
def python_ctrl_c():
    """Python's own SIGINT handler (a pytest-xdist worker may run with another), restored after."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_ctrl_c_during_a_checkpoint_write_is_raised_once_the_file_is_whole(tmp_path, python_ctrl_c):
    """torch's zip writer turns a KeyboardInterrupt raised inside one of its writes into
    RuntimeError("unexpected pos ..."), which read as a full disk (exit 2, "cannot write
    checkpoint"); the Ctrl-C now waits for the file and is raised as KeyboardInterrupt."""
    from posenc.output import atomic_write

    model = posenc.TransformerLM(16, 16, 1, 2, "rope")
    path = tmp_path / "m.pt"
    with pytest.raises(KeyboardInterrupt), atomic_write(path, "wb") as f:
        posenc.save_checkpoint(_CtrlCAt(f, 3), model, step=7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]  # in place, no temporary
    loaded, extra = posenc.load_checkpoint(path)
    assert extra["step"] == 7 and all(torch.equal(a, b) for a, b in zip(loaded.parameters(), model.parameters()))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):  # no file around it: the same
        posenc.save_checkpoint(_CtrlCAt(buf := io.BytesIO(), 3), model)
    assert posenc.load_checkpoint(io.BytesIO(buf.getvalue()))[1] == {}


def test_a_second_ctrl_c_interrupts_the_write_at_once(tmp_path, python_ctrl_c):
    from posenc.output import atomic_write

    model = posenc.TransformerLM(16, 16, 1, 2, "rope")
    path = tmp_path / "m.pt"
    posenc.save_checkpoint(path, model, step=1)
    with pytest.raises(KeyboardInterrupt), atomic_write(path, "wb") as f:  # not RuntimeError
        posenc.save_checkpoint(_CtrlCAt(f, 3, 4), model, step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"] and posenc.load_checkpoint(path)[1] == {"step": 1}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_before_the_rename_still_writes_the_file(tmp_path, monkeypatch, python_ctrl_c):
    from posenc.output import write_json

    path = tmp_path / "r.json"
    write_json(path, {"a": 1})
    real = os.fsync

    def interrupted(fd):
        os.kill(os.getpid(), signal.SIGINT)
        return real(fd)

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2} and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_a_link_planted_in_out_is_replaced_not_written_through(tmp_path):
    """``<out>/decay.json`` a symbolic link to a file elsewhere: the link is replaced, the file
    it pointed to keeps its content (the old writer opened the link and wrote through it)."""
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("mine")
    (out / "decay.json").symlink_to(victim)
    assert run([*FAST_DECAY, "--out", str(out)]) == 0
    assert victim.read_text() == "mine" and not (out / "decay.json").is_symlink()
    assert json.loads((out / "decay.json").read_text())["analysis"] == "decay"


def test_the_folder_is_checked_before_the_work(tmp_path, capsys, monkeypatch, no_work):
    """A folder that takes no data (full disk) is refused before any model is built."""
    real = os.write

    def full(fd, data):
        if len(data) >= 4096:  # the probe: the lock file's pid line still fits
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", full)
    for argv in (FAST_DECAY, FAST_BENCH):
        assert run([*argv, "--out", str(tmp_path / "out")]) == 2  # no_work: nothing ran
        assert "No space left on device" in one_line(capsys.readouterr().err)
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,where", [(FAST_DECAY, "posenc.analysis.decay.run_decay"),
                                        (FAST_BENCH, "posenc.bench.cli.run_layers")], ids=["analyze", "bench"])  # fmt: skip
def test_ctrl_c_is_one_line_and_exit_130(argv, where, tmp_path, capsys, monkeypatch):
    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(where, interrupt)
    assert run([*argv, "--out", str(tmp_path / "out")]) == 130
    assert "interrupted" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()  # the lock released, the empty folder it made removed


def test_list_into_a_full_disk_is_one_line(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    env = {**os.environ, "PYTHONPATH": SRC}
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "posenc.cli", "list"], stdout=full, stderr=subprocess.PIPE,
                           text=True, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 2
    assert one_line(r.stderr) == "posenc list: error: cannot write to standard output: No space left on device"


# ============================================================================ item 10: --train-dir
TRAIN = ["analyze", "decompose", "--encodings", "rope", "--length", "8"]


def test_train_dir_reuses_only_a_model_trained_as_asked(tmp_path, capsys):
    """A 2-step model was reused for 300 steps, and recorded as 300."""
    d, out = tmp_path / "d", str(tmp_path / "out")
    assert run([*TRAIN, "--train-steps", "2", "--train-dir", str(d), "--out", out]) == 0
    ckpt = d / "checkpoints" / "rope.pt"
    stamp = ckpt.stat().st_mtime_ns
    assert run([*TRAIN, "--train-steps", "2", "--train-dir", str(d), "--out", out]) == 0
    assert ckpt.stat().st_mtime_ns == stamp  # the same config: reused, not retrained
    capsys.readouterr()
    assert run([*TRAIN, "--train-steps", "3", "--train-dir", str(d), "--out", out]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--train-dir" in line and "steps=2 (asked: 3)" in line and str(ckpt) in line
    assert ckpt.stat().st_mtime_ns == stamp  # refused, not overwritten


def test_train_dir_refuses_a_checkpoint_without_its_training_config(tmp_path):
    spec = specs.Spec("rope")
    (tmp_path / "checkpoints").mkdir()
    posenc.save_checkpoint(tmp_path / "checkpoints" / "rope.pt", posenc.TransformerLM(16, 8, 1, 2, "rope"), steps=300)
    with pytest.raises(ValueError, match="records no training config"):
        models.tiny_checkpoints([spec], tmp_path, [], steps=300, length=32)
    want = models.tiny_config(spec, steps=300, length=32)
    assert want["steps"] == 300 and want["dim"] == 64 and want["encoding"] == "rope" and want["lr"] == 3e-3


# ============================================================================ item 5 for analysis: run folders
def _run_folder(tmp_path: Path, *, results_fp: str | None, ckpt_fp: str | None) -> Path:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    model = posenc.TransformerLM(16, 8, 1, 2, "rope", max_len=16)
    extra = {"train_len": 16} | ({"fingerprint": ckpt_fp} if ckpt_fp else {})
    posenc.save_checkpoint(run_dir / "checkpoints" / "rope.pt", model, **extra)
    if results_fp:
        (run_dir / "results.json").write_text(json.dumps({"fingerprint": results_fp, "runs": []}))
    return run_dir


@pytest.mark.parametrize("ckpt_fp", ["0123456789abcdef", None], ids=["another-config", "no-fingerprint"])
@pytest.mark.parametrize("as_file", [False, True], ids=["rundir", "file"])
def test_checkpoint_of_another_config_in_a_run_folder_is_refused(ckpt_fp, as_file, tmp_path, capsys):
    run_dir = _run_folder(tmp_path, results_fp="fedcba9876543210", ckpt_fp=ckpt_fp)
    target = run_dir / "checkpoints" / "rope.pt" if as_file else run_dir
    argv = ["analyze", "decompose", "--encodings", "rope", "--length", "8", "--checkpoint", str(target)]
    assert run([*argv, "--out", str(tmp_path / "out")]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--checkpoint" in line and "fedcba9876543210" in line and "not a model of that run" in line


def test_a_run_folder_without_results_is_checked_against_its_config(tmp_path):
    """A run killed before its first result: ``config.json`` decides (given as the folder,
    its ``checkpoints`` folder or the file)."""
    from posenc.compare.config import CompareConfig

    cfg = CompareConfig()
    run_dir = _run_folder(tmp_path, results_fp=None, ckpt_fp="0123456789abcdef")
    cfg.save(run_dir / "config.json")
    for target in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "rope.pt"):
        with pytest.raises(ValueError, match=f"is a run of config {cfg.fingerprint()}"):
            models.load_subjects([str(target)], [])
    model, _ = posenc.load_checkpoint(run_dir / "checkpoints" / "rope.pt")
    posenc.save_checkpoint(run_dir / "checkpoints" / "rope.pt", model, train_len=16, fingerprint=cfg.fingerprint())
    assert len(models.load_subjects([str(run_dir / "checkpoints")], [])) == 1


def test_checkpoint_of_the_run_folders_config_is_used(tmp_path):
    run_dir = _run_folder(tmp_path, results_fp="fedcba9876543210", ckpt_fp="fedcba9876543210")
    (sub,) = models.load_subjects([str(run_dir)], [])
    assert sub.name == "rope" and sub.train_len == 16
    plain = _run_folder(tmp_path / "plain", results_fp=None, ckpt_fp=None)  # not a compare run folder
    assert len(models.load_subjects([str(plain)], [])) == 1
