"""Data sources of posenc compare: embedded corpus, text files, HF datasets, synthetic tasks."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from posenc.data import DataError, SyntheticTask, TextData, embedded_corpus, load_hf_dataset, read_text
from posenc.data.tasks import SEP


@pytest.fixture(scope="module")
def corpus() -> bytes:
    return embedded_corpus()


def test_embedded_corpus_is_python_docs(corpus):
    assert 400_000 < len(corpus) < 2_000_000
    assert b'The "assert" statement' in corpus
    corpus.decode("utf-8")


def test_split_is_deterministic_tail(corpus):
    d = TextData(corpus, val_fraction=0.1)
    assert len(d.train) + len(d.val) == len(corpus)
    assert bytes(d.val.to(torch.uint8).tolist()) == corpus[len(d.train) :]
    assert len(d.val) == int(len(corpus) * 0.1)


def test_train_batches_depend_on_seed_and_step_only(corpus):
    d, d2 = TextData(corpus, seed=1), TextData(corpus, seed=1)
    a, b = d.train_batch(5, 4, 32), d2.train_batch(5, 4, 32)
    assert torch.equal(a.tokens, b.tokens) and a.mask is None
    assert not torch.equal(a.tokens, d.train_batch(6, 4, 32).tokens)
    assert not torch.equal(a.tokens, TextData(corpus, seed=2).train_batch(5, 4, 32).tokens)
    assert torch.equal(a.tokens[:, 1:], a.targets[:, :-1])  # next-byte targets
    assert a.tokens.shape == (4, 32) and a.tokens.max() < 256


def test_eval_windows_non_overlapping():
    d = TextData(bytes(range(200)) * 10, val_fraction=0.5)  # val: 1000 bytes
    w, f = d.eval_windows(64, max_tokens=10_000)
    assert w.shape == (15, 65) and (f == 0).all()  # floor(999 / 64) windows
    val = d.val
    for n in range(len(w)):
        assert torch.equal(w[n], val[64 * n : 64 * n + 65])
    w, _ = d.eval_windows(64, max_tokens=200)
    assert len(w) == 3  # capped by the token budget


def test_sliding_windows_score_every_token_once():
    d = TextData(bytes(range(256)) * 4, val_fraction=0.25)  # val: 256 bytes
    scored = []
    for b in d.eval_batches(32, batch_size=3, max_tokens=10_000, stride=8):
        for row_t, row_m in zip(b.targets, b.mask):
            scored += row_t[row_m].tolist()
            assert row_m.sum() in (8, 32)
    # the validation bytes 1.. are scored exactly once each, in order
    assert scored == d.val[1 : 1 + len(scored)].tolist()
    with pytest.raises(ValueError, match="stride"):
        d.eval_windows(32, 100, stride=40)


def test_read_text(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("héllo wörld\n" * 50, encoding="utf-8")
    assert read_text(p) == p.read_bytes()
    with pytest.raises(DataError, match="no such file"):
        read_text(tmp_path / "missing.txt")
    (tmp_path / "b.bin").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(DataError, match="not UTF-8"):
        read_text(tmp_path / "b.bin")


def test_hf_dataset_without_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(DataError, match="pip install datasets"):
        load_hf_dataset("wikitext")


def test_hf_dataset_unreachable_hub(monkeypatch):
    fake = types.ModuleType("datasets")

    def load_dataset(*a, **k):
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub")

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(DataError, match="Hugging Face hub.*ConnectionError"):
        load_hf_dataset("wikitext", "wikitext-2-raw-v1")


def test_hf_dataset_reads_column(monkeypatch):
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, config, split, streaming: iter([{"text": "ab"}, {"text": "cd"}])
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert load_hf_dataset("x") == b"ab\ncd"
    with pytest.raises(DataError, match="no column 'body'"):
        load_hf_dataset("x", field="body")


@pytest.mark.parametrize("name", ["copy", "reverse", "sort"])
def test_sequence_tasks(name):
    t = SyntheticTask(name, num_symbols=10)
    g = torch.Generator().manual_seed(0)
    b = t.sample(7, 5, g)
    assert b.tokens.shape == (5, t.seq_len(7)) == (5, 14)
    seq = torch.cat([b.tokens, b.targets[:, -1:]], 1)  # (B, 15)
    x, sep, y = seq[:, :7], seq[:, 7], seq[:, 8:]
    assert (sep == SEP).all() and x.min() >= 1 and x.max() <= 10
    for xi, yi in zip(x.tolist(), y.tolist()):
        want = {"copy": xi, "reverse": xi[::-1], "sort": sorted(xi)}[name]
        assert yi == want
    # the answer (7 tokens) is scored: the targets of the separator and after it
    assert b.mask.sum(1).tolist() == [7] * 5 and b.mask[:, 7:].all() and not b.mask[:, :7].any()


def test_associative_recall():
    t = SyntheticTask("associative-recall", num_symbols=8, max_keys=64)
    b = t.sample(10, 6, torch.Generator().manual_seed(1))
    assert b.tokens.shape == (6, t.seq_len(10)) == (6, 22)
    for toks, tgt in zip(b.tokens.tolist(), b.targets.tolist()):
        keys, vals = toks[0:20:2], toks[1:20:2]
        assert len(set(keys)) == 10 and all(k > 8 for k in keys) and all(1 <= v <= 8 for v in vals)
        assert toks[20] == SEP
        assert tgt[-1] == vals[keys.index(toks[21])]
    assert b.mask.sum(1).tolist() == [1] * 6 and b.mask[:, -1].all()
    assert t.vocab_size == 1 + 8 + 64


def test_task_batches_deterministic_and_sizes_vary():
    t = SyntheticTask("copy", seed=3)
    sizes = {t.train_batch(s, 2, 12).tokens.shape[1] // 2 for s in range(40)}
    assert sizes <= set(range(1, 13)) and len(sizes) > 5
    assert torch.equal(t.train_batch(4, 2, 12).tokens, SyntheticTask("copy", seed=3).train_batch(4, 2, 12).tokens)
    ev = list(t.eval_batches(20, batch_size=8, count=20))
    assert [len(b.tokens) for b in ev] == [8, 8, 4]
    with pytest.raises(ValueError, match="unknown task"):
        SyntheticTask("add")


# ------------------------------------------------------------------ passkey
def _passkey(corpus):
    from posenc.data.passkey import PasskeyTask

    d = TextData(corpus)
    return PasskeyTask(d.train, d.val)


def test_passkey_sample_layout(corpus):
    from posenc.data.passkey import KEY_BASE, KEY_DIGITS, MARK, key_digits

    task = _passkey(corpus)
    b = task.sample(64, 8, 0.5, task.val, torch.Generator().manual_seed(0))
    assert b.tokens.shape == b.targets.shape == (8, 64) and int(b.mask.sum()) == 8 * KEY_DIGITS
    seq = torch.cat([b.tokens, b.targets[:, -1:]], 1)  # (8, 65): the whole sequence
    assert torch.equal(seq[:, 1:], b.targets) and torch.equal(seq[:, :-1], b.tokens)
    filler = 65 - task.overhead
    for row in seq:
        marks = (row == MARK).nonzero().flatten().tolist()
        assert marks == [round(0.5 * filler), 64 - KEY_DIGITS]  # the key at half depth, the question at the end
        key, answer = row[marks[0] + 1 : marks[0] + 6], row[-KEY_DIGITS:]
        assert torch.equal(key, answer)
        assert [(int(c) - KEY_BASE) // 10 for c in key] == [0, 1, 2, 3, 4]  # place j: its own ten symbols
    assert torch.equal(key_digits(key), torch.tensor([(int(c) - KEY_BASE) % 10 for c in key]))
    assert torch.equal(b.targets[b.mask].view(8, KEY_DIGITS), b.targets[:, -KEY_DIGITS:])  # the answer is scored
    for depth in (0.0, 1.0):
        b = task.sample(64, 2, depth, task.val, torch.Generator().manual_seed(1))
        first = (b.tokens[0] == MARK).nonzero()[0].item()
        assert first == round(depth * filler)  # depth 0: the key opens the text; 1: right before the question


def test_passkey_rows_are_filler_with_the_key_spliced_in(corpus):
    """Written out row by row: filler[:k] + key + filler[k:] + key, the filler a window of the split."""
    from posenc.data.passkey import KEY_BASE, KEY_DIGITS, MARK

    task = _passkey(corpus)
    b = task.sample(40, 16, None, task.train, torch.Generator().manual_seed(3))
    special = bytes([MARK, *range(KEY_BASE, KEY_BASE + 50)])
    val = bytes(task.train.tolist()).translate(bytes.maketrans(special, b" " * len(special)))
    for row in torch.cat([b.tokens, b.targets[:, -1:]], 1):
        r = row.tolist()
        k = r.index(MARK)
        key = r[k : k + 1 + KEY_DIGITS]
        assert r[-1 - KEY_DIGITS :] == key
        fill = r[:k] + r[k + 1 + KEY_DIGITS : -1 - KEY_DIGITS]
        assert len(fill) == 41 - task.overhead and not set(fill) & set(special)
        assert bytes(fill) in val


def test_passkey_determinism_and_errors(corpus):
    task = _passkey(corpus)
    a, b = task.train_batch(3, 4, 32, seed=1), task.train_batch(3, 4, 32, seed=1)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, task.train_batch(3, 4, 32, seed=2).tokens)
    # training scores the answer only, as evaluation does
    assert torch.equal(a.mask, (torch.arange(32) >= 32 - 5).expand(4, 32))
    e1 = next(task.eval_batches(48, 4, 4, depth=0.25))
    e2 = next(task.eval_batches(48, 4, 4, depth=0.25))
    assert torch.equal(e1.tokens, e2.tokens) and int(e1.mask.sum()) == 4 * 5
    assert not torch.equal(e1.tokens, next(task.eval_batches(48, 4, 4, depth=0.75)).tokens)
    with pytest.raises(ValueError, match="passkey length must be an int >= 12"):
        task.sample(8, 1, 0.5, task.val, torch.Generator())
    with pytest.raises(ValueError, match="exceeds the filler"):
        task.sample(len(task.val) + 5, 1, 0.5, task.val, torch.Generator())
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\]"):
        task.sample(32, 1, 1.5, task.val, torch.Generator())
