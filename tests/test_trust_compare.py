"""posenc compare writes only inside --out, deletes only what it wrote, and refuses what it
cannot do (issue 24 items 2, 3, 4, 5, 9 and compare's part of 12 and 14)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from posenc.cli import main
from posenc.compare import CompareConfig, from_dict
from posenc.compare.train import checkpoint_path
from posenc.output.manifest import MANIFEST
from posenc.output.rundir import RunDir

SRC = str(Path(__file__).resolve().parents[1] / "src")
FAST = ["--steps", "2", "--dim", "16", "--depth", "1", "--heads", "2", "--train-len", "16", "--eval-lens", "16",
        "--eval-tokens", "64", "--batch-size", "2", "--val-points", "0", "--workers", "1", "--no-progress"]  # fmt: skip


def run_cli(*argv: str) -> int:
    """The exit status of ``posenc compare ARGV`` (argparse's refusals exit with SystemExit)."""
    try:
        return main(["compare", *argv])
    except SystemExit as e:
        return e.code


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


# ------------------------------------------------------------------ item 2: names become paths
@pytest.mark.parametrize("name", ["../../evil", "/tmp/x/victim", "a/b", "..", ".hidden", "a b", "x" * 65, "a\\b"])
def test_model_names_must_be_safe_file_names(name, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"must be letters, digits and \. _ \+ -"):
        CompareConfig(encodings=[f"{name}=rope"])
    with pytest.raises(ValueError, match="must be letters, digits"):
        from_dict({"encodings": [f"{name}=rope"]})
    work = tmp_path / "a" / "b"
    assert run_cli(*FAST, "--encodings", f"{name}=rope", "--out", str(work / "run")) == 2
    assert "the name" in one_line(capsys)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({**CompareConfig(encodings=["rope"]).to_dict(), "encodings": [f"{name}=rope"]}))
    assert run_cli("--config", str(config), "--out", str(work / "run")) == 2
    assert "c.json" in one_line(capsys)
    assert files(tmp_path) == {"c.json"}  # nothing written anywhere


def test_checkpoint_paths_stay_in_their_folder(tmp_path):
    cfg = CompareConfig(encodings=["rope"])
    assert checkpoint_path(tmp_path, cfg, "rope", 0) == tmp_path / "rope.pt"  # safe names unchanged
    for odd in ['rope(rope_scaling={"rope_type":"../../x"})', "..", ".x", "a\x00b"]:
        p = checkpoint_path(tmp_path, cfg, odd, 0)
        assert p.parent == tmp_path and p.suffix == ".pt" and not p.name.startswith(".")
    assert checkpoint_path(tmp_path, cfg, "a/b", 0) != checkpoint_path(tmp_path, cfg, "a_b", 0)


# ------------------------------------------------------------------ item 9: collisions and shadowing
@pytest.mark.parametrize(
    "encodings, match",
    [("x=rope;x=alibi", "name 'x' twice"), ("rope,rope", "name 'rope' twice"), ("rope=alibi", "is a registered"),
     ("gemma3=rope*3,nope", "is a layer preset"), ("Rope,rope", "differing only in case")],
)  # fmt: skip
def test_names_that_collide_or_shadow_are_refused(encodings, match, tmp_path, capsys):
    assert run_cli(*FAST, "--encodings", encodings, "--out", str(tmp_path / "run")) == 2
    assert match in one_line(capsys) and not (tmp_path / "run").exists()


def test_a_name_may_stand_for_itself_with_other_options():
    cfg = CompareConfig(encodings=["irope=irope(chunk=16,floor_scale=16)", "rope"], depth=4)
    assert cfg.encoding_names() == ["irope", "rope"]


def test_the_pattern_behind_a_name_is_in_the_fingerprint(tmp_path, capsys):
    assert CompareConfig(encodings=["x=rope"]).fingerprint() != CompareConfig(encodings=["x=alibi"]).fingerprint()
    # a config without named patterns keeps the fingerprint it had (old run folders still resume)
    plain = CompareConfig(encodings=["rope", "alibi"])
    old = {k: v for k, v in plain.to_dict().items() if k not in CompareConfig.BOOKKEEPING}
    import hashlib

    assert plain.fingerprint() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    out = tmp_path / "run"
    assert run_cli(*FAST, "--encodings", "x=rope", "--out", str(out)) == 0
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "encodings": ["x=alibi"]}))
    capsys.readouterr()
    assert run_cli("--resume", "--out", str(out), "--no-progress") == 2
    err = one_line(capsys)
    assert "another config" in err and "encodings" in err


