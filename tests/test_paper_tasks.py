"""The papers' own tasks (issue 28 item 1): ``count`` (CoPE) and ``flip-flop`` (Liu et al. 2023).

Each generator is checked against a transcription of the original generator written here:
for ``count``, facebookresearch/RAM ``projects/cope/scripts/count_data_gen.py`` (the same
``random.Random`` stream gives the same programs, draw for draw); for ``flip-flop``, the
paper's definition (first instruction ``w``, last ``r``, the others i.i.d.), compared in
format and statistics. Answers are checked by interpreters independent of both.
"""

from __future__ import annotations

import json
import math
import random
import string

import pytest
import torch
from tests.test_compare import TINY, run_cli

from posenc.compare import preset_config
from posenc.data import TASK_NAMES, CountTask, FlipFlopTask, load_source
from posenc.data.paper_tasks import (
    COUNT_VOCAB,
    FLIPFLOP_VOCAB,
    MAX_VALUE,
    P_IGNORE_TESTS,
    count_program,
    flip_flop,
)


# ------------------------------------------------------------------ transcriptions
class _Fail(Exception):
    pass


def original_count_sample(rng: random.Random, nvars: int, max_steps: int) -> dict[str, str]:
    """count_data_gen.py's ``generate_sample``: ops SET 1, DUMMY 50, INCREMENT 7 (dict
    order), values capped at 10, a failed op redrawn (100 trials), a failed print redraws
    the whole sample (nsteps included)."""
    weights = {"SET": 1, "DUMMY": 50, "INCREMENT": 7}
    names = list(string.ascii_lowercase)[:nvars]

    def existing(state):
        if not state:
            raise _Fail
        var = rng.choice(list(state.keys()))
        return var, state[var]

    def op_text(op, state):
        if op == "SET":
            var = rng.choice(names)
            state[var] = 0
            return f"{var} = 0 ;"
        if op == "PRINT":
            var, val = existing(state)
            return f"print {var} {val} ;"
        if op == "DUMMY":
            return "pass;"
        var, val = existing(state)
        if val + 1 > 10:
            raise _Fail
        state[var] = val + 1
        return f"{var} ++;"

    def statement(state):
        for _ in range(100):
            try:
                return op_text(rng.choices(list(weights.keys()), weights.values(), k=1)[0], state)
            except _Fail:
                continue
        raise ValueError("too many failures")

    for _ in range(1000):
        try:
            nsteps = rng.randint(3, max_steps)
            state: dict[str, int] = {}
            context = " ".join(statement(state) for _ in range(nsteps))
            text = op_text("PRINT", state)
            return {"context": context, "question": " ".join(text.split()[:-2]), "answer": text.split()[-2]}
        except _Fail:
            continue
    raise ValueError("too many failures")


def paper_flip_flop(rng: random.Random, n: int, p_ignore: float) -> list[str]:
    """Liu et al.'s FFL(p): ``w`` first, ``r`` last, the rest i.i.d.; bits of w/i uniform."""
    p = (1 - p_ignore) / 2
    out, last = ["w", rng.choice("01")], None
    last = out[1]
    for _ in range(n - 2):
        ins = rng.choices("wri", [p, p, p_ignore])[0]
        bit = last if ins == "r" else rng.choice("01")
        last = bit if ins == "w" else last
        out += [ins, bit]
    return out + ["r", last]


def run_count(words: list[str]) -> tuple[str, int]:
    """An interpreter of a count program (words up to ``print v``): the printed variable
    and its value; checks every increment is of a set variable and stays <= 10."""
    state, i = {}, 0
    while words[i] != "print":
        if words[i] == "pass;":
            i += 1
        elif words[i + 1] == "=":
            assert words[i + 2 : i + 4] == ["0", ";"]
            state[words[i]] = 0
            i += 4
        else:
            assert words[i + 1] == "++;" and words[i] in state
            state[words[i]] += 1
            assert state[words[i]] <= MAX_VALUE
            i += 2
    return words[i + 1], state[words[i + 1]]


# ------------------------------------------------------------------ count
def test_count_program_equals_the_original_draw_for_draw():
    task = CountTask()
    a, b = random.Random(5), random.Random(5)
    for _ in range(200):
        mine = task.draw(a, None, 40)
        theirs = original_count_sample(b, 3, 40)
        assert mine == (theirs["context"] + " " + theirs["question"] + " " + theirs["answer"]).split()


