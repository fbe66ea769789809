"""Every range declared once (issue 62 item 4): the declarations of :mod:`posenc.fields`, read by
the configs' checks and by every command's flags, and the one list rule of every comma flag."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

import posenc
from posenc.cli import make_parser
from posenc.compare.config import CompareConfig
from posenc.fields import Bool, Choice, Float, Int, ListOf, Str, check, declared, split_list

Error = argparse.ArgumentTypeError


def test_every_config_field_declares_its_range_and_compare_flags_read_it():
    """Each CompareConfig field is declared once; its flag's type is that declaration's reader."""
    decls = declared(CompareConfig)
    assert list(decls) == [f.name for f in dataclasses.fields(CompareConfig)]
    compare = make_parser()._subparsers._group_actions[0].choices["compare"]
    by_dest = {a.dest: a for a in compare._actions}
    for name, decl in decls.items():
        action = by_dest["cfg_preset" if name == "preset" else f"cfg_{name}"]
        if isinstance(decl, Bool):
            assert isinstance(action, argparse.BooleanOptionalAction), name
        elif name == "preset":
            assert action.choices == decl.names()
        else:
            assert action.type == decl.reader(), name


def test_library_configs_read_their_declarations():
    assert set(declared(posenc.ModelConfig)) >= {"vocab_size", "dim", "depth", "heads", "head_dim", "dropout"}
    assert set(declared(posenc.LayerSpec)) == {"window", "chunk", "kv_heads"}
    with pytest.raises(ValueError, match=r"^dim must be a positive int, got 0$"):
        posenc.ModelConfig(32, 0, 1, 2)
    with pytest.raises(ValueError, match=r"^attn_dropout must be a finite number in \[0, 1\), got 1.0$"):
        posenc.ModelConfig(32, 16, 1, 2, attn_dropout=1.0)
    with pytest.raises(ValueError, match=r"^LayerSpec.chunk must be a positive int or None, got True$"):
        posenc.LayerSpec("rope", chunk=True)


@pytest.mark.parametrize(
    ("decl", "value", "flag"),
    [
        (Int(1, 65536), "an int in [1, 65536]", "an integer in 1..65536"),
        (Int(1), "a positive int", "an integer >= 1"),
        (Int(2, 4096, even=True), "an even int in [2, 4096]", "an even integer in 2..4096"),
        (Int(64, 256, multiple=64), "a multiple of 64 in [64, 256]", "a multiple of 64 in 64..256"),
        (Float(0, 1, lo_open=True), "a finite number in (0, 1]", "a finite number > 0 and <= 1"),
        (Float(0, 1, hi_open=True), "a finite number in [0, 1)", "a finite number >= 0 and < 1"),
        (Float(0, lo_open=True), "a finite number > 0", "a finite number > 0"),
        (ListOf(Int(0, 9), distinct=True), "a non-empty list of distinct ints in [0, 9]", "comma-separated integers in 0..9"),
        (ListOf(Choice(("a", "b"), what="mask")), "a non-empty list of masks from a, b", "comma-separated masks from a, b"),
    ],
)  # fmt: skip
def test_one_declaration_says_its_range_to_a_value_and_to_a_flag(decl, value, flag):
    assert decl.text() == value and decl.text(flag=True) == flag


def test_a_bound_may_name_another_field():
    @dataclasses.dataclass
    class Run:
        steps: int = Int(1).field(10)
        warmup: int = Int(0, 100, at_most="steps", note="why").field(5)

    check(Run())
    with pytest.raises(ValueError, match=r"^warmup must be an int in \[0, steps=10\] \(why\), got 11$"):
        check(Run(warmup=11))
    with pytest.raises(ValueError, match=r"^warmup must be an int in \[0, 100\] \(why\), got 101$"):
        check(Run(steps=1000, warmup=101))  # the smaller bound is the one said
    with pytest.raises(ValueError, match=r"^steps must be a positive int, got True$"):  # steps first
        check(Run(steps=True, warmup=11))


def test_a_list_default_is_copied_per_instance():
    @dataclasses.dataclass
    class C:
        xs: list[int] = ListOf(Int(0)).field([1, 2])

    a, b = C(), C()
    a.xs.append(3)
    assert b.xs == [1, 2]


@pytest.mark.parametrize("text", ["", " ", ",", "512,,1024", "512,", ",512", "512, ,1024"])
def test_the_list_rule_refuses_an_empty_item(text):
    with pytest.raises(Error, match=rf"expected comma-separated integers in 1..9 \(none empty\), got {text!r}"):
        split_list(text, "comma-separated integers in 1..9")


def test_the_list_rule_splits_json_items_only_outside_brackets_and_strings():
    assert split_list(" a, b ") == ["a", "b"]
    assert split_list('x={"a": 1, "b": [1, 2]}, y="p,q"', json=True) == ['x={"a": 1, "b": [1, 2]}', 'y="p,q"']


def test_a_flag_reads_type_and_range_convert_reads_the_type_only():
    assert Int(1, 9).parse(" 3 ") == 3 and Int(1, 9).convert("30") == 30  # the range: the config's check
    for bad in ("", "0", "10", "1.5", "nan", "0x10"):
        with pytest.raises(Error, match=rf"^must be an integer in 1..9, got {bad!r}$"):
            Int(1, 9).parse(bad)
    with pytest.raises(Error, match=r"must be a finite number > 0 and <= 1"):
        Float(0, 1, lo_open=True).parse("nan")
    assert ListOf(Int(1, 9)).parse("3, 1") == [3, 1]
    with pytest.raises(Error, match=r"expected comma-separated integers in 1..9, got '0' in '3,0'"):
        ListOf(Int(1, 9)).parse("3,0")
    assert Str().parse("x") == "x"
    with pytest.raises(Error):
        Str().parse(" ")
    with pytest.raises(Error, match=r"unknown dtype 'x'; allowed: a, b"):
        Choice(("a", "b"), what="dtype").parse("x")
