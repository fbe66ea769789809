"""The command line and the README's encodings table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import posenc
from posenc.cli import encoding_rows, main, markdown_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_list_prints_every_encoding(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in posenc.available():
        assert name in out


def test_list_markdown_and_options(capsys):
    assert main(["list", "--format", "markdown"]) == 0
    assert capsys.readouterr().out.strip() == markdown_table(encoding_rows())
    assert main(["list", "--options"]) == 0
    assert "max_relative_position" in capsys.readouterr().out


def test_readme_table_matches_posenc_list():
    text = README.read_text()
    m = re.search(r"<!-- encodings:start -->\n(.*?)\n<!-- encodings:end -->", text, re.S)
    assert m, "README has no encodings table markers"
    expected = markdown_table(encoding_rows())
    assert m.group(1).strip() == expected, (
        "README encodings table is stale; regenerate it with `posenc list --format markdown`"
    )


def test_rows_describe_each_encoding():
    rows = {r["name"]: r for r in encoding_rows()}
    assert rows["rope"]["relative"] == "yes" and rows["learned"]["extrapolates"] == "no"
    assert rows["shaw"]["stages"] == "terms, value"


def test_console_script_runs():
    r = subprocess.run(
        [sys.executable, "-m", "posenc.cli", "list", "--format", "markdown"], capture_output=True, text=True, check=True
    )
    assert "`alibi`" in r.stdout


def test_help_exits_cleanly():
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0


def test_a_list_of_choices_drops_or_keeps_repeats_and_names_unknown_values():
    """The flag of a list of names (posenc.fields.ListOf(Choice)): the one list rule, then each name."""
    from argparse import ArgumentTypeError

    from posenc.fields import Choice, ListOf

    assert ListOf(Choice(["a", "b"]), dedupe=True).parse("b, a,b") == ["b", "a"]
    assert ListOf(Choice(iter(["a", "b"]))).parse("b,a,b") == ["b", "a", "b"]  # any iterable, read once
    with pytest.raises(ArgumentTypeError, match=r"unknown backend 'c'; allowed: a, b"):
        ListOf(Choice(iter(["a", "b"]), what="backend")).parse("a,c")
    with pytest.raises(ArgumentTypeError, match=r"unknown backends 'c', 'd'; allowed: a, b"):
        ListOf(Choice(["a", "b"], what="backend")).parse("c,a,d")
    with pytest.raises(ArgumentTypeError, match="expected comma-separated backends from a, b"):
        ListOf(Choice(["a", "b"], what="backend")).parse(",,")