def _shares(statements: list[str]) -> dict[str, float]:
    kinds = ["pass" if s == "pass;" else "set" if "=" in s else "increment" for s in statements]
    return {k: kinds.count(k) / len(kinds) for k in ("set", "pass", "increment")}


def test_count_statistics_value_cap_and_answers():
    rng, ref = random.Random(0), random.Random(1)
    mine, theirs = [], []
    for _ in range(300):
        statements, v, value = count_program(rng, 200, 3) or ([], None, None)
        mine += statements
        if v is not None:
            assert run_count(" ".join(statements).split() + ["print", v]) == (v, value)
        s = original_count_sample(ref, 3, 200)
        theirs += s["context"].replace("pass;", "pass; |").replace("++;", "++; |").replace(" ;", " ; |").split(" |")
    theirs = [t.strip() for t in theirs if t.strip()]
    a, b = _shares(mine), _shares(theirs)
    for k in a:  # another seed of the original: the same shares within sampling error
        sd = math.sqrt(a[k] * (1 - a[k]) * (1 / len(mine) + 1 / len(theirs)))
        assert abs(a[k] - b[k]) < 5 * sd + 1e-4, (k, a[k], b[k])
    # set and pass are never redrawn, so they keep the drawn ratio 1 : 50 (increments are
    # redrawn with no variable set or at the cap, so theirs falls below 7/58)
    p = a["pass"] / (a["pass"] + a["set"])
    n = round(len(mine) * (a["pass"] + a["set"]))
    assert abs(p - 50 / 51) < 5 * math.sqrt(p * (1 - p) / n)
    assert 0.05 < a["increment"] < 7 / 58
    # answers: answer token ids are values 0..10
    task = CountTask()
    b = task.train_batch(3, 64, 50)
    answers = [COUNT_VOCAB[int(t)] for t in b.targets[b.mask]]
    assert len(answers) == 64 and all(a.isdigit() and 0 <= int(a) <= MAX_VALUE for a in answers)


def test_count_batches_answer_only_and_lengths():
    task = load_source(task="count", seed=1)
    assert isinstance(task, CountTask) and "count" in TASK_NAMES
    b = task.train_batch(0, 16, 20)
    assert b.tokens.shape == b.targets.shape == b.mask.shape and b.mask.sum(1).tolist() == [1] * 16
    assert torch.equal(task.train_batch(0, 16, 20).tokens, b.tokens)  # a function of (seed, step)
    for row in range(16):
        words = [COUNT_VOCAB[int(t)] for t in b.tokens[row]]
        k = int(b.mask[row].nonzero())  # the answer target follows "print v"
        assert words[k - 1] == "print" or words[k - 1] in string.ascii_lowercase
        assert run_count(words[: k + 1])[1] == int(COUNT_VOCAB[int(b.targets[row, k])])
        n_statements = sum(w in ("pass;", "++;", "=") for w in words[: k - 1])
        assert 3 <= n_statements <= 20
        assert all(t == 0 for t in b.targets[row, k + 1 :])  # padding only after the answer
    e = list(task.eval_batches(12, 5, 7))
    assert [x.tokens.shape for x in e] == [(5, task.seq_len(12)), (2, task.seq_len(12))]
    for x in e:
        for row in range(len(x.tokens)):
            k = int(x.mask[row].nonzero())
            words = [COUNT_VOCAB[int(t)] for t in x.tokens[row, : k + 1]]
            assert sum(w in ("pass;", "++;", "=") for w in words) == 12  # exactly n statements
    with pytest.raises(ValueError, match="must be >= 3"):
        task.train_batch(0, 2, 2)
    with pytest.raises(ValueError, match="positive int"):
        next(task.eval_batches(0, 2, 2))


# ------------------------------------------------------------------ flip-flop
def test_flip_flop_format_and_statistics_match_the_paper():
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for p in P_IGNORE_TESTS:
        mine = flip_flop(64, 400, p, g)
        theirs = [paper_flip_flop(rng, 64, p) for _ in range(400)]
        assert mine.shape == (400, 128)
        ins = mine[:, 0::2]
        assert (ins[:, 0] == 0).all() and (ins[:, -1] == 1).all()  # w first, r last
        assert ((mine[:, 1::2] == 3) | (mine[:, 1::2] == 4)).all() and (ins <= 2).all()
        mid = ins[:, 1:-1].flatten()
        ref = [s[i] for s in theirs for i in range(2, 126, 2)]
        sd = math.sqrt(p * (1 - p) / len(mid)) * 5 + 1e-3
        for k, name in enumerate("wri"):
            want = {"w": (1 - p) / 2, "r": (1 - p) / 2, "i": p}[name]
            assert abs(float((mid == k).float().mean()) - want) < sd
            assert abs(ref.count(name) / len(ref) - want) < sd
        # the bits of writes and ignores are uniform
        free = mine[:, 1::2][ins != 1]
        assert abs(float((free == 4).float().mean()) - 0.5) < 0.02