# ------------------------------------------------------------------ item 3: --overwrite
def test_overwrite_removes_only_what_a_comparison_wrote(tmp_path, capsys):
    """The issue's folder: the user's checkpoints/mine.ckpt and notes stay; the run's own
    extend.* files (stale once the next run has no --extend) and checkpoints go."""
    out = tmp_path / "p"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "mine.ckpt").write_text("w")
    (out / "notes.txt").write_text("mine")
    assert run_cli(*FAST, "--encodings", "rope,alibi", "--extend", "none", "--out", str(out), "--overwrite") == 0
    assert {"extend.md", "extend.csv", "extend.png", "checkpoints/alibi.pt"} <= files(out)
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(out), "--overwrite") == 0
    left = files(out)
    assert {"checkpoints/mine.ckpt", "notes.txt", "checkpoints/rope.pt", "results.json"} <= left
    assert not {"extend.md", "extend.csv", "extend.png", "checkpoints/alibi.pt"} & left
    assert (out / "checkpoints" / "mine.ckpt").read_text() == "w" and (out / "notes.txt").read_text() == "mine"
    assert "checkpoints/rope.pt" in json.loads((out / MANIFEST).read_text())["written"]


def test_overwrite_does_not_replace_files_no_manifest_lists(tmp_path, capsys):
    out = tmp_path / "old"
    out.mkdir()
    (out / "results.json").write_text('{"theirs": 1}')  # e.g. a run of an older posenc, or not posenc's
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(out), "--overwrite") == 2
    assert "results.json" in one_line(capsys)
    assert files(out) == {"results.json"} and (out / "results.json").read_text() == '{"theirs": 1}'


def test_a_hostile_manifest_removes_nothing_outside(tmp_path, capsys):
    out, outside = tmp_path / "run", tmp_path / "outside.txt"
    outside.write_text("keep")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "x.pt").write_text("keep")
    out.mkdir()
    (out / "link").symlink_to(tmp_path / "elsewhere")
    written = ["../outside.txt", str(outside), "link/x.pt", ".lock", "link"]
    (out / MANIFEST).write_text(json.dumps({"written": written}))
    with RunDir(out, overwrite=True):
        pass
    assert outside.read_text() == "keep" and (tmp_path / "elsewhere" / "x.pt").read_text() == "keep"
    assert not (out / "link").exists()  # the link itself was listed: removed, not what it points to
    (out / "checkpoints").symlink_to(tmp_path / "elsewhere")  # writes would leave --out: refused
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(out), "--overwrite") == 2
    assert "symbolic link" in one_line(capsys)
    assert sorted(os.listdir(tmp_path / "elsewhere")) == ["x.pt"]


# ------------------------------------------------------------------ item 4: --merge
def test_merge_takes_a_run_folder_as_compare_does(tmp_path, capsys):
    a, b, m = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    for shard, d in (("1/2", a), ("2/2", b)):
        assert run_cli(*FAST, "--encodings", "rope,alibi", "--shard", shard, "--out", str(d)) == 0
    before = (a / "results.json").read_text()
    capsys.readouterr()
    assert run_cli("--merge", str(a), str(b), "--out", str(a)) == 2  # into one of its own shards
    assert "one of the runs merged" in one_line(capsys)
    assert run_cli("--merge", str(a), str(b), "--out", str(a), "--overwrite") == 2
    assert (a / "results.json").read_text() == before and (a / "checkpoints" / "rope.pt").exists()
    capsys.readouterr()
    assert run_cli("--merge", str(a), str(b), "--out", str(m), "--steps", "5", "--encodings", "t5") == 2
    assert "takes no --encodings, --steps" in one_line(capsys) and not m.exists()  # not silently ignored
    assert run_cli("--merge", str(a), str(b), "--out", str(m)) == 0
    assert [r["encoding"] for r in json.loads((m / "results.json").read_text())["runs"]] == ["rope", "alibi"]
    capsys.readouterr()
    assert run_cli("--merge", str(a), str(b), "--out", str(b.parent / "a")) == 2
    unrelated = tmp_path / "u"
    assert run_cli(*FAST, "--encodings", "t5", "--out", str(unrelated)) == 0
    capsys.readouterr()
    assert run_cli("--merge", str(a), str(b), "--out", str(unrelated)) == 2  # a finished run of its own
    assert "is not empty" in one_line(capsys)
    with RunDir(m, resume=True):  # a running compare holds the folder
        assert run_cli("--merge", str(a), str(b), "--out", str(m), "--overwrite") == 2
        assert "in use" in one_line(capsys)
    assert run_cli("--merge", str(a), str(b), "--out", str(unrelated), "--overwrite") == 0
    assert not (unrelated / "checkpoints").exists()  # the run's files went; the merge wrote its own


