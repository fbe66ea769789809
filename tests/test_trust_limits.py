"""Issue 61: nothing wrong is reported as fine. Defaults that fit a short run, sizes bounded
in the tokens a task really generates, JSON options kept whole."""

from __future__ import annotations

import pytest

from posenc.cli import make_parser
from posenc.compare.arguments import parse_encoding_options
from posenc.compare.checks import MAX_LEN
from posenc.compare.cli import build_config
from posenc.compare.config import CompareConfig, preset_config
from posenc.compare.train import lr_schedule, val_steps
from posenc.train import cosine_schedule


# ------------------------------------------------------------------ items 1 and 3: warmup, val_points
def test_the_preset_warmup_and_val_points_fit_a_short_run():
    """The preset's 100 warmup steps and 5 validation points are cut to the steps of a
    shorter run (the rates are those the schedule gave before: it ran min(warmup, steps));
    a value given is refused instead."""
    short = preset_config("quick", steps=20)
    assert (short.warmup, short.val_points) == (20, 5)
    assert [lr_schedule(short)(n) for n in range(20)] == [cosine_schedule(1e-2, 20, 100, 0.0)(n) for n in range(20)]
    tiny = preset_config("quick", steps=2)
    assert (tiny.warmup, tiny.val_points) == (2, 2) and val_steps(tiny) == {1}
    assert preset_config("standard", steps=7).warmup == 7
    assert (preset_config("quick").warmup, preset_config("quick").val_points) == (100, 5)  # a full run: as before
    args = make_parser().parse_args(["compare", "--encodings", "rope", "--steps", "2"])
    assert (build_config(args).warmup, build_config(args).val_points) == (2, 2)
    with pytest.raises(ValueError, match=r"warmup must be an int in \[0, steps=20\] .*got 1000"):
        preset_config("quick", steps=20, warmup=1000)
    with pytest.raises(ValueError, match=r"warmup must be an int in \[0, steps=20\] .*got 100"):
        CompareConfig(steps=20)  # the dataclass's own default is a value like any other
    with pytest.raises(ValueError, match=r"val_points must be an int in \[0, steps=20\] .*got 21"):
        CompareConfig(steps=20, warmup=0, val_points=21)
    CompareConfig(steps=20, warmup=20, val_points=20)  # the peak at the last step; a point after every step


# ------------------------------------------------------------------ item 6: the tokens a task generates
@pytest.mark.parametrize(
    "task, field, value, tokens",
    [
        ("count", "eval_lens", [16, 300000], 4 * 300000 + 2),
        ("grid", "eval_lens", [8, 2000], 2000 * 2001),
        ("grid", "train_len", 1100, 1100 * 1101),
        ("kaz-sort-multi", "eval_lens", [110000], 10 * 110000 + 12),
    ],
)
def test_task_lengths_are_bounded_in_the_tokens_they_generate(task, field, value, tokens):
    """``--task count --eval-lens 100000`` ran; the bound of 2^20 tokens counted statements."""
    with pytest.raises(ValueError, match=rf"{field} .*{tokens} tokens.*at most {MAX_LEN}"):
        preset_config("quick", task=task, **{field: value})
    preset_config("quick", task="count", eval_lens=[16, (MAX_LEN - 2) // 4])  # the longest that fits


# ------------------------------------------------------------------ item 5: JSON inside --encoding-options
def test_encoding_options_keep_json_values_whole():
    """``rope.rope_scaling={"rope_type":"yarn","factor":4}`` was split at its comma."""
    yarn = {"rope_type": "yarn", "factor": 4}
    text = 'rope.rope_scaling={"rope_type":"yarn","factor":4},t5.max_distance=64'
    assert parse_encoding_options(text) == {"rope": {"rope_scaling": yarn}, "t5": {"max_distance": 64}}
    assert parse_encoding_options('x.a=[1, 2],x.b="p,q",x.c="}{,",x.d=abc') == {
        "x": {"a": [1, 2], "b": "p,q", "c": "}{,", "d": "abc"}
    }
    assert parse_encoding_options(r'x.e="a\",b"') == {"x": {"e": 'a",b'}}
    args = make_parser().parse_args(["compare", "--encodings", "rope", "--encoding-options", text[: text.index(",t5")]])
    assert build_config(args).encoding_options["rope"]["rope_scaling"] == yarn
