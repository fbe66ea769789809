"""Issue 64's smaller defects of ``posenc extend`` (and of ``posenc.hf.convert`` on a GGUF-loaded
model), each pinned by a test that failed before its fix; and the estimate extend prints first."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

# the tiny checkpoint, its training length and the CLI runner of the extend tests
from tests.test_extend import FAST, L, llama, run  # noqa: E402

import posenc.hf as ph  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    llama().save_pretrained(path)
    return path


def test_a_gguf_loaded_model_converts_and_saves_without_its_quantization_config(tmp_path):
    from transformers.utils.quantization_config import GgufConfig

    model = llama()
    # what transformers' GGUF loader leaves on the config (quantizers/base.py: postprocess_model)
    model.config.quantization_config = GgufConfig(gguf_file="model.Q4_1.gguf", dequantize=False)
    new = ph.convert(model)
    assert "quantization_config" not in new.config.to_dict()
    new.save_pretrained(tmp_path / "m")
    assert "quantization_config" not in json.loads((tmp_path / "m" / "config.json").read_text())
    ids = torch.randint(0, 256, (1, 12))
    again = type(new).from_pretrained(tmp_path / "m").eval()
    assert torch.equal(again(ids).logits, new(ids).logits)
    # a dict as a saved config.json gives it: the same
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf"}
    assert "quantization_config" not in ph.convert(model).config.to_dict()


def test_a_short_text_is_refused_before_the_model_loads(ckpt, tmp_path, capsys, monkeypatch):
    import posenc.extend.model as modelmod

    def load(*a, **k):
        raise AssertionError("the model was loaded before --text was checked")

    monkeypatch.setattr(modelmod, "read_hf", load)
    (tmp_path / "short.txt").write_text("a short text " * 4)
    assert run(ckpt, "--text", tmp_path / "short.txt", "--lengths", "2x", "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "--text: 52 tokens, fewer than the longest length 64; allowed: a text of at least 64 tokens" in err
    tok = tmp_path / "with-tokenizer"
    llama().save_pretrained(tok)
    (tok / "tokenizer.json").write_text("{}")  # (never read: the text is refused first)
    assert run(tok, "--text", tmp_path / "short.txt", "--lengths", "100", "--out", tmp_path / "o") == 2
    assert "--text: 52 bytes (at most 53 tokens), fewer than the longest length 100" in capsys.readouterr().err


def _cell(m, n, ppl, pk=None):
    return {"method": m, "length": n, "applicable": True, "ppl": ppl, "passkey": pk, "ms_per_token": 1.0,
            "setting": ""}  # fmt: skip


def test_the_reading_says_when_nothing_past_the_window_was_measured():
    from posenc.extend.report import reading

    pk = {"0": 1.0, "1": 1.0}
    results = {"train_len": 32, "settings": {"methods": ["none", "yarn"]},
               "cells": [_cell("none", 16, 10.0, pk), _cell("none", 32, 10.0, pk), _cell("yarn", 32, 10.2, pk)]}  # fmt: skip
    text = "\n".join(reading(results, within=10))
    assert "Passkey `none`: 100 % within the window; nothing past the training window was measured." in text
    assert "does not break" not in text
    results["cells"].append(_cell("none", 64, 11.0, {"0": 1.0, "1": 0.5}))
    text = "\n".join(reading(results, within=10))
    assert "Passkey `none`: 100 % within the window; does not break up to L=64." in text
    assert "Passkey `yarn`: 100 % within the window; nothing past the training window was measured." in text


def test_the_reading_compares_in_the_precision_it_prints():
    from posenc.extend.report import reading

    results = {"train_len": 32, "settings": {"methods": ["none", "linear", "yarn"]},
               "cells": [_cell("none", 32, 17.5400001), _cell("linear", 32, 17.54), _cell("yarn", 32, 17.6)]}  # fmt: skip
    text = "\n".join(reading(results, within=10))
    assert "At L=32: `linear` 17.540 = `none` 17.540 < `yarn` 17.600." in text
    assert "17.540 < 17.540" not in text
    # a value equal, as printed, to the limit holds
    results["cells"] += [_cell("none", 64, 10.0), _cell("linear", 64, 19.2940004)]  # limit 17.5400001 * 1.1
    assert "`linear` 64" in "\n".join(reading(results, within=10))


def test_the_time_column_says_it_is_wall_time_on_a_shared_machine():
    from posenc.extend.report import tables

    results = {"train_len": 32, "settings": {"methods": ["none"], "stride": None, "passkey_trials": 1},
               "cells": [_cell("none", 32, 10.0, {"0": 1.0})]}  # fmt: skip
    title = tables(results)[1].title
    assert "wall time" in title and "shared machine" in title and "not a benchmark" in title


@pytest.mark.parametrize("sink", [None, {"sinks": 2, "window": 14}])
def test_one_window_is_scored_once(sink, monkeypatch):
    import posenc.extend.evaluate as ev

    model = ph.convert(llama())
    text = torch.randint(0, 256, (96,))
    calls = []
    scores = ev.token_scores
    monkeypatch.setattr(ev, "token_scores", lambda *a, **k: calls.append(1) or scores(*a, **k))
    one = ev.perplexity("hf", model, text, L, stride=8, windows=1, chunk=16, sink=sink)
    assert len(calls) == 1 and one["one_pass"] and one["ppl"] == one["ppl_windows"] and one["tokens"] == L - 1
    calls.clear()
    two = ev.perplexity("hf", model, text, L, stride=8, windows=2, chunk=16, sink=sink)
    assert len(calls) > 2 and not two["one_pass"]
    assert two["ppl_windows"] != two["ppl"]  # two protocols, two numbers


def test_a_stride_of_a_whole_window_is_scored_once(monkeypatch):
    """``--budget`` widens the stride up to the window: the sliding windows are then the
    non-overlapping ones (same tokens, same context), scored once; the plan counts them once."""
    import posenc.extend.evaluate as ev

    model = ph.convert(llama())
    text = torch.randint(0, 256, (96,))
    calls = []
    scores = ev.token_scores
    monkeypatch.setattr(ev, "token_scores", lambda *a, **k: calls.append(1) or scores(*a, **k))
    got = ev.perplexity("hf", model, text, L, stride=L, windows=2, chunk=16)
    assert len(calls) == 2 and got["one_pass"] and got["ppl"] == got["ppl_windows"]
    calls.clear()
    slid = ev.perplexity("hf", model, text, L, stride=L // 2, windows=2, chunk=16)
    assert len(calls) > 2 and not slid["one_pass"]


def test_one_window_shows_one_perplexity_column(ckpt, tmp_path):
    out = tmp_path / "one"
    assert run(ckpt, "--lengths", "1x", "--methods", "none", "--windows", "1", "--passkey-trials", "0",
               "--chunk", "16", "--out", out) == 0  # fmt: skip
    table = (out / "table.md").read_text()
    assert "one window, or a stride of a whole window: the two are the same computation, shown once" in table
    row = next(r for r in table.splitlines() if r.startswith("| `none`"))
    assert "(" not in row  # no bracketed second value equal to the first


def test_identity_settings_are_not_scored_again(ckpt, tmp_path, capsys):
    from posenc.extend.model import load_subject

    out = tmp_path / "same"
    assert run(ckpt, "--lengths", "16,1x", "--methods", "none,linear,yarn,ntk,dynamic,rerope", *FAST, "--out", out) == 0
    cells = {(c["method"], c["length"]): c for c in json.loads((out / "results.json").read_text())["cells"]}
    same = sorted(k for k, c in cells.items() if c.get("same_as_none"))
    assert same == sorted((m, n) for m in ("linear", "yarn", "ntk", "dynamic") for n in (16, L))
    assert all("ppl" not in cells[k] and "the same model as `none`" in cells[k]["why"] for k in same)
    assert cells[("rerope", L)]["ppl"] > 1  # (its window caps distances: not the identity, scored)
    assert "linear @ 32: not run (factor 1" in capsys.readouterr().err
    rows = [r for r in (out / "table.md").read_text().splitlines() if r.startswith("| `yarn`")]
    assert [r.count("= none") for r in rows] == [2, 2]  # both tables' cells
    # the skip is right: each such model gives none's logits, bit for bit
    subject, ids = load_subject(str(ckpt)), torch.randint(0, 256, (1, L))
    for m in ("linear", "yarn", "ntk", "dynamic"):
        model, opts, _ = subject.variant(m, L)
        assert torch.equal(model(ids).logits, subject.model(ids).logits), m
    # past the training length nothing is the identity but dynamic within it
    out2 = tmp_path / "past"
    assert run(ckpt, "--lengths", "1x,2x", "--methods", "none,linear,dynamic", *FAST, "--out", out2) == 0
    cells = json.loads((out2 / "results.json").read_text())["cells"]
    assert [(c["method"], c["length"]) for c in cells if c.get("same_as_none")] == [("dynamic", L)]
    model, _, _ = subject.variant("dynamic", 2 * L)
    assert torch.equal(model(ids).logits, subject.model(ids).logits)


def test_the_plan_and_its_estimate_come_before_any_scoring(ckpt, tmp_path, capsys, monkeypatch):
    import posenc.extend.evaluate as ev
    import posenc.extend.passkey as pkmod
    import posenc.extend.plan as planmod
    from posenc.extend.passkey import Tokens, min_length

    read = []
    scores = ev.token_scores

    def counted(kind, model, ids, **k):
        read.append(len(ids))
        return scores(kind, model, ids, **k)

    monkeypatch.setattr(ev, "token_scores", counted)
    monkeypatch.setattr(pkmod, "token_scores", counted)
    monkeypatch.setattr(planmod, "token_scores", scores)  # (the warm-up is not the run's reading)
    n = min_length(Tokens()) + 8  # the shortest passkey prompt with some filler
    out = tmp_path / "plan"
    assert run(ckpt, "--lengths", f"1x,{n}", "--methods", "none,linear,rerope,sink-window,longrope", "--windows", "2",
               "--passkey-trials", "1", "--chunk", "64", "--out", out) == 0  # fmt: skip
    err = [r for r in capsys.readouterr().err.splitlines() if " @ " in r or r.startswith("plan:")]
    first_work = next(i for i, r in enumerate(err) if not r.startswith("plan:"))
    assert all(r.startswith("plan:") for r in err[:first_work]) and first_work == 11  # 10 cells, then the total
    assert "plan: none @ 32: 2 window(s) of 32 tokens, 3 sliding (stride 16) + 2 non-overlapping; 0 passkey " \
           "prompts; 160 tokens read" in err  # fmt: skip
    assert f"plan: rerope @ {n}: 2 window(s) of {n} tokens" in "\n".join(err)
    assert "plan: longrope @ 32: not run (not applicable)" in err
    p = json.loads((out / "results.json").read_text())["plan"]
    assert p["tokens_read"] == sum(read)  # the count is what the run then read
    pk = {(c["method"], c["length"]): c["passkey_prompts"] for c in p["cells"] if c["runs"]}
    assert pk[("none", n)] == 5 and pk[("none", 32)] == 0  # 5 depths x 1 trial where a prompt fits
    assert p["warmup"]["tokens"] == 32 and p["warmup"]["seconds"] > 0 and p["estimate_s"] > 0
    assert "estimate" in err[first_work - 1] and f"{p['tokens_read']} tokens read in all" in err[first_work - 1]


def test_sliding_tokens_counts_the_loop():
    from posenc.extend.plan import sliding_tokens

    for span, length, stride in ((96, 32, 16), (128, 32, 7), (64, 64, 8), (96, 32, 32), (200, 50, 1), (384, 128, 100)):
        windows, tokens = 0, 0
        for begin in range(0, span - 1, stride):  # evaluate.perplexity's sliding loop
            end = min(begin + length, span)
            windows, tokens = windows + 1, tokens + end - begin
            if end == span:
                break
        assert sliding_tokens(span, length, stride) == (windows, tokens), (span, length, stride)


def test_every_method_line_gets_its_own_colour():
    """``extend``'s perplexity plot draws up to twenty methods in distinct colours (eleven run by
    default: matplotlib's ten-colour cycle drew the first and the eleventh alike)."""
    from matplotlib.colors import to_rgba

    from posenc.extend.report import method_colors

    for n in (1, 10, 11, 20):
        assert len({to_rgba(c) for c in method_colors(n)}) == n