# ------------------------------------------------------------------ item 5: workers die with their parent
def test_workers_die_when_the_parent_is_killed(tmp_path):
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "run"
    argv = [*FAST, "--steps", "100000", "--checkpoint-every", "1", "--workers", "2", "--encodings", "rope,alibi"]
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, "-m", "posenc.cli", "compare", *argv, "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    workers = []
    try:
        deadline = time.time() + 120
        # both models training: a checkpoint of each exists
        while not all((out / "checkpoints" / f"{e}.pt").exists() for e in ("rope", "alibi")):
            assert time.time() < deadline and proc.poll() is None, "the workers never started training"
            time.sleep(0.1)
        workers = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGKILL)  # what the OOM killer does: no cleanup runs
        proc.wait()
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers {[w.pid for w in alive]} outlived their parent"
    finally:
        proc.kill()
        for w in workers:
            try:
                w.kill()
            except psutil.NoSuchProcess:
                pass


# ------------------------------------------------------------------ items 12 and 14: refused, one line, exit 2
@pytest.mark.parametrize(
    "argv, flag",
    [(["--out", ""], "--out"), (["--seeds", "0,,1"], "--seeds"), (["--eval-lens", "16,"], "--eval-lens"),
     (["--grad-clip", "-1"], "--grad-clip"), (["--grad-clip", "nan"], "--grad-clip"),
     (["--embed-std", "-1"], "--embed-std"), (["--embed-std", "nan"], "--embed-std"),
     (["--mlp-ratio", "-1"], "--mlp-ratio"), (["--lr", "inf"], "--lr"), (["--weight-decay", "nan"], "--weight-decay"),
     (["--dropout", "1"], "--dropout"), (["--min-lr-ratio", "nan"], "--min-lr-ratio"),
     (["--val-fraction", "0"], "--val-fraction"), (["--randomized-positions", "--max-pos", "1000000000000"], "1048576"),
     (["--eval-lens", "16,99999999"], "--eval-lens"), (["--batch-size", "0"], "--batch-size"),
     (["--extend", "none,,yarn"], "--extend"), (["--steps", "100000000000000000000"], "--steps"),
     (["--dataset-split", "test"], "--dataset-split"), (["--dataset-config", "x"], "--dataset-config"),
     (["--encoding-options", ""], "--encoding-options"), (["--config", ""], "--config")],
)  # fmt: skip
def test_bad_values_are_one_line_and_exit_2(argv, flag, tmp_path, capsys):
    out = tmp_path / "run"
    args = [*FAST, "--encodings", "rope", "--out", str(out), *argv]
    assert run_cli(*args) == 2
    assert flag in one_line(capsys)
    assert not out.exists()


@pytest.mark.parametrize(
    "field, value",
    [("steps", True), ("lr", "0.1"), ("compile", 1), ("seeds", [0.5]), ("encodings", "rope"), ("eval_lens", [16, True]),
     ("max_pos", 1e12), ("dropout", None), ("grad_clip", -1), ("encoding_options", []), ("sliding", "yes"),
     ("workers", 2.0), ("dataset_split", "")],
)  # fmt: skip
def test_config_files_with_wrong_types_are_refused(field, value, tmp_path, capsys):
    d = CompareConfig(encodings=["rope"], dim=16, depth=1, heads=2, train_len=16, eval_lens=[16]).to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**d, field: value}))
    assert run_cli("--config", str(path), "--out", str(tmp_path / "run")) == 2
    assert f"{field} in {str(path)!r}" in one_line(capsys)
    with pytest.raises(ValueError, match=field):
        from_dict({**d, field: value})


def test_heads_that_do_not_divide_dim_name_the_rule_and_leave_no_folder(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(*FAST, "--encodings", "rope", "--heads", "3", "--out", str(out)) == 2
    err = one_line(capsys)
    assert "dim must be divisible by heads" in err and "head_dim" not in err
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(out)) == 0  # the corrected rerun


def test_a_run_that_fails_before_any_checkpoint_leaves_the_folder_as_it_was(tmp_path, monkeypatch, capsys):
    import posenc.compare.runner as runner

    def broken(*a, **k):
        raise ValueError("model cannot be built")

    monkeypatch.setattr(runner, "train_encoding", broken)
    new, mine = tmp_path / "new", tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(new)) == 2
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(mine), "--overwrite") == 2
    assert not new.exists() and files(mine) == {"notes.txt"}
    monkeypatch.undo()
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(new)) == 0


