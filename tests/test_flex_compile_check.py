"""benchmarks/flex_compile_check.py: its flags refuse bad values in one line (exit 2), and
its ``--device cpu`` dry run runs the decode rows in the order given, repeats kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "flex_compile_check.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("decode", "--device", "cpu", "--backends", "dense,nosuch"), "'nosuch'"),
        (("decode", "--device", "cpu", "--backends", ",,"), "--backends"),
        (("entries", "--device", "cpu", "--encodings", "alibi,nosuch"), "'nosuch'"),
        (("entries", "--device", "cpu", "--encodings", "rope"), "'rope'"),  # flex cannot run it
        (("entries", "--device", "cpu", "--lengths", "0"), "--lengths"),
        (("decode", "--device", "cpu", "--steps", "1"), "--steps"),
        (("decode", "--device", "cuda:x"), "'cuda:x'"),
    ],
)
def test_bad_flag_is_one_line_exit_2(args, named):
    proc = _run(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], proc.stderr


def test_cpu_dry_run_of_entries_on_flex_encodings():
    proc = _run("entries", "--device", "cpu", "--encodings", "alibi,t5", "--lengths", "16", "--heads", "1",
                "--repeats", "1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines() if "L=" in line] == ["alibi", "t5"]


def test_cpu_dry_run_keeps_the_order_and_repeats_of_backends():
    proc = _run("decode", "--device", "cpu", "--prefill", "8", "--steps", "2", "--heads", "1",
                "--backends", "dense,auto,dense")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("decode ")]
    assert rows == ["dense", "auto", "dense"]


def test_only_entries_builds_encodings_and_only_those_named(monkeypatch):
    """Knowing which encodings flex runs means building them: ``decode`` builds none, ``entries``
    only those in ``--encodings`` (every registered one only to word a refusal)."""
    import importlib.util

    import posenc

    spec = importlib.util.spec_from_file_location("flex_compile_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    built = []
    real = posenc.build

    def counting_build(name, **kw):
        built.append(name)
        return real(name, **kw)

    monkeypatch.setattr(posenc, "build", counting_build)
    monkeypatch.setattr(mod, "entries", lambda args, device: None)
    monkeypatch.setattr(mod, "decode", lambda args, device: None)
    assert mod.main(["decode", "--device", "cpu"]) == 0 and built == []
    assert mod.main(["entries", "--device", "cpu", "--encodings", "alibi,t5"]) == 0 and built == ["alibi", "t5"]
