"""``posenc extend --tasks`` (RULER's tasks, generated here) and ``--lm-eval`` (lm-eval's HF backend
on the live extended model), on a tiny checkpoint with a tokenizer made here (issue 65)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("wonderwords")

from tests.test_extend import llama, run  # noqa: E402

from posenc.extend.ruler.niah import NEEDLE, NOISE, TEMPLATE  # noqa: E402
from posenc.extend.ruler.score import greedy  # noqa: E402

FAST = ("--windows", "1", "--passkey-trials", "0", "--chunk", "64")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama (trained length 32, random weights) with a BPE tokenizer that has an end token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from posenc.extend.ruler.aggregate import FWE_TEMPLATE

    t = Tokenizer(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=380, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["</s>"])  # fmt: skip
    t.train_from_iterator([NOISE * 5, TEMPLATE, NEEDLE, FWE_TEMPLATE], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>")
    path = tmp_path_factory.mktemp("tasks") / "tiny"
    llama(vocab_size=384).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_greedy_equals_hf_generate(model_dir):
    """The chunked-prefill greedy loop gives HF's own greedy ``generate`` tokens (stock model)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.randint(0, 380, (50,), generator=torch.Generator().manual_seed(0))
    ref = m.generate(ids[None], max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)[0, 50:]
    assert greedy("hf", m, ids, 12, chunk=16) == ref.tolist()
    stop = ref.tolist()[5]
    assert greedy("hf", m, ids, 12, chunk=16, eos=stop) == ref.tolist()[: ref.tolist().index(stop)]


def test_tasks_cells_table_and_reading(model_dir, tmp_path, capsys):
    out = tmp_path / "r"
    rc = run(model_dir, "--lengths", "300", "--methods", "none,yarn,sink-window", "--tasks",
             "ruler_fwe,niah_multikey_3", "--task-samples", "1", "--out", out, *FAST)  # fmt: skip
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["tasks"] == ["ruler_fwe", "niah_multikey_3"] and res["settings"]["task_samples"] == 1
    cells = {(c["method"], c["length"]): c for c in res["cells"]}
    for m in ("none", "yarn"):
        r = cells[(m, 300)]["ruler"]
        assert r["ruler_fwe"]["samples"] == 1 and r["ruler_fwe"]["score"] in (0.0, 100 / 3, 200 / 3, 100.0)
        assert r["niah_multikey_3"]["score"] is None and "leaves no room" in r["niah_multikey_3"]["why"]
    assert "sink-window" in cells[("sink-window", 300)]["tasks_why"]
    table = (out / "table.md").read_text()
    assert "RULER tasks" in table and "`ruler_fwe`" in table and "`average`" in table
    assert "| `sink-window` | `ruler_fwe` | n/a |" in table
    report = (out / "report.md").read_text()
    assert "RULER: no method is above 85.6" in report or "RULER effective length" in report
    assert "RULER average at L=300" in report
    assert "ruler average" in (out / "results.csv").read_text()


@pytest.mark.slow
def test_tasks_at_two_lengths(model_dir, tmp_path):
    out = tmp_path / "r"
    tasks = "niah_single_1,niah_multikey_2,niah_multivalue_noise,niah_multiquery_noise,ruler_cwe,ruler_fwe"
    assert run(model_dir, "--lengths", "500,800", "--methods", "none", "--tasks", tasks, "--task-samples", "1",
               "--out", out, *FAST) == 0  # fmt: skip
    res = json.loads((out / "results.json").read_text())
    for c in res["cells"]:
        assert set(c["ruler"]) == set(tasks.split(","))
        assert all(v["score"] is None or 0 <= v["score"] <= 100 for v in c["ruler"].values())


def test_bad_task_is_one_line(model_dir, tmp_path, capsys):
    assert run(model_dir, "--lengths", "256", "--tasks", "niah_single_2", "--out", tmp_path / "o", *FAST) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'niah_single_2'" in err[0] and "allowed: niah_single_1" in err[0]
    assert not (tmp_path / "o").exists()


