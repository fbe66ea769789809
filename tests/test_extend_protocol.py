"""``posenc extend --protocol``, what each method ran with, and resumed progress (issue 65, parts 4, 6, 7).

* the truncated per-document protocol equals a transcription of the YaRN repository's
  ``eval/perplexity.py`` (``--truncate``, ``--dataset-min-tokens``, ``--samples``) run on the
  stock HF model, its documents re-derived here from ``pydoc_data.topics`` or the ``--text`` file;
* every perplexity column is labelled by its protocol in the table, ``results.json`` and
  ``report.md``; a protocol left out is not run;
* ``config.json``, ``results.json`` and the head of ``report.md`` carry θ, rope_type, factors,
  attention factor (YaRN's ``0.1 ln s + 1``), window/group sizes, dtype, device and versions;
* a resumed run's progress lines count and time only the cells left.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from tests.conftest import assert_close

transformers = pytest.importorskip("transformers")
from tests.test_extend import FAST, L, llama, run  # noqa: E402 (the tiny checkpoint and the CLI runner)
from transformers import AutoModelForCausalLM  # noqa: E402

from posenc.extend.documents import long_documents, split_documents  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    llama().save_pretrained(path)
    return path


def yarn_truncated(model_dir, docs: list[bytes], length: int, samples: int) -> float:
    """YaRN's eval/perplexity.py with --truncate: documents of >= ``length`` tokens (here the
    longest length), the first ``samples``; each scores its first ``length`` tokens (targets all
    but the first); perplexity = exp(mean of the per-document mean losses). Bytes are the tokens."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    enc = [torch.tensor(list(d)) for d in docs]
    enc = [e for e in enc if len(e) >= length][:samples]
    nlls = []
    for e in enc:
        ids = e[:length][None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].double(), ids[0, 1:], reduction="mean")
        nlls.append(loss)
    return math.exp(float(torch.stack(nlls).mean()))


def held_out_topics() -> list[bytes]:
    """The embedded corpus's held-out tenth cut at its pydoc topics (re-derived from the stdlib)."""
    from pydoc_data.topics import topics

    parts = [topics[k].encode() for k in sorted(topics)]
    corpus = b"\n\n".join(parts)
    start, at, out = len(corpus) - len(corpus) // 10, 0, []
    for p in parts:
        if at + len(p) > start:
            out.append(corpus[max(at, start) : at + len(p)])
        at += len(p) + 2
    return out


def test_truncated_equals_yarns_protocol_on_the_embedded_corpus(ckpt, tmp_path):
    out = tmp_path / "t"
    assert run(ckpt, "--lengths", "1x,2x", "--methods", "none", "--protocol", "truncated,sliding", "--windows", "3",
               "--passkey-trials", "0", "--chunk", "64", "--out", out) == 0  # fmt: skip
    res = json.loads((out / "results.json").read_text())
    cells = {c["length"]: c for c in res["cells"]}
    long_docs = [d for d in held_out_topics() if len(d) >= 2 * L]  # min tokens: the longest length
    for n in (L, 2 * L):  # the same documents at every length, cut at it
        want = yarn_truncated(ckpt, long_docs, n, 3)
        assert_close(torch.tensor(cells[n]["ppl_truncated"]), torch.tensor(want), n=n, dtype=torch.float32)
        assert cells[n]["documents"] == 3
    assert res["settings"]["documents"]["count"] == 3 and res["settings"]["documents"]["min_tokens"] == 2 * L
    assert res["protocols"] == {"truncated": {"key": "ppl_truncated", "label": "truncated per document"},
                                "sliding": {"key": "ppl", "label": "sliding"}}  # fmt: skip
    header = next(r for r in (out / "table.md").read_text().splitlines() if r.startswith("| method"))
    assert "| L=32 (train) truncated per document | L=32 (train) sliding |" in header
    assert "non-overlapping" not in header  # not chosen: no column
    report = (out / "report.md").read_text()
    assert "read in the truncated per document column" in report  # the first protocol is the reading's


