"""The coverage table of docs/hf-coverage.md is what scripts/hf_coverage.py
computes: every ✓/✗ and every reason (the printed differences may move within their bound on
another CPU). By default a few model types, one per mechanism a row names (interleaved pairs,
NoPE layers by rule, partial cos/sin, a Llama-like row, a type no row covers); the whole walk
under ``-m slow``, with the issue's floor of 60 converting families. The ``command-a`` and
``smollm3`` presets, as the encoding of a converted tiny Cohere 2 / SmolLM3, equal the stock model.
"""

from __future__ import annotations

import importlib.util
import logging
import pathlib
import re
import sys

import pytest
import torch
from tests.conftest import assert_close

transformers = pytest.importorskip("transformers")
import posenc.hf as ph  # noqa: E402

_PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "hf_coverage.py"
_spec = importlib.util.spec_from_file_location("hf_coverage", _PATH)
cov = sys.modules["hf_coverage"] = importlib.util.module_from_spec(_spec)  # (its dataclass looks itself up)
_spec.loader.exec_module(cov)

FAST = ("olmo2", "cohere2", "smollm3", "phi", "glm4", "bert")


@pytest.fixture(scope="module")
def documented() -> dict:
    return cov.verdicts_of(cov.documented())


def _measure(types) -> list:
    logging.disable(logging.WARNING)
    try:
        return cov.rows(types)
    finally:
        logging.disable(logging.NOTSET)


def test_documented_rows_equal_the_walk_for_a_few_types(documented):
    found = _measure(FAST)
    assert [r.model_type for r in found] == sorted(FAST)
    for r in found:
        assert documented[r.model_type] == r.verdicts(), r.model_type
    assert sum(r.ok for r in found) == 5  # every one but bert (no row: another layout)


def test_the_table_round_trips_through_its_reader():
    found = [
        cov.Row(
            "a",
            "A",
            parity=0.0,
            parity_bound=1e-3,
            cached=1e-6,
            cached_tokens=True,
            round_trip=0.0,
            loss=5.0,
            moved=True,
        ),
        cov.Row("b", "B", parity=1.0, parity_bound=1e-3, cached=None, round_trip=0.0, loss=5.0, moved=False),
        cov.Row("c", "C", reason="no `q_proj`/`k_proj` (fused: no row)"),
        cov.Row("d", "D", reason="no `q_proj`/`k_proj` (fused: no row)"),
    ]
    back = cov.verdicts_of(cov.table(found))
    assert back == {r.model_type: r.verdicts() for r in found}
    assert back["b"] == ("b", "B", False, None, True, False)
    assert cov.table(found).startswith("**1 of 4 model types**")


def test_bad_model_type_is_refused(capsys):
    assert cov.main(["no_such_type"]) == 2
    assert "unknown model type(s) ['no_such_type']" in capsys.readouterr().out


def _documented_version() -> str:
    return re.search(r"\(transformers ([^,]+),", cov.documented()).group(1)


@pytest.mark.slow
def test_documented_table_equals_the_whole_walk(documented):
    """With the transformers the table was written with (the newest of the range pyproject.toml
    pins, which a fresh install gets), the walk equals the table; with another version of the
    range, every documented converting type the installed version has still converts (new types
    and reworded upstream errors are the next ``--write``'s)."""
    found = _measure(None)
    assert sum(r.ok for r in found) >= 60
    got = {r.model_type: r.verdicts() for r in found}
    if transformers.__version__ == _documented_version():
        assert got == documented
    else:
        ok = [
            t for t, v in documented.items() if len(v) == 6 and v[2] and v[3] is not False and all(v[4:]) and t in got
        ]
        assert [t for t in ok if got[t] != documented[t]] == []


def test_the_table_names_a_version_of_the_pinned_range():
    """The documented table is of a transformers version that pyproject.toml's range admits."""
    from packaging.specifiers import SpecifierSet

    pins = pathlib.Path(__file__).resolve().parents[1].joinpath("pyproject.toml").read_text(encoding="utf-8")
    spec = re.search(r'"transformers([^"]+)"', pins).group(1)
    assert _documented_version() in SpecifierSet(spec), (spec, _documented_version())


@pytest.mark.parametrize(
    "preset,make",
    [
        (  # Cohere 2 / Command A: RoPE (interleaved, θ = 50k) on three sliding layers, the global one NoPE
            "command-a",
            lambda t: t.Cohere2ForCausalLM(
                t.Cohere2Config(**cov.SMALL | {"num_hidden_layers": 4}, rope_parameters={"rope_theta": 50000.0})
            ),
        ),
        (  # SmolLM3: NoPE every 4th layer, θ = 5M
            "smollm3",
            lambda t: t.SmolLM3ForCausalLM(
                t.SmolLM3Config(**cov.SMALL | {"num_hidden_layers": 4}, rope_parameters={"rope_theta": 5e6})
            ),
        ),
    ],
)
def test_presets_reproduce_their_stock_family(preset, make):
    """The preset as the encoding of a converted tiny model of its family equals the stock model
    (what the model's own scheme gives too): the presets name the families' real layer rules."""
    torch.manual_seed(0)
    stock = make(transformers).eval()
    ids = torch.randint(1, cov.V, (2, 20))
    with torch.no_grad():
        want = stock(ids).logits
        got = ph.convert(stock, encoding=preset).eval()(ids).logits
    assert_close(got, want, n=cov.reduction_n(stock.config, 20))