TASK_YAML = """task: posenc_echo
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
process_results: !function utils.process
generation_kwargs:
  until: []
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
UTILS = "def process(doc, results):\n    return {'acc': float(results[0] == doc['answer'])}\n"


def _echo_task(folder, tok, model, length: int):
    """A local task (no download): doc 1's answer is the model's own greedy continuation of a prompt
    that fills ``length - 6`` tokens (lm-eval truncating anything would change it), doc 2's is wrong."""
    folder.mkdir()
    text = (NOISE + " ") * 40
    ids = tok(text).input_ids[: length - 6]
    prompt = tok.decode(ids)
    ids = tok(prompt).input_ids
    assert len(ids) <= length - 6
    cont = tok.decode(greedy("hf", model, torch.tensor(ids), 6, chunk=64, eos=tok.eos_token_id))
    docs = [{"question": prompt, "answer": cont}, {"question": prompt, "answer": cont + "x"}]
    (folder / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "echo.yaml").write_text(TASK_YAML.format(data=folder / "data.jsonl"))
    (folder / "utils.py").write_text(UTILS)


@pytest.mark.slow
def test_lm_eval_python_call_runs_the_live_model_untruncated(model_dir, tmp_path):
    pytest.importorskip("lm_eval")
    from transformers import AutoTokenizer

    from posenc.extend.lmeval import lm_eval_scores
    from posenc.extend.model import load_subject

    sub = load_subject(str(model_dir))
    model, _, _ = sub.variant("yarn", 200)
    tok = AutoTokenizer.from_pretrained(model_dir)
    _echo_task(tmp_path / "task", tok, model, 200)
    scores = lm_eval_scores(model, tok, ["posenc_echo"], 200, include=str(tmp_path / "task"))
    assert scores["posenc_echo"]["acc,none"] == 0.5


@pytest.mark.slow
def test_lm_eval_flag_adds_scores_to_every_output(model_dir, tmp_path):
    pytest.importorskip("lm_eval")
    from transformers import AutoTokenizer

    from posenc.extend.model import load_subject

    sub = load_subject(str(model_dir))
    tok = AutoTokenizer.from_pretrained(model_dir)
    _echo_task(tmp_path / "task", tok, sub.model, 64)  # `none` at L=64
    out = tmp_path / "o"
    assert run(model_dir, "--lengths", "64", "--methods", "none,yarn", "--lm-eval", "posenc_echo",
               "--lm-eval-include", tmp_path / "task", "--out", out, *FAST) == 0  # fmt: skip
    res = json.loads((out / "results.json").read_text())
    cells = {c["method"]: c for c in res["cells"]}
    assert cells["none"]["lm_eval"]["posenc_echo"]["acc,none"] == 0.5
    assert 0 <= cells["yarn"]["lm_eval"]["posenc_echo"]["acc,none"] <= 1
    assert "lm-eval (HF backend" in (out / "table.md").read_text()
    assert "lm-eval `posenc_echo` (acc,none) at L=64" in (out / "report.md").read_text()