def test_truncated_on_a_text_file_reads_its_documents(ckpt, tmp_path, capsys):
    docs = [b"short one", bytes(range(97, 123)) * 4, b"x" * 10, b"The quick brown fox jumps. " * 5]
    text = tmp_path / "docs.txt"
    text.write_bytes(b"\n\n\n".join(docs[:2]) + b"\f" + b"\n\n \n\n".join(docs[2:]))
    assert split_documents(text.read_bytes()) == docs
    assert split_documents(b"one\n\nparagraph\n\n\nnext") == [b"one\n\nparagraph", b"next"]  # one blank line: same doc
    out = tmp_path / "f"
    assert run(ckpt, "--text", text, "--lengths", "1x", "--methods", "none", "--protocol", "truncated",
               "--windows", "2", "--passkey-trials", "0", "--chunk", "16", "--out", out) == 0  # fmt: skip
    cell = json.loads((out / "results.json").read_text())["cells"][0]
    want = yarn_truncated(ckpt, docs, L, 2)
    assert_close(torch.tensor(cell["ppl_truncated"]), torch.tensor(want), n=L, dtype=torch.float32)
    assert cell["documents"] == 2 and "ppl" not in cell  # sliding not chosen: not run
    text.write_bytes(b"\n\n\n".join([b"tiny", b"also tiny"]))
    capsys.readouterr()
    assert run(ckpt, "--text", text, "--lengths", "16", "--methods", "none", "--protocol", "truncated", *FAST,
               "--out", tmp_path / "g") == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--protocol truncated: no document of the text has 16 tokens" in err


def test_a_bos_token_leads_each_document():
    class Tok:
        def of_bytes(self, d):
            return torch.tensor(list(d))

    got = long_documents(None, Tok(), 1, length=16, count=2)
    assert len(got) == 2 and all(len(d) == 16 and d[0] == 1 for d in got)


def test_bad_protocol_is_refused(ckpt, tmp_path, capsys):
    assert run(ckpt, "--protocol", "sliding,fancy", "--out", tmp_path / "x") == 2
    err = capsys.readouterr().err
    assert "fancy" in err and "truncated" in err


def test_every_run_records_what_each_method_ran_with(ckpt, tmp_path):
    import posenc

    out = tmp_path / "r"
    args = ("--lengths", "1x,4x", "--methods", "none,yarn,ntk,self-extend,sink-window,longrope", "--windows", "1",
            "--passkey-trials", "0", "--chunk", "64", "--out", out)  # fmt: skip
    assert run(ckpt, *args) == 0
    config = json.loads((out / "config.json").read_text())
    results = json.loads((out / "results.json").read_text())
    for rec in (config["ran_with"], results["settings"]["ran_with"]):
        y = rec["yarn"]
        assert (y["rope_type"], y["rope_theta"], y["factor"], y["original_max_position_embeddings"]) == (
            "yarn", 10000.0, 4.0, L)  # fmt: skip
        assert y["attention_factor"] == pytest.approx(0.1 * math.log(4) + 1)  # YaRN's sqrt(1/t), Peng et al. eq. 22
        assert rec["ntk"]["rope_theta"] == pytest.approx(10000 * 4 ** (8 / 6)) and rec["ntk"]["rope_type"] == "default"
        se = rec["self-extend"]
        assert (se["extension"], se["window"], se["group_size"]) == ("self-extend", L // 2, 7)  # ceil((128-16)/16)
        assert (rec["sink-window"]["sinks"], rec["sink-window"]["window"]) == (4, L - 4)
        assert rec["longrope"]["applicable"] is False
        assert all(r["dtype"] == "float32" and r["device"] == "cpu" for r in rec.values())
    for v in (config["versions"], results["versions"]):
        assert v["posenc"] == posenc.__version__ and v["transformers"] == transformers.__version__
        assert v["torch"] == torch.__version__
    report = (out / "report.md").read_text()
    head = report.split("## Reading")[0]
    assert "## What each method ran with" in head and f"transformers {transformers.__version__}" in head
    assert "- `yarn`: θ 10000, rope_type yarn, factor 4, original 32, attention factor 1.13863" in head
    # a resumed run under another version still resumes: the versions are recorded, not compared
    config["versions"]["posenc"] = "0.0.0-older"
    (out / "config.json").write_text(json.dumps(config))
    assert run(ckpt, *args, "--resume") == 0


def test_a_resumed_run_counts_and_times_only_the_cells_left(ckpt, tmp_path, capsys):
    out = tmp_path / "res"
    args = ("--lengths", "1x", "--methods", "none,ntk,yarn", *FAST, "--out", out)
    assert run(ckpt, *args) == 0
    first = json.loads((out / "results.json").read_text())
    (out / "results.json").write_text(json.dumps({**first, "cells": first["cells"][:1]}))  # stopped after `none`
    capsys.readouterr()
    assert run(ckpt, *args, "--resume") == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[")]
    assert [ln.split(":")[0] for ln in lines] == ["[1/2] ntk @ 32", "[2/2] yarn @ 32"]
    assert all(ln.endswith(" left") and ", about " in ln for ln in lines)
