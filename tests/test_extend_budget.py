"""``posenc extend --budget`` (issue 64, part 3): the settings cut to fit the plan's estimate, in
order (passkey trials, windows, then the stride), what was cut in the report, the refusal when
nothing fits, and the progress lines with the time left. The warm-up is replaced by a fixed
rate, so the estimate (and so each cut) is exact."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
from tests.test_extend import llama, run  # noqa: E402 (the tiny checkpoint and the CLI runner)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    llama().save_pretrained(path)
    return path


def _n():
    from posenc.extend.passkey import Tokens, min_length

    return min_length(Tokens()) + 8  # the shortest passkey prompt with some filler


def _cost(ckpt, **settings) -> int:
    """The plan's estimate at one second per token and no cost of context (the warm-up of
    ``counted``): the tokens these settings read."""
    from posenc.data import embedded_corpus
    from posenc.extend.model import load_subject
    from posenc.extend.passkey import Tokens
    from posenc.extend.plan import estimate, plan

    subject = load_subject(str(ckpt), device=torch.device("cpu"), dtype=torch.float32)
    text_len = len(embedded_corpus()) // 10
    s = {"methods": ["none", "rerope"], "lengths": [32, _n()], "stride": None, **settings}
    return estimate(plan(subject, s, text_len, Tokens(), set()), {"tokens": 1, "seconds": 1.0})["estimate_s"]


@pytest.fixture
def counted(monkeypatch):
    """The tokens of every scoring call; the warm-up at ``rate[0]`` seconds per cost unit."""
    import posenc.extend.evaluate as ev
    import posenc.extend.passkey as pkmod
    import posenc.extend.plan as planmod

    read, rate = [], [1e-3]
    scores = ev.token_scores

    def scored(kind, model, ids, **k):
        read.append(len(ids))
        return scores(kind, model, ids, **k)

    monkeypatch.setattr(ev, "token_scores", scored)
    monkeypatch.setattr(pkmod, "token_scores", scored)
    monkeypatch.setattr(planmod, "warm_up", lambda subject, text, chunk: {"tokens": 1000, "seconds": 1000 * rate[0]})
    return read, rate


# (windows, trials asked) -> the settings chosen, the cut lines
CASES = {
    "trials": ((2, 3), dict(windows=2, passkey_trials=2, stride_factor=1), ["passkey trials 3 -> 2 per depth"]),
    "windows": ((5, 2), dict(windows=3, passkey_trials=1, stride_factor=1),
                ["passkey trials 2 -> 1 per depth", "windows 5 -> 3 per length"]),
    "stride": ((4, 1), dict(windows=2, passkey_trials=1, stride_factor=2), ["windows 4 -> 2 per length", "stride "]),
    "last window": ((4, 1), dict(windows=1, passkey_trials=1, stride_factor=1024), ["windows 4 -> 1 per length"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_budget_cuts_in_order_and_the_run_scores_what_was_chosen(case, ckpt, tmp_path, capsys, counted):
    (windows, trials), chosen, cuts = CASES[case]
    read, rate = counted
    target = _cost(ckpt, **chosen)
    rate[0] = 0.99 / target  # the chosen settings just fit "1s"
    if case != "last window":  # the next most informative setting does not
        more = dict(chosen, **({"passkey_trials": chosen["passkey_trials"] + 1} if case == "trials" else
                               {"windows": chosen["windows"] + 1} if case == "windows" else {"stride_factor": 1}))  # fmt: skip
        assert _cost(ckpt, **more) * rate[0] > 1
    out = tmp_path / "o"
    assert run(ckpt, "--lengths", f"1x,{_n()}", "--methods", "none,rerope", "--windows", windows, "--passkey-trials",
               trials, "--chunk", "64", "--budget", "1s", "--out", out) == 0  # fmt: skip
    err = capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    assert res["budget"]["chosen"]["windows"] == chosen["windows"]
    assert res["budget"]["chosen"]["passkey_trials"] == chosen["passkey_trials"]
    if case != "last window":
        assert res["budget"]["chosen"]["stride_factor"] == chosen["stride_factor"]
    assert len(res["budget"]["cuts"]) == len(cuts)
    for want, got in zip(cuts, res["budget"]["cuts"]):
        assert got.startswith(want)
        assert f"budget: {got} to fit --budget 1s" in err
    table = (out / "table.md").read_text()
    assert f"{', '.join(res['budget']['cuts'])} to fit --budget 1s" in table
    assert "to fit --budget 1s" in (out / "report.md").read_text().split("## Reading", 1)[1].split("## Tables")[0]
    # every method and length was run, with the settings chosen, and read what the plan counted
    runs = [c for c in res["cells"] if c.get("applicable")]
    assert {(c["method"], c["length"]) for c in runs} == {(m, n) for m in ("none", "rerope") for n in (32, _n())}
    assert sum(read) == res["plan"]["tokens_read"]
    assert sum(c["tokens_read"] for c in res["plan"]["cells"] if c["runs"]) == target
    for c in runs:
        assert c["windows"] == chosen["windows"]
        base = min(256, c["length"] // 2)
        if chosen["windows"] > 1:
            assert c["stride"] == min(c["length"], base * chosen["stride_factor"])
    pk = {(c["method"], c["length"]): c["passkey_prompts"] for c in res["plan"]["cells"]}
    assert pk[("none", _n())] == 5 * chosen["passkey_trials"]
    if case == "stride":
        assert "stride 16 -> 32 at L=32" in res["budget"]["cuts"][-1]


def test_when_even_the_least_does_not_fit_the_run_is_refused_before_scoring(ckpt, tmp_path, capsys, counted):
    read, rate = counted
    rate[0] = 1.01 / _cost(ckpt, windows=1, passkey_trials=1)
    out = tmp_path / "o"
    assert run(ckpt, "--lengths", f"1x,{_n()}", "--methods", "none,rerope", "--budget", "1s", "--out", out) == 2
    err = [r for r in capsys.readouterr().err.splitlines() if r.startswith("posenc extend: error")]
    assert err == ["posenc extend: error: --budget 1s: even the least (1 passkey trial per depth, 1 window per "
                   "length, every method and length) is estimated at 1.01 s; allowed: a longer --budget, or fewer "
                   "--methods or --lengths"]  # fmt: skip
    assert read == [] and not out.exists()


@pytest.mark.parametrize("value", ["20x", "0s", "h", "-1m", "1 hour"])
def test_a_bad_budget_is_one_line_naming_the_value(value, ckpt, tmp_path, capsys):
    assert run(ckpt, f"--budget={value}", "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"posenc extend: error: --budget: {value!r} is not a duration; allowed: a positive number "
                   "followed by s, m or h (e.g. 90s, 20m, 1h)")  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_parse_budget():
    from posenc.extend.budget import parse_budget

    assert [parse_budget(v) for v in ("90s", "20m", "1h", "1.5h", " 2m ")] == [90, 1200, 3600, 5400, 120]


def test_progress_lines_say_the_time_left_per_cell(ckpt, tmp_path, capsys):
    assert run(ckpt, "--lengths", "1x,2x", "--methods", "none,linear,longrope", "--windows", "1",
               "--passkey-trials", "0", "--out", tmp_path / "o") == 0  # fmt: skip
    lines = [r for r in capsys.readouterr().err.splitlines() if r.startswith("[")]
    assert [r.split("]")[0] + "]" for r in lines] == [f"[{k}/6]" for k in range(1, 7)]
    assert lines[0].startswith("[1/6] none @ 32: ") and " s, about " in lines[0] and lines[0].endswith(" left")
    assert "longrope @ 64" in lines[-1] and lines[-1].endswith("about 0 s left")


def test_the_time_left_rescales_the_plan_by_the_time_measured():
    from posenc.extend.budget import Progress

    plan = {"cells": [{"method": "a", "length": 8, "estimate_s": 1.0}, {"method": "b", "length": 8, "estimate_s": 3.0},
                      {"method": "c", "length": 8, "runs": False}], "estimate_s": 4.0}  # fmt: skip
    t = iter([0.0, 2.0, 8.0, 8.0])  # the first cell took 2 s for an estimated 1 s: twice the plan's rate
    lines = []
    p = Progress(plan, lines.append, clock=lambda: next(t))
    p("a", 8), p("b", 8), p("c", 8)
    assert lines == ["[1/3] a @ 8: 2.0 s, about 6 s left", "[2/3] b @ 8: 6.0 s, about 0 s left",
                     "[3/3] c @ 8: 0.0 s, about 0 s left"]  # fmt: skip


def test_the_estimate_pays_the_attention_of_a_long_context():
    """Two warm-up forwards (n and 4n tokens) give the cost per token ``a`` and per token of
    context ``b`` of ``T(L) = a·L + b·L²/2``; a cell's estimate is its forwards of its length,
    the attention counted once per score map (ReRoPE: 2)."""
    from posenc.extend.plan import estimate, rates

    a, b = 2e-3, 1e-6

    def T(n):
        return a * n + b * n * n / 2

    warm = {"tokens": 512, "seconds": T(512), "long_tokens": 2048, "long_seconds": T(2048)}
    got = rates(warm)
    assert got == pytest.approx((a, b), rel=1e-9)
    cells = [{"method": "none", "length": 16384, "runs": True, "tokens_read": 3 * 16384, "maps": 1},
             {"method": "rerope", "length": 8192, "runs": True, "tokens_read": 8192, "maps": 2},
             {"method": "x", "length": 8192, "runs": False}]  # fmt: skip
    p = estimate({"cells": cells, "tokens_read": 4 * 16384}, warm)
    want = [3 * T(16384), a * 8192 + 2 * b * 8192**2 / 2]
    assert [c.get("estimate_s") for c in p["cells"]] == pytest.approx([*want, None])
    assert p["estimate_s"] == pytest.approx(sum(want))
    assert p["estimate_s"] > 2 * a * 4 * 16384  # the first cell alone: attention doubles a 16k forward's cost
    # one warm-up point (or a longer one no slower per token): no cost of context
    assert rates({"tokens": 100, "seconds": 0.5}) == (0.005, 0.0)
    assert rates({"tokens": 100, "seconds": 0.5, "long_tokens": 400, "long_seconds": 1.0}) == (0.005, 0.0)


def test_a_warm_up_that_fits_no_context_term_gets_the_attentions_flops():
    """A busy machine can time the longer warm-up forward no slower per token: the fit then has no
    cost of context, and a 16k window would be priced at a 512-token one's rate. The context term is
    at least the attention's FLOPs at the weights' rate (4·Σ H·Dh over 2·P), the short forward's time kept."""
    from types import SimpleNamespace

    from posenc.extend.plan import context_share, rates

    model = torch.nn.Linear(100, 50)  # 5 050 parameters
    subject = SimpleNamespace(model=model, encodings=[SimpleNamespace(heads=3, head_dim=8)] * 2)
    share = context_share(subject)
    assert share == pytest.approx(4 * (2 * 3 * 8) / (2 * 5050))
    warm = {"tokens": 100, "seconds": 0.5, "long_tokens": 400, "long_seconds": 1.0, "context_share": share}
    a, b = rates(warm)
    assert b == pytest.approx(a * share) and b > 0
    assert a * 100 + b * 100**2 / 2 == pytest.approx(0.5)  # (the short forward as timed)
    # a fit above the floor is kept as it is
    a0, b0 = 2e-3, 1e-6
    T = lambda n: a0 * n + b0 * n * n / 2  # noqa: E731
    fit = {"tokens": 512, "seconds": T(512), "long_tokens": 2048, "long_seconds": T(2048), "context_share": 1e-5}
    assert rates(fit) == pytest.approx((a0, b0), rel=1e-9)


def test_two_map_methods_cost_one_map_on_cpu_and_theirs_elsewhere():
    """The estimate counts ReRoPE's two maps and DCA's three where ``chunked`` runs them (off the
    CPU), and about one map on CPU, where ``auto`` runs the ``maps`` backend (each over its own keys)."""
    from posenc.extend.plan import score_maps

    assert [score_maps(m, "cpu") for m in ("none", "rerope", "self-extend", "dca")] == [1, 1, 1, 1]
    assert [score_maps(m, "cuda") for m in ("none", "rerope", "self-extend", "dca")] == [1, 2, 2, 3]