def test_flip_flop_answers_by_an_independent_interpreter():
    task = load_source(task="flip-flop")
    assert isinstance(task, FlipFlopTask) and task.depths == (0.8, 0.98, 0.1)
    b = task.train_batch(0, 32, 24)
    assert b.tokens.shape == (32, task.seq_len(24))
    for row in range(32):
        chars = [FLIPFLOP_VOCAB[int(t)] for t in torch.cat([b.tokens[row], b.targets[row, -1:]])]
        register, want = None, []
        for ins, bit in zip(chars[0::2], chars[1::2]):
            if ins == "w":
                register = bit
            elif ins == "r":
                want.append(register)
        got = [FLIPFLOP_VOCAB[int(t)] for t in b.targets[row][b.mask[row]]]
        assert got == want and len(want) >= 1  # answer-only: the bit after every read
    for p in task.depths:  # the three test densities, fixed and seeded
        x = next(task.eval_batches(24, 8, 8, p))
        assert torch.equal(x.tokens, next(task.eval_batches(24, 8, 8, p)).tokens)
    with pytest.raises(ValueError, match="int >= 2"):
        task.train_batch(0, 2, 1)


# ------------------------------------------------------------------ presets and end to end
def test_presets_of_the_paper_tasks():
    c = preset_config("quick", task="count")
    f = preset_config("quick", task="flip-flop")
    assert c.train_len == 16 and c.eval_lens == [8, 16, 32, 64] and (c.steps, c.lr) == (6000, 3e-3)
    assert f.train_len == 16 and f.eval_lens == [16, 32, 64] and (f.steps, f.lr) == (6000, 3e-3)
    # what the papers compare: CoPE, absolute and relative positions (count: NoPE too)
    assert c.encodings == ["nope", "learned", "rope", "alibi", "t5", "cope"]
    assert f.encodings == ["learned", "rope", "alibi", "t5", "cope"]
    assert preset_config("quick", task="kaz-sort").encodings == ["nope", "t5", "alibi", "rope", "learned"]
    # Kazemnejad et al.'s splits: copy and reverse "tr20_ts40", the arithmetic tasks "tr8_ts16"
    for task in ("kaz-copy", "kaz-copy-2x", "kaz-reverse", "kaz-reverse-2x"):
        k = preset_config("quick", task=task)
        assert (k.train_len, k.eval_lens) == (20, [10, 20, 30, 40]), task
    for task in ("kaz-addition", "kaz-poly", "kaz-sort", "kaz-sort-multi", "kaz-sum", "kaz-parity", "kaz-lego"):
        k = preset_config("quick", task=task)
        assert (k.train_len, k.eval_lens) == (8, [4, 8, 12, 16]), task
    assert preset_config("quick", task="count", encodings=["rope"]).encodings == ["rope"]  # the user's list wins
    assert preset_config("quick", task="copy").train_len == 16  # the synthetic entry still applies


@pytest.mark.parametrize("task", ["count", "flip-flop"])
def test_compare_runs_the_paper_task(tmp_path, task):
    argv = [*TINY[: TINY.index("--train-len")], "--batch-size", "4", "--warmup", "2", "--eval-samples", "6",
            "--no-progress", "--task", task, "--train-len", "6", "--eval-lens", "6,8", "--steps", "2",
            "--encodings", "rope,alibi", "--out", str(tmp_path)]  # fmt: skip
    assert run_cli(*argv) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["config"]["task"] == task
    for r in res["runs"]:
        assert [e["length"] for e in r["eval"]] == [6, 8]
        for e in r["eval"]:
            assert 0 <= e["accuracy"] <= 1
            if task == "flip-flop":
                assert [d["depth"] for d in e["depths"]] == list(P_IGNORE_TESTS)
                assert e["accuracy"] == pytest.approx(sum(d["accuracy"] for d in e["depths"]) / 3)
            else:
                assert e["tokens"] == 6  # one scored answer per program
