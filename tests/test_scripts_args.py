"""The developer scripts refuse bad arguments in one line with exit 2, before loading anything."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

_SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv", [[], ["abc"], ["1"], ["16384", "extra"], ["-5"]])
def test_llamacpp_yarn_refuses_a_bad_length(argv, capsys):
    assert _load("llamacpp_yarn").main(argv) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "length must be one integer of at least 2" in out and repr(argv) in out
