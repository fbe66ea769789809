"""Where a task model errs inside its answer (``posenc.studies.kazemnejad2023.answer_errors``
and ``posenc study answer-errors``): the four classes by hand, the counts of a model whose
every prediction is known, and the command on a tiny finished run and on bad input."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from posenc.cli import main
from posenc.compare.evaluate import EvalSettings, evaluate
from posenc.data import load_source
from posenc.data.kazemnejad import EOS, PAD, VOCAB, _rs
from posenc.studies import cli as study_cli
from posenc.studies.kazemnejad2023.answer_errors import answer_classes, answer_errors, exact_match_by_category

ID = {w: i for i, w in enumerate(VOCAB)}


def test_classes_by_hand():
    # "Copy : <1> <2> [SEP] <1> <2> </s>" then a pad; the answer is scored from [SEP] on
    words = ["Copy", ":", "<1>", "<2>", "[SEP]", "<1>", "<2>", "</s>"]
    seq = [ID[w] for w in words] + [PAD]
    tokens, targets = torch.tensor([seq[:-1]]), torch.tensor([seq[1:]])
    mask = torch.tensor([[False] * 4 + [True] * 3 + [False]])
    # predictions at the three answer positions: <2> (a prompt token, wrong), <7> (in neither), </s> (right)
    pred = torch.zeros_like(tokens)
    pred[0, 4], pred[0, 5], pred[0, 6] = ID["<2>"], ID["<7>"], EOS
    assert answer_classes(pred, tokens, targets, mask) == [["prompt", "other", "right"]]
    pred[0, 4], pred[0, 5] = ID["<1>"], EOS  # right, then an early </s>
    assert answer_classes(pred, tokens, targets, mask) == [["right", "stop", "right"]]
    pred[0, 5] = PAD  # the padding is not a prompt token
    assert answer_classes(pred, tokens, targets, mask)[0][1] == "other"
    assert answer_classes(pred, tokens, targets, torch.zeros_like(mask)) == [[]]


class _Always(torch.nn.Module):
    """A 'model' that predicts one token everywhere."""

    def __init__(self, token: int):
        super().__init__()
        self.token = token

    def forward(self, tokens, pos=None):
        out = torch.zeros(*tokens.shape, len(VOCAB))
        out[..., self.token] = 1.0
        return out


def test_counts_of_a_model_that_always_stops():
    src = load_source(task="kaz-copy")
    r = answer_errors(_Always(EOS), src, 5, samples=10, batch_size=4)  # three batches: 4 + 4 + 2
    assert r["samples"] == 10 and len(r["counts"]) == 6  # five symbols and the </s>
    assert all(c == {"right": 0, "stop": 10, "prompt": 0, "other": 0} for c in r["counts"][:5])
    assert r["counts"][5] == {"right": 10, "stop": 0, "prompt": 0, "other": 0}
    assert r["other_tokens"] == [{}] * 6
    r = answer_errors(_Always(ID["Copy"]), src, 5, samples=3)  # the prompt's first word, everywhere
    assert all(c["prompt"] == 3 for c in r["counts"])
    r = answer_errors(_Always(ID["[NEXT]"]), src, 5, samples=3)  # in no copy prompt: "other", and which
    assert all(c["other"] == 3 for c in r["counts"]) and r["other_tokens"] == [{ID["[NEXT]"]: 3}] * 6


def test_a_failed_model_is_refused_not_classified():
    class _NaN(_Always):
        def forward(self, tokens, pos=None):
            return super().forward(tokens) * float("nan")

    with pytest.raises(ValueError, match="NaN or infinite at n=5: a failed model"):
        answer_errors(_NaN(EOS), load_source(task="kaz-copy"), 5, samples=2)


@pytest.mark.parametrize("task,n", [("kaz-lego", 6), ("kaz-addition", 5), ("kaz-copy", 3)])
def test_eval_records_are_the_samples_evaluate_scores(task, n):
    # eval_batches draws through eval_records; the samples are those sample() draws from the same stream
    src = load_source(task=task)
    rs = _rs(task, "eval", src.seed, n)
    for got in src.eval_batches(n, 4, 10):
        want = src.sample(n, got.tokens.shape[0], rs)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.mask, want.mask)
    assert len(src.eval_records(n, 10)) == 10
    with pytest.raises(ValueError, match="size must be an int"):
        src.eval_records(0, 1)


class _Oracle(torch.nn.Module):
    """Right (the gold next token everywhere) on the samples ``right(record)`` picks, ``</s>``
    everywhere on the others: it looks each input row up among the records it was given."""

    def __init__(self, src, n, records, right, prompt_wrong=False):
        super().__init__()
        self.gold = {}
        for r in records:
            b = src.batch([r], src.seq_len(n))
            gold = b.targets[0] if right(r) else torch.full_like(b.targets[0], EOS)
            if prompt_wrong:  # wrong where nothing is scored (the prompt, the padding): it must not count
                gold = torch.where(b.mask[0], gold, (b.targets[0] + 1) % len(VOCAB))
            self.gold[tuple(b.tokens[0].tolist())] = gold

    def forward(self, tokens, pos=None):
        return torch.nn.functional.one_hot(
            torch.stack([self.gold[tuple(t)] for t in tokens.tolist()]), len(VOCAB)
        ).float()


def test_exact_match_by_category_of_a_model_right_on_one_category():
    src, n = load_source(task="kaz-lego"), 8
    records = src.eval_records(n, 40)
    last = _Oracle(src, n, records, lambda r: r["cat"][1] == n - 1)  # right only when the query is the chain's end
    r = exact_match_by_category(last, src, n, samples=40, batch_size=16)
    assert r["samples"] == 40 and list(r["categories"]) == [f"query: variable {q} of 8" for q in (5, 6, 7, 8)]
    for label, c in r["categories"].items():
        want = sum(rec["cat"][1] + 1 == int(label.split()[2]) for rec in records)
        assert c["samples"] == want > 0
        assert c["solved"] == (want if label.endswith("8 of 8") else 0)
    # addition: digit pairs in numeric order (10 after 9), every sample counted once
    src = load_source(task="kaz-addition")
    r = exact_match_by_category(_Always(EOS), src, 10, samples=64)
    pairs = [tuple(int(x) for x in label.removeprefix("digits: ").split(" + ")) for label in r["categories"]]
    assert pairs == sorted(pairs) and all(10 in p for p in pairs) and (9, 10) in pairs and (10, 9) in pairs
    assert sum(c["samples"] for c in r["categories"].values()) == 64
    assert all(c["solved"] == 0 for c in r["categories"].values())


def test_exact_match_by_category_adds_up_to_evaluate_accuracy():
    # the same samples and the same rule: the categories' solved counts sum to evaluate's
    # exact match, for a model right on some answers only (the queries at the chain's end)
    # and wrong on every prompt token
    src, n, samples = load_source(task="kaz-lego"), 8, 48
    oracle = _Oracle(src, n, src.eval_records(n, samples), lambda r: r["cat"][1] >= n - 2, prompt_wrong=True)
    oracle.encodings, oracle.heads = [], 1  # what evaluate reads of a model besides its forward
    settings = EvalSettings(batch_size=16, samples=samples)
    acc = evaluate(oracle, src, n, device=torch.device("cpu"), settings=settings).accuracy
    r = exact_match_by_category(oracle, src, n, samples=samples, batch_size=16)
    solved = sum(c["solved"] for c in r["categories"].values())
    assert 0 < solved < samples and acc == solved / samples


def test_command_on_a_finished_run_and_on_bad_input(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["compare", "--task", "kaz-copy", "--encodings", "nope,learned", "--seeds", "0", "--steps", "4",
            "--dim", "16", "--depth", "1", "--heads", "2", "--eval-samples", "8", "--eval-lens", "20",
            "--batch-size", "4", "--workers", "1", "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    capsys.readouterr()

    def script(*a):
        try:
            code = main(["study", "answer-errors", *map(str, a)])
        except SystemExit as e:  # argparse's refusals
            code = e.code
        got = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=got.out, stderr=got.err)

    def percent(cell):  # "<1%": a nonzero share that rounds to 0 %; ">99%": a partial one that rounds to 100 %
        v = cell.strip().rstrip("%")
        return {"<1": 0.5, ">99": 99.5}.get(v) or int(v)

    # a share is never rounded to 0 % when it is not 0, nor to 100 % when it is not 1
    assert [study_cli.share(x) for x in (0, 1 / 256, 0.005, 0.5, 0.994, 0.995, 255 / 256, 1)] == [
        "0%", "<1%", "<1%", "50%", "99%", ">99%", ">99%", "100%"]  # fmt: skip

    ok = script(out, "nope", 30, "--samples", 5)
    assert ok.returncode == 0, ok.stderr
    rows = [line for line in ok.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 31  # 30 symbols and the </s>
    for row in rows:  # each row's shares add up to 100 % (within rounding)
        cells = row.strip("|").split("|")
        shares = [percent(v) for v in cells[1:5]]
        assert 98 <= sum(shares) <= 102
        common = cells[5].strip()  # the most common "other" token and its share, or "-" when there is none
        assert (common == "-") == (shares[3] == 0), row
        if common != "-":
            word, share = common.rsplit(" ", 1)
            assert word.strip("`") in ID and 0 < percent(share.strip("()")) <= shares[3]
    cat = script(out, "nope", 30, "--samples", 5, "--by-category")  # copy's category is its size
    assert cat.returncode == 0, cat.stderr
    assert [line for line in cat.stdout.splitlines() if line.startswith("| 30 ")][0].startswith("| 30 | 5 | ")
    for bad, what in (((out, "rope", 30), "encoding 'rope' seed 0 is not in the run"),
                      ((out, "nope", 0), "n must be >= 1 for kaz-copy, got n=0"),
                      ((out, "nope", 5, "--samples", 0), "argument --samples: must be an integer in 1..2147483647"),
                      ((out, "nope", 5, "--seed", -1), "argument --seed: must be an integer in 0.."),
                      ((out, "learned", 41), "learned cannot run at n=41: "),
                      ((tmp_path / "nothing", "nope", 30), "cannot be read as a compare run's config")):  # fmt: skip
        p = script(*bad)
        assert p.returncode == 2 and what in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    # a run of another task; a model still in training; a checkpoint that is not one
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((out / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "task": "copy"}))
    ckpt = out / "checkpoints" / "nope.pt"
    saved = torch.load(ckpt, weights_only=True)
    torch.save({**saved, "done": False, "step": 2}, ckpt)
    bad_bytes = out / "checkpoints" / "learned.pt"
    bad_bytes.write_bytes(b"not a checkpoint")
    for bad, what in (((other, "nope", 5), "the run is of task 'copy'; this reads runs of --task kaz-*"),
                      ((out, "nope", 5), "is a model still in training (step 2)"),
                      ((out, "learned", 5), "cannot be read as a checkpoint")):  # fmt: skip
        p = script(*bad)
        assert p.returncode == 2 and what in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    # a finished model whose weights went NaN: refused, not classified
    torch.save({**saved, "model": {k: v * float("nan") for k, v in saved["model"].items()}}, ckpt)
    p = script(out, "nope", 5)
    assert p.returncode == 2 and "nope seed 0: the model's logits are NaN or infinite at n=5" in p.stderr, p.stderr
