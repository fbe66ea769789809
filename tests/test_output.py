"""posenc.output: one table (rich and Markdown), one JSON float policy, one figure style."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest

from posenc.output import Column, Table, clean, pyplot, readable_log_axis, save_figure, write_csv, write_json


def test_markdown_and_rich_from_the_same_rows():
    t = Table([Column("encoding", code=True), "ppl", "note"], [["rope", 7.5, "a|b"], ["alibi", 12345.0, None]],
              title="ppl by length", notes=["learned: n/a"])  # fmt: skip
    md = t.markdown()
    assert md.splitlines() == [
        "ppl by length",
        "",
        "| encoding | ppl | note |",
        "|---|---:|---|",  # numbers right-aligned
        "| `rope` | 7.5000 | a\\|b |",
        "| `alibi` | 1.23e+04 |  |",
        "",
        "note: learned: n/a  ",
    ]
    from rich.console import Console

    con = Console(file=io.StringIO(), width=100, record=True)
    t.print(con)
    text = con.export_text()
    for cell in ("ppl by length", "rope", "7.5000", "a|b", "alibi", "1.23e+04", "note: learned: n/a"):
        assert cell in text
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        Table(["a", "b", "c"], [[1, 2]])
    with pytest.raises(ValueError, match="align"):
        Column("x", align="center")


def test_rich_shows_brackets_as_text():
    from rich.console import Console

    con = Console(file=io.StringIO(), width=80, record=True)
    Table(["model"], [["[bold]rope[/bold]"]]).print(con)
    assert "[bold]rope[/bold]" in con.export_text()


def test_json_policy_nan_and_inf_are_null(tmp_path):
    data = {"a": float("nan"), "b": [1.0, float("inf"), (2, -float("inf"))], "c": 0.1234567891234, "d": "x"}
    assert clean(data) == {"a": None, "b": [1.0, None, [2, None]], "c": 0.1234567891234, "d": "x"}
    assert clean(data, digits=7)["c"] == 0.1234568
    path = write_json(tmp_path / "sub" / "r.json", data)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))["a"] is None


def test_csv_rows(tmp_path):
    rows = [
        {"name": "rope", "times": [0.1234567, 2.0], "x": float("nan"), "extra": 1},
        {"name": "t5", "times": [], "x": 1.5},
    ]
    path = write_csv(tmp_path / "r.csv", rows, ["name", "times", "x"])
    got = list(csv.DictReader(path.open()))
    assert got == [{"name": "rope", "times": "0.123457;2", "x": ""}, {"name": "t5", "times": "", "x": "1.5"}]
    assert write_csv(tmp_path / "none.csv", []) is None and not (tmp_path / "none.csv").exists()


@pytest.mark.parametrize("values, max_ratio", [([1.2e-9, 3e-7, 0.02, 1.3], 10.0), ([0.003, 0.5, 7.0], 2.5)])
def test_log_axis_labels_across_many_decades(values, max_ratio):
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot(range(len(values)), values)
    readable_log_axis(ax, values)
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    ticks = [t for t in ax.get_yticks() if lo <= t <= hi]
    labels = [t.get_text() for t in ax.get_yticklabels() if lo <= t.get_position()[1] <= hi]
    assert all(labels) and len(labels) == len(ticks) >= 3
    assert all(b / a <= max_ratio * (1 + 1e-9) for a, b in zip(ticks, ticks[1:]))
    assert min(ticks) <= min(values) * max_ratio and max(ticks) * max_ratio >= max(values)
    plt.close(fig)
    assert not math.isnan(lo)


def test_save_figure_titles_and_writes_png(tmp_path):
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    titles = []
    fig.suptitle = lambda text, **kw: titles.append(text)  # what save_figure asks for
    path = save_figure(fig, tmp_path / "f.png", title="Length extrapolation", subtitle="preset quick, 400 steps")
    assert titles == ["Length extrapolation\npreset quick, 400 steps"]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
