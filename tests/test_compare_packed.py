"""``posenc compare --packed``: training windows as packed documents (issue 12, item 4).

The data side (document ids and unscored document starts), the loss the trainer takes
(``lm_loss`` hands ``document_ids`` to the model), the config rules, and a tiny run.
"""

from __future__ import annotations

import json

import pytest
import torch
from tests.conftest import assert_close, lm_n
from tests.test_compare import TINY, run_cli

import posenc
from posenc.compare import CompareConfig
from posenc.data import DataError, TextData, document_starts, load_source
from posenc.positions import document_positions
from posenc.train import lm_loss

TEXT = b"first para\nstill first\n\nsecond\n\n\nthird one is longer than the others\n \n4th\n"


def test_document_starts_split_at_blank_lines():
    starts = document_starts(TEXT)
    assert starts == [0, 24, 33, 71]
    assert [TEXT[s:e] for s, e in zip(starts, [*starts[1:], len(TEXT)])][1:3] == [
        b"second\n\n\n",
        b"third one is longer than the others\n \n",
    ]
    assert document_starts(b"no blank line\n") == [0]


def test_packed_windows_carry_documents_and_skip_document_starts():
    data = TEXT * 40
    src = TextData(data, val_fraction=0.2, seed=3, doc_starts=document_starts(data))
    plain = TextData(data, val_fraction=0.2, seed=3)
    b, p = src.train_batch(5, 8, 48), plain.train_batch(5, 8, 48)
    assert torch.equal(b.tokens, p.tokens) and torch.equal(b.targets, p.targets)  # the same windows
    assert b.documents.shape == (8, 48) and b.mask.shape == (8, 48) and b.pos is None
    starts = set(document_starts(data))
    for row in range(8):
        # where the window starts: find it from the tokens (the windows of `plain` and `src` match)
        s0 = next(s for s in range(len(src.train) - 48) if torch.equal(src.train[s : s + 48], b.tokens[row]))
        for t in range(48):
            if t == 0:
                assert b.documents[row, 0] == 0
            else:  # the id changes exactly where a document starts
                assert bool(b.documents[row, t] != b.documents[row, t - 1]) == ((s0 + t) in starts), (row, t)
            assert bool(b.mask[row, t]) == ((s0 + t + 1) not in starts), (row, t)  # target t begins a document?
    again = src.train_batch(5, 8, 48)
    assert torch.equal(again.documents, b.documents) and torch.equal(again.mask, b.mask)


def test_lm_loss_gives_the_model_the_documents():
    torch.manual_seed(0)
    lm = posenc.TransformerLM(vocab_size=256, dim=16, depth=1, heads=2, encoding="alibi").eval()
    data = TEXT * 40
    b = TextData(data, val_fraction=0.2, doc_starts=document_starts(data)).train_batch(0, 4, 48)
    assert bool((b.documents[:, -1] > 0).all())  # every window holds more than one document
    with torch.no_grad():
        got = lm_loss(lm, b)
        logits = lm(b.tokens, pos=document_positions(b.documents), document_ids=b.documents)
        per = torch.nn.functional.cross_entropy(logits.transpose(1, 2), b.targets, reduction="none")
        want = per[b.mask].mean()
        unpacked = lm_loss(lm, b._replace(documents=None))
    assert_close(got, want, n=lm_n(dim=16, depth=1, length=48))
    assert abs(float(got - unpacked)) > 1e-4  # documents change the loss: the test can fail


def test_packed_config_rules():
    with pytest.raises(ValueError, match="packed needs a text source.*task='copy'"):
        CompareConfig(packed=True, task="copy")
    with pytest.raises(ValueError, match="packed needs .*randomized_positions=True"):
        CompareConfig(packed=True, randomized_positions=True)
    with pytest.raises(DataError, match="packed documents need a text source"):
        load_source(task="copy", packed=True)
    assert CompareConfig(packed=True).fingerprint() != CompareConfig().fingerprint()


def test_tiny_packed_run(tmp_path):
    out = tmp_path / "packed"
    assert run_cli(*TINY, "--encodings", "rope,conv", "--steps", "3", "--packed", "--out", str(out)) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["packed"] is True
    for r in res["runs"]:
        assert len(r["train_loss"]) == 3 and all(torch.isfinite(torch.tensor(r["train_loss"])))
        assert [e["length"] for e in r["eval"]] == [16, 32]
