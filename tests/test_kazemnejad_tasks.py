"""Kazemnejad et al. 2023's suite (issue 28 item 1): ``posenc.data.kazemnejad`` against
transcriptions of the original code (github.com/McGill-NLP/length-generalization).

The builders (``scripts/dataset_builders/make_*_dataset.py``) are transcribed below with
``np.random.`` replaced by an explicit ``RandomState`` ``rs`` (the same calls in the same
order); the processors (``src/data/data_instance_processor/*``, classic setting, no
scratchpad) and the decoder-only join (``s2s_dl_factory.py``: ``prompt + sep + target``,
the separators of ``configs/data/s2s_*.jsonnet``) likewise. Given the same stream, posenc
must draw the same records and write the same strings. Answers are checked by interpreters
written here from the task definitions.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tests.test_compare import TINY, run_cli

from posenc.compare import preset_config
from posenc.data import KAZEMNEJAD_TASKS, TASK_NAMES, KazemnejadTask, load_source
from posenc.data.kazemnejad import SYMBOLS, VOCAB, draw, texts, tokenize
from posenc.data.lengths import sequence_length

UNIQUE = list(SYMBOLS)  # stands in for get_unique_tokens() (T5's one-token strings)


# ------------------------------------------------------------------ transcriptions
def number_to_string(number):  # data_instance_processor.py
    if number < 0:
        return "- " + number_to_string(-number)
    else:
        return " ".join(str(number))


def gen_copy_multi_char(rs, seq_length, num_examples, twice=False):  # make_copy_dataset.py
    samples = []
    unique_tokens = UNIQUE[:100]
    for _ in range(num_examples):
        token_ids = rs.randint(0, len(unique_tokens), seq_length)
        tokens = [unique_tokens[i] for i in token_ids]
        tgt = " ".join(tokens) + " [NEXT] " + " ".join(tokens) if twice else " ".join(tokens)
        samples.append({"repeat": seq_length, "src_seq": " ".join(tokens), "tgt_seq": tgt, "cat": seq_length})
    return samples


def gen_reverse_multi_char(rs, seq_length, num_examples, twice=False):  # make_reverse_dataset.py
    samples = []
    unique_tokens = UNIQUE[:100]
    for _ in range(num_examples):
        token_ids = rs.randint(0, len(unique_tokens), seq_length)
        tokens = [unique_tokens[i] for i in token_ids]
        reverse_tokens = tokens[::-1]
        tgt = " ".join(reverse_tokens) + " [NEXT] " + " ".join(reverse_tokens) if twice else " ".join(reverse_tokens)
        samples.append({"repeat": seq_length, "src_seq": " ".join(tokens), "tgt_seq": tgt, "cat": seq_length})
    return samples


def gen_addition_bin(rs, a_num_digits, b_num_digits, num_examples):  # make_addition_dataset.py
    samples = []
    for _ in range(num_examples):
        low = 10 ** (a_num_digits - 1)
        if low == 1:
            low = 0
        a = rs.randint(low, 10 ** (a_num_digits))
        low = 10 ** (b_num_digits - 1)
        if low == 1:
            low = 0
        b = rs.randint(low, 10 ** (b_num_digits))
        samples.append({"a": a, "b": b, "sum": a + b, "cat": f"{a_num_digits}-by-{b_num_digits}"})
    return samples


def gen_poly(rs, num_terms, num_examples):  # make_poly_dataset.py (modular=False)
    samples = []
    for _ in range(num_examples):
        coeffs = rs.randint(-3, 4, (num_terms,)).tolist()
        degrees = rs.randint(0, 4, (num_terms,)).tolist()
        x = rs.randint(-2, 3)
        ans = sum([coeffs[i] * x ** degrees[i] for i in range(num_terms)])
        samples.append({"coeffs": coeffs, "degrees": degrees, "x": x, "answer": ans, "cat": num_terms})
    return samples


def gen_sort_single_digit(rs, seq_length, num_examples):  # make_sort_dataset.py
    unique_tokens = UNIQUE[:50]
    samples = []
    for _ in range(num_examples):
        token_ids = rs.randint(0, len(unique_tokens), seq_length)
        unsorted_tokens = [unique_tokens[i] for i in token_ids]
        sorted_tokens = [unique_tokens[i] for i in np.sort(token_ids)]
        samples.append({"token_ids": token_ids.tolist(), "src_seq": unsorted_tokens, "tgt_seq": sorted_tokens,
                        "cat": seq_length})  # fmt: skip
    return samples


def gen_sort_multi_digit(rs, seq_length, num_examples):  # make_sort_dataset.py
    samples = []
    for _ in range(num_examples):
        nums = rs.randint(10, 10000, seq_length)
        samples.append({"src_seq": nums.tolist(), "tgt_seq": np.sort(nums).tolist(), "cat": seq_length})
    return samples


def gen_sum(rs, seq_length, num_examples):  # make_sum_dataset.py (modular=False)
    samples = []
    for _ in range(num_examples):
        values = rs.randint(1, 10, (seq_length,)).tolist()
        samples.append({"values": values, "answer": sum(values), "cat": (seq_length)})
    return samples


def gen_parity(rs, seq_length, num_examples):  # make_parity_dataset.py
    samples = []
    for _ in range(num_examples):
        values = rs.randint(0, 2, (seq_length,)).tolist()
        samples.append({"values": values, "answer": sum(values) % 2, "cat": (seq_length)})
    return samples


ALL_VARS = list("abcdefghijklmnopqrstuvwxyz")


def gen_lego(rs, num_variables, num_examples):  # make_lego_dataset.py (permute_clauses=False)
    NICE_VALUES = ["-1", "+1"]
    samples = []
    for _ in range(num_examples):
        values = rs.randint(0, 2, (num_variables,)).tolist()
        var_indices = rs.permutation(len(ALL_VARS)).tolist()
        vars = [ALL_VARS[i] for i in var_indices]
        clauses = [f"{vars[0]} = {NICE_VALUES[values[0]]}"]
        for i in range(1, num_variables):
            modifier = "+" if values[i] == values[i - 1] else "-"
            clauses.append(f"{vars[i]} = {modifier} {vars[i - 1]}")
        truth_values = [(vars[i], str(values[i])) for i in range(num_variables)]
        min_var_idx = num_variables // 2 if num_variables % 2 == 0 else num_variables // 2 + 1
        for query_idx in range(min_var_idx, num_variables):
            samples.append({"clauses": clauses, "truth_values": truth_values, "query": vars[query_idx],
                            "cat": (num_variables, query_idx)})  # fmt: skip
    return samples


# the processors' (prompt, target) and the configs' separators
def text_copy(ex):
    return f"Copy: {ex['src_seq']} ", "[SEP] ", f"{ex['tgt_seq']}"


def text_reverse(ex):
    return f"Reverse: {ex['src_seq']} ", "[SEP] ", f"{ex['tgt_seq']}"


def text_addition(ex):
    prompt = f"Compute {number_to_string(ex['a'])} + {number_to_string(ex['b'])} ? "
    return prompt, "", f"The answer is {number_to_string(ex['sum'])}."


def text_poly(ex, modulo_factor=10):
    term_strs = [f"{number_to_string(c)} * x ** {number_to_string(d)}" for c, d in zip(ex["coeffs"], ex["degrees"])]
    prompt = f"Evaluate at x = {number_to_string(ex['x'])} in {' + '.join(term_strs)} ? "
    return prompt, "", f"The answer is {number_to_string(ex['answer'] % modulo_factor)}."


def text_sort(ex):
    return (f"Sort the following list [ {', '.join(ex['src_seq'])} ]. ", "",
            f"The sorted list is [ {', '.join(ex['tgt_seq'])} ].")  # fmt: skip


def text_sort_multi(ex):
    src = ", ".join([number_to_string(n) for n in ex["src_seq"]])
    tgt = ", ".join([number_to_string(n) for n in ex["tgt_seq"]])
    return f"Sort the following list [ {src} ]. ", "", f"The sorted list is [ {tgt} ]."


def text_sum(ex, modulo_factor=10):
    values_seq_str = " + ".join([str(v) for v in ex["values"]])
    return f"Compute: {values_seq_str} .", "[SEP] ", f"The answer is {number_to_string(ex['answer'] % modulo_factor)} ."


def text_parity(ex):
    nice = {"0": "Yes", "1": "No"}
    values_str = ", ".join([str(v) for v in ex["values"]])
    return (f"Is the number of 1's even in the sequence [ {values_str} ] ? ", "",
            f"The answer is {nice[str(ex['answer'])]}.")  # fmt: skip


def text_lego(ex):
    nice = {"0": "-1", "1": "+1"}
    prompt = f"If {', '.join(ex['clauses'])}. Then, what is the value of {ex['query']}? "
    return prompt, "", f"The answer is {dict((v, nice[i]) for v, i in ex['truth_values'])[ex['query']]}."


ORIGINAL = {
    "kaz-copy": (lambda rs, n, k: gen_copy_multi_char(rs, n, k), text_copy),
    "kaz-copy-2x": (lambda rs, n, k: gen_copy_multi_char(rs, n, k, twice=True), text_copy),
    "kaz-reverse": (lambda rs, n, k: gen_reverse_multi_char(rs, n, k), text_reverse),
    "kaz-reverse-2x": (lambda rs, n, k: gen_reverse_multi_char(rs, n, k, twice=True), text_reverse),
    "kaz-poly": (gen_poly, text_poly),
    "kaz-sort": (gen_sort_single_digit, text_sort),
    "kaz-sort-multi": (gen_sort_multi_digit, text_sort_multi),
    "kaz-sum": (gen_sum, text_sum),
    "kaz-parity": (gen_parity, text_parity),
}


# ------------------------------------------------------------------ draws and texts
@pytest.mark.parametrize("name", sorted(ORIGINAL))
@pytest.mark.parametrize("n", [1, 7, 23])
def test_records_and_texts_equal_the_original_draw_for_draw(name, n):
    gen, text = ORIGINAL[name]
    a, b = np.random.RandomState(n), np.random.RandomState(n)
    theirs = gen(b, n, 40)
    mine = [draw(name, a, n) for _ in range(40)]
    assert json.dumps(mine) == json.dumps(theirs, default=int)
    for r in theirs:
        prompt, sep, target = text(r)
        assert texts(name, r) == (prompt + sep, target)


@pytest.mark.parametrize("digits", [(1, 1), (3, 8), (18, 2)])
def test_addition_equals_the_original_bin_draw_for_draw(digits):
    a, b = np.random.RandomState(3), np.random.RandomState(3)
    theirs = gen_addition_bin(b, *digits, 30)
    assert [draw("kaz-addition", a, digits) for _ in range(30)] == theirs
    for r in theirs:
        prompt, sep, target = text_addition(r)
        assert texts("kaz-addition", r) == (prompt + sep, target)


@pytest.mark.parametrize("n", [2, 3, 9, 26])
def test_lego_chain_is_the_originals_and_the_query_one_of_its_queries(n):
    queries = []
    for s in range(60):
        theirs = gen_lego(np.random.RandomState(s), n, 1)
        mine = draw("kaz-lego", np.random.RandomState(s), n)
        assert mine in theirs
        prompt, sep, target = text_lego(mine)
        assert texts("kaz-lego", mine) == (prompt + sep, target)
        queries.append(mine["cat"][1])
    assert set(queries) <= set(range((n + 1) // 2, n))  # the second half, as the original's queries
    assert len(set(queries)) == n - (n + 1) // 2 or n == 26  # each of them drawn (26: 13 queries, 60 draws)


# ------------------------------------------------------------------ answers by interpreters
def _answer(name: str, prompt: str) -> str:
    """What the target must say, worked out from the prompt alone."""
    words = prompt.split()
    if name.startswith(("kaz-copy", "kaz-reverse")):
        items = words[1 : words.index("[SEP]")]
        items = items[::-1] if "reverse" in name else items
        return " ".join(items + (["[NEXT]", *items] if name.endswith("2x") else []))
    if name == "kaz-parity":
        bits = prompt[prompt.index("[") + 1 : prompt.index("]")].split(",")
        return "The answer is " + ("Yes" if sum(int(b) for b in bits) % 2 == 0 else "No") + "."
    if name == "kaz-sum":
        total = eval(prompt[len("Compute:") : prompt.index(".")])  # digits and + only
        return f"The answer is {' '.join(str(total % 10))} ."
    if name == "kaz-lego":
        env: dict[str, int] = {}
        for clause in prompt[3 : prompt.index(". Then")].split(", "):
            lhs, rhs = clause.split(" = ")
            env[lhs] = int(rhs) if rhs in ("+1", "-1") else (1 if rhs[0] == "+" else -1) * env[rhs[2:]]
        return f"The answer is {env[prompt.split()[-1][:-1]]:+d}."
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["kaz-copy", "kaz-copy-2x", "kaz-reverse", "kaz-reverse-2x", "kaz-parity",
                                  "kaz-sum", "kaz-lego"])  # fmt: skip
def test_targets_are_what_an_interpreter_says(name):
    rs = np.random.RandomState(11)
    for n in (2, 5, 13):
        for _ in range(30):
            prompt, target = texts(name, draw(name, rs, n))
            assert target == _answer(name, prompt)


def test_arithmetic_answers():
    rs = np.random.RandomState(2)
    for _ in range(50):
        r = draw("kaz-addition", rs, (7, 3))
        assert int(texts("kaz-addition", r)[1][len("The answer is ") : -1].replace(" ", "")) == r["a"] + r["b"]
        p = draw("kaz-poly", rs, 6)
        value = sum(c * p["x"] ** d for c, d in zip(p["coeffs"], p["degrees"])) % 10
        assert texts("kaz-poly", p)[1] == f"The answer is {value}."
        s = draw("kaz-sort-multi", rs, 5)
        assert s["tgt_seq"] == sorted(s["src_seq"])


# ------------------------------------------------------------------ batches
@pytest.mark.parametrize("name", KAZEMNEJAD_TASKS)
def test_batches_score_the_target_only_and_fit_seq_len(name):
    """A row is tokenize(prompt + sep) + tokenize(target) + </s>, padded; the mask scores
    exactly the target and </s> (the original's labels); columns fit ``seq_len``."""
    task = KazemnejadTask(name)
    rs = np.random.RandomState(4)
    for n in (task.min_size, 8, 17):
        records = [draw(name, rs, task._column(rs, n)) for _ in range(16)]
        b = task.batch(records, task.seq_len(n))
        assert b.tokens.shape == (16, task.seq_len(n)) == b.targets.shape == b.mask.shape
        assert sequence_length(name, n) == task.seq_len(n)
        for row, r in enumerate(records):
            prompt, target = texts(name, r)
            words = tokenize(prompt) + tokenize(target) + ["</s>"]
            full = [VOCAB[i] for i in b.tokens[row].tolist()] + [VOCAB[b.targets[row, -1]]]
            assert full == words + ["<pad>"] * (len(full) - len(words))
            assert [VOCAB[i] for i in b.targets[row][b.mask[row]].tolist()] == tokenize(target) + ["</s>"]
        assert next(task.eval_batches(n, 8, 8)).tokens.shape == (8, task.seq_len(n))
    tb = task.train_batch(0, 32, 8)
    assert tb.mask.any(1).all() and (tb.targets[tb.mask] != 0).all()
    assert torch.equal(tb.tokens, task.train_batch(0, 32, 8).tokens)  # a function of (seed, step)


def test_training_sizes_are_uniform_and_the_columns_exact():
    task = KazemnejadTask("kaz-parity")
    comma = VOCAB.index(",")
    rows = torch.cat([task.train_batch(s, 64, 8).tokens for s in range(20)])  # (1280, L)
    bits = ((rows == comma).sum(1) + 1).tolist()  # the prompt's list has n - 1 commas
    counts = np.bincount(bits, minlength=9)[1:]
    assert counts.min() > 0.6 * counts.mean()  # 1..8, each about 1/8 of 1280
    add = KazemnejadTask("kaz-addition")
    b = next(add.eval_batches(6, 200, 200))
    plus, q = VOCAB.index("+"), VOCAB.index("?")
    longer = [max(r.index(plus) - 1, r.index(q) - r.index(plus) - 1) for r in b.tokens.tolist()]
    assert set(longer) == {6}  # the longer operand has exactly n digits


def test_bad_sizes_and_names_are_refused():
    with pytest.raises(ValueError, match="unknown task 'kaz-nope'"):
        KazemnejadTask("kaz-nope")
    with pytest.raises(ValueError, match=r"kaz-lego: size must be an int \[2, 26\], got 1"):
        next(KazemnejadTask("kaz-lego").eval_batches(1, 4, 4))
    with pytest.raises(ValueError, match=r"kaz-addition: the training length must be an int \[1, 18\], got 19"):
        KazemnejadTask("kaz-addition").train_batch(0, 4, 19)
    with pytest.raises(ValueError, match=r"kaz-copy: size must be an int >= 1, got 0"):
        next(KazemnejadTask("kaz-copy").eval_batches(0, 4, 4))


def test_registered_everywhere():
    assert set(KAZEMNEJAD_TASKS) <= set(TASK_NAMES)
    assert isinstance(load_source(task="kaz-sum", seed=3), KazemnejadTask)
    cfg = preset_config("quick", task="kaz-lego")
    assert (cfg.train_len, cfg.eval_lens, cfg.steps, cfg.lr) == (8, [4, 8, 12, 16], 6000, 3e-3)
    # kaz-sum: 18 000 steps at weight decay 0.1, batch 64 (at 0.01 and 12 000 steps four models of ten
    # learned it; at 0.1 and 18 000, batch 32, seeds 0-3, 19 of 20 converge; at batch 64 all 20); the
    # tasks not pinned here keep 0.01, and every task but kaz-sum and kaz-reverse-2x trains on batch 32
    kaz_sum = preset_config("quick", task="kaz-sum")
    assert (kaz_sum.steps, kaz_sum.weight_decay, kaz_sum.batch_size) == (18000, 0.1, 64)
    decay_01 = ("kaz-sum", "kaz-addition", "kaz-parity", "kaz-reverse", "kaz-reverse-2x")
    others = [t for t in KAZEMNEJAD_TASKS if t not in decay_01]
    assert {preset_config("quick", task=t).weight_decay for t in others} == {0.01}
    batch_32 = [t for t in KAZEMNEJAD_TASKS if t not in ("kaz-sum", "kaz-reverse-2x")]
    assert {preset_config("quick", task=t).batch_size for t in batch_32} == {32}
    # kaz-addition: 6 blocks, 18 000 steps, weight decay 0.1 (at 2 blocks and 6 000 steps no model
    # passed 8.6 % at n = 8; at 6 blocks nine of ten models of seeds 0 and 1 pass 90 %)
    addition = preset_config("quick", task="kaz-addition")
    assert (addition.depth, addition.steps, addition.weight_decay) == (6, 18000, 0.1)
    tr8 = [c for c in (preset_config("quick", task=t) for t in others) if c.train_len == 8]
    assert len(tr8) == 4 and {c.depth for c in tr8} == {2}  # poly, sort, sort-multi, lego
    # kaz-sort: 8 000 (at 6 000 NoPE was still improving; at 8 000 all ten models converge)
    assert preset_config("quick", task="kaz-sort").steps == 8000
    # kaz-parity: 12 000 steps at weight decay 0.1 (at 0.01, 6 000 and 12 000 steps, seeds 0-5: 25 and 27
    # of 30 models converge, every failure RoPE but one; at 0.1 and 12 000: all 30), 2 blocks
    parity = preset_config("quick", task="kaz-parity")
    assert (parity.steps, parity.weight_decay, parity.depth, parity.train_len) == (12000, 0.1, 2, 8)
    copy = preset_config("quick", task="kaz-copy")
    assert (copy.steps, copy.depth) == (8000, 4)
    # kaz-reverse: 12 000 steps at weight decay 0.1, 4 blocks, train 20 (at 8 000 and 0.01, seeds 0, 1:
    # 8 of 10 converge; here, seeds 0-5: 28 of 30)
    reverse = preset_config("quick", task="kaz-reverse")
    assert (reverse.steps, reverse.weight_decay, reverse.depth, reverse.train_len) == (12000, 0.1, 4, 20)
    reverse_2x = preset_config("quick", task="kaz-reverse-2x")
    # kaz-reverse-2x: 12 000 steps at weight decay 0.1 and batch 64, 4 blocks (at 8 000 and 0.01, seeds 0, 1:
    # 6 of 10 converge; at 12 000 and 0.1, batch 32, seeds 0-3: 18 of 20; at batch 64 all 20)
    assert (reverse_2x.steps, reverse_2x.weight_decay, reverse_2x.batch_size, reverse_2x.depth) == (12000, 0.1, 64, 4)


def test_compare_runs_a_kazemnejad_task(tmp_path):
    out = tmp_path / "run"
    argv = [*TINY[: TINY.index("--train-len")], "--batch-size", "4", "--warmup", "2", "--eval-samples", "6",
            "--no-progress", "--task", "kaz-copy", "--train-len", "4", "--eval-lens", "4,8", "--steps", "2",
            "--encodings", "rope,alibi", "--out", str(out)]  # fmt: skip
    assert run_cli(*argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert [e["length"] for e in res["runs"][0]["eval"]] == [4, 8]
    assert all(0 <= e["accuracy"] <= 1 for e in res["runs"][0]["eval"])