def test_lm_eval_missing_is_one_line_before_the_model_loads(model_dir, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # an import of it now raises ImportError
    monkeypatch.setattr("posenc.extend.model.load_subject", lambda *a, **k: pytest.fail("the model loaded"))
    assert run(model_dir, "--lengths", "64", "--lm-eval", "anything", "--out", tmp_path / "o", *FAST) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--lm-eval: lm-eval is not installed" in err[0] and "posenc[lmeval]" in err[0]


@pytest.mark.slow
def test_an_unknown_lm_eval_task_is_one_line_before_the_model_loads(model_dir, tmp_path, capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setattr("posenc.extend.model.load_subject", lambda *a, **k: pytest.fail("the model loaded"))
    assert run(model_dir, "--lengths", "64", "--lm-eval", "ruler_vt,nosuch_task", "--out", tmp_path / "o", *FAST) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--lm-eval: 'nosuch_task' is not a task lm-eval knows" in err[0]


@pytest.mark.slow
def test_lm_eval_ruler_task_reports_the_evaluated_length_only(model_dir):
    """lm-eval's own RULER generator, given the evaluated length and the model folder's tokenizer."""
    pytest.importorskip("lm_eval")
    from posenc.extend.lmeval import lm_eval_scores
    from posenc.extend.model import load_subject

    sub = load_subject(str(model_dir))
    scores = lm_eval_scores(sub.model, sub.tokenizer, ["ruler_fwe"], 1000, limit=1)["ruler_fwe"]
    assert 0 <= scores["1000,none"] <= 1 and "4096,none" not in scores


def test_the_estimate_counts_a_ruler_sample_as_its_prefill_and_decode_steps():
    """A sample of ``p`` prompt tokens and budget ``g``: the prefill ``a·p + m·b·p²/2`` and ``g - 1``
    decode steps (the first answer token comes from the prefill), each the timed step plus ``m·b``
    per token of context ``p + i`` (``m`` score maps: ReRoPE 2)."""
    from posenc.extend.plan import estimate

    a, b, step = 1e-3, 1e-6, 5e-3
    warm = {"tokens": 100, "seconds": 100 * a, "step_seconds": step}  # one point: b = 0 ...
    cells = [{"method": "rerope", "length": 1000, "runs": True, "tokens_read": 1000, "maps": 2,
              "tasks": [[900, 50, 3], [700, 128, 2]]}]  # fmt: skip
    got = estimate({"cells": cells, "tokens_read": 1000}, warm)["cells"][0]
    want = 3 * (a * 900 + 49 * step) + 2 * (a * 700 + 127 * step)
    assert got["tasks_estimate_s"] == pytest.approx(want) and got["estimate_s"] == pytest.approx(a * 1000 + want)
    warm = {
        "tokens": 100,
        "seconds": 100 * a + b * 100**2 / 2,
        "long_tokens": 400,
        "long_seconds": 400 * a + b * 400**2 / 2,
        "step_seconds": step,
    }  # ... two points: b as given
    got = estimate({"cells": cells, "tokens_read": 1000}, warm)["cells"][0]

    def sample(p, g):
        return a * p + 2 * b * p * p / 2 + sum(step + 2 * b * (p + i) for i in range(1, g))

    assert got["tasks_estimate_s"] == pytest.approx(3 * sample(900, 50) + 2 * sample(700, 128))


@pytest.fixture
def fixed_rates(monkeypatch):
    """The warm-ups at fixed rates (1 ms a token, 20 ms a decode step), so the estimate is exact."""
    import posenc.extend.plan as planmod

    monkeypatch.setattr(planmod, "warm_up", lambda subject, text, chunk: {"tokens": 1000, "seconds": 1.0})
    monkeypatch.setattr(planmod, "decode_warm_up", lambda subject, text, chunk: {"step_seconds": 0.02})
    return 1e-3, 0.02


@pytest.mark.slow
def test_the_plan_counts_the_prompts_and_budgets_the_run_generates(model_dir, tmp_path, capsys, fixed_rates,
                                                                    monkeypatch):  # fmt: skip
    import posenc.extend.ruler.score as score

    calls, real = [], score.greedy

    def counted(kind, model, ids, max_new, **k):
        calls.append((len(ids), max_new))
        return real(kind, model, ids, max_new, **k)

    monkeypatch.setattr(score, "greedy", counted)
    out = tmp_path / "r"
    assert run(model_dir, "--lengths", "300,500", "--methods", "rerope,sink-window", "--tasks",
               "ruler_fwe,niah_multikey_3", "--task-samples", "1", "--out", out, *FAST) == 0  # fmt: skip
    res, err = json.loads((out / "results.json").read_text()), capsys.readouterr().err
    plan = {(c["method"], c["length"]): c for c in res["plan"]["cells"]}
    assert plan[("sink-window", 300)]["tasks"] == []  # (not generated under its cache policy)
    # niah_multikey_3 does not fit 300 (named in the plan) and fits 500; fwe fits both
    assert "plan: niah_multikey_3 @ 300: not run (length 300 leaves no room" in err
    assert [len(plan[("rerope", n)]["tasks"]) for n in (300, 500)] == [1, 2]
    planned = [(p, g) for n in (300, 500) for p, g, k in plan[("rerope", n)]["tasks"]]
    assert sorted(calls) == sorted(planned)  # the run's prompts and budgets, one sample each
    assert res["plan"]["task_tokens"] == sum(p + g for p, g in calls)
    assert "RULER samples" in err and "RULER tokens (prompts and generation budgets; decode step 20.00 ms" in err
    a, step = fixed_rates  # (one warm-up point: no cost of context, so ReRoPE's second map costs nothing)
    c = plan[("rerope", 500)]
    assert c["tasks_estimate_s"] == pytest.approx(sum(a * p + (g - 1) * step for p, g, _ in c["tasks"]))
    assert c["estimate_s"] == pytest.approx(a * c["tokens_read"] + c["tasks_estimate_s"])


@pytest.mark.slow
def test_a_budget_cuts_ruler_samples_after_passkey_trials(model_dir, tmp_path, capsys, fixed_rates):
    """At fixed rates: a budget between the estimates of 2 and 3 samples per task keeps 2, says so in
    the plan, the table's title and results.json, and the run generates 2 per task and length."""
    from posenc.extend.model import load_subject
    from posenc.extend.plan import estimate, plan, task_prompts

    sub = load_subject(str(model_dir))
    s = {"methods": ["yarn"], "lengths": [500], "tasks": ["ruler_fwe", "niah_multikey_3"], "windows": 1,
         "stride": None, "passkey_trials": 0, "chunk": 64}  # fmt: skip
    ruler, _ = task_prompts(sub, s)
    warm = {"tokens": 1000, "seconds": 1.0, "step_seconds": 0.02}
    cost = [estimate(plan(sub, {**s, "task_samples": k}, 10**6, None, set(), ruler), warm)["estimate_s"]
            for k in (2, 3)]  # fmt: skip
    budget = f"{(cost[0] + cost[1]) / 2:.3f}s"
    out = tmp_path / "r"
    assert run(model_dir, "--lengths", "500", "--methods", "yarn", "--tasks", "ruler_fwe,niah_multikey_3",
               "--task-samples", "5", "--budget", budget, "--out", out, *FAST) == 0  # fmt: skip
    res, err = json.loads((out / "results.json").read_text()), capsys.readouterr().err
    assert res["budget"]["chosen"]["task_samples"] == 2 and res["settings"]["task_samples"] == 2
    assert res["budget"]["cuts"] == ["RULER samples 5 -> 2 per task and length"]
    assert f"budget: RULER samples 5 -> 2 per task and length to fit --budget {budget}" in err
    assert "RULER samples 5 -> 2 per task and length" in (out / "table.md").read_text()
    assert {c["ruler"][t]["samples"] for c in res["cells"] for t in ("ruler_fwe", "niah_multikey_3")} == {2}


def test_a_budget_too_short_for_one_ruler_sample_is_refused(model_dir, tmp_path, capsys, fixed_rates):
    out = tmp_path / "r"
    assert run(model_dir, "--lengths", "500", "--methods", "none", "--tasks", "ruler_fwe", "--budget", "0.1s",
               "--out", out, *FAST) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("posenc extend: error: --budget 0.1s: even the least (1 passkey trial per depth, "
                              "1 RULER sample per task, 1 window per length")  # fmt: skip
    assert not out.exists()