def test_extend_of_nothing_it_applies_to_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(*FAST, "--encodings", "x=rope", "--extend", "none,yarn", "--out", str(out)) == 2
    assert "none is compared (x)" in one_line(capsys) and not out.exists()


@pytest.mark.parametrize(
    "error",
    [RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 4160 vs 4048"),
     OSError(errno.ENOSPC, "No space left on device")],
)  # fmt: skip
def test_a_full_disk_while_writing_a_checkpoint_is_one_line(error, tmp_path, monkeypatch, capsys):
    real = torch.save

    def full(obj, f, *a, **k):
        real(obj, f, *a, **k)  # some bytes reached the disk ...
        raise error  # ... then it was full

    monkeypatch.setattr(torch, "save", full)
    out = tmp_path / "run"
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(out)) == 2
    err = one_line(capsys)
    assert "cannot write checkpoint" in err and str(out / "checkpoints" / "rope.pt") in err and "disk is full" in err
    assert not out.exists()  # no checkpoint: nothing to resume, nothing left


def test_a_planted_lock_link_or_fifo_is_refused_without_writing_elsewhere(tmp_path, capsys):
    out, victim = tmp_path / "run", tmp_path / "victim.txt"
    victim.write_text("precious")
    out.mkdir()
    (out / ".lock").symlink_to(victim)
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(out)) == 2
    assert "symbolic link" in one_line(capsys) and victim.read_text() == "precious"
    (out / ".lock").unlink()
    os.mkfifo(out / ".lock")
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(out)) == 2
    assert "not a regular file" in one_line(capsys)
    fifo_shard = tmp_path / "shard"
    fifo_shard.mkdir()
    os.mkfifo(fifo_shard / ".lock")
    assert run_cli("--merge", str(fifo_shard), "--out", str(tmp_path / "m")) == 2  # no hang on the FIFO
    assert "results.json" in one_line(capsys)


def test_merge_refuses_a_name_that_stands_for_other_patterns_in_two_shards(tmp_path):
    from posenc.compare.report import merge_results
    from posenc.output import write_json

    dirs = []
    for k, (entries, run) in enumerate([(["x=rope", "y=alibi"], "x"), (["x=alibi", "y=alibi"], "y")]):
        d = tmp_path / f"shard{k}"
        cfg = CompareConfig(encodings=entries, shard=f"{k + 1}/2").to_dict()
        write_json(d / "results.json", {"config": cfg, "runs": [{"encoding": run, "seed": 0}]})
        dirs.append(d)
    with pytest.raises(ValueError, match=r"name 'x' stands for 'rope' in .*shard0 but for 'alibi' in .*shard1"):
        merge_results(dirs)
    # the same names for the same patterns merge, in the order of the entries (names, not NAME=PATTERN)
    cfg = CompareConfig(encodings=["y=alibi", "x=rope"], shard="2/2").to_dict()
    write_json(dirs[1] / "results.json", {"config": cfg, "runs": [{"encoding": "y", "seed": 0}]})
    cfg0 = {**cfg, "shard": "1/2"}
    write_json(dirs[0] / "results.json", {"config": cfg0, "runs": [{"encoding": "x", "seed": 0}]})
    assert [r["encoding"] for r in merge_results(dirs)["runs"]] == ["y", "x"]


def test_one_lock_for_every_tool_naming_its_holder(tmp_path, capsys):
    """compare's run folder is the OutputFolder every tool takes: a folder analyze holds is
    refused to compare (and the other way round), naming the holder; compare leaves no lock
    file of its own behind."""
    from posenc.output import OutputFolder

    out = tmp_path / "shared"
    with OutputFolder(out, tool="posenc analyze"):
        assert run_cli(*FAST, "--encodings", "rope", "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert f"in use by another posenc analyze (pid {os.getpid()})" in err and err.count("\n") == 1
    assert not out.exists()  # analyze made it and left it empty: gone; compare wrote nothing
    with RunDir(out):
        code = main(["analyze", "decay", "--encodings", "rope", "--length", "8", "--max-distance", "16",
                     "--head-dim", "8", "--out", str(out)])  # fmt: skip
        assert code == 2 and "in use by another posenc compare" in capsys.readouterr().err
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(out)) == 0
    assert not (out / ".lock").exists() and (out / "results.json").is_file()
