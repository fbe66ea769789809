"""posenc in Hugging Face training: packed documents and the ``Trainer`` example.

Packed sequences: HF's ``DataCollatorWithFlattening`` puts several documents in one row
with positions restarting at each; every encoding must then give each document the loss
it gets alone (the oracle: the same model run on each document by itself).
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F
from tests.conftest import assert_close
from tests.test_hf import ENCODINGS, gpt2_config, llama_config, llama_n, perturb

transformers = pytest.importorskip("transformers")
from transformers import DataCollatorWithFlattening, GPT2LMHeadModel, LlamaForCausalLM  # noqa: E402

import posenc.hf as ph  # noqa: E402
from posenc.data import embedded_documents  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
LENGTHS = (9, 23, 2, 16)  # a 2-token document: one prediction


def _documents() -> list[list[int]]:
    docs = embedded_documents()
    return [list(docs[3 * i][:n]) for i, n in enumerate(LENGTHS)]


def _per_document_loss(model, batch, docs) -> torch.Tensor:
    """Mean next-token loss of each document, read off the packed forward."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
    labels = batch["labels"][0]
    token_loss = F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=-100, reduction="none")
    out, start = [], 0
    for d in docs:
        out.append(token_loss[start : start + len(d) - 1].mean())  # predictions of tokens 1..n-1 of d
        start += len(d)
    return torch.stack(out)


def _alone_loss(model, docs) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([d]), labels=torch.tensor([d])).loss for d in docs])


@pytest.mark.parametrize("name", ENCODINGS)
def test_packed_documents_get_the_loss_they_get_alone(name):
    cfg = llama_config(vocab_size=256, max_position_embeddings=32)
    if name.startswith("deberta"):
        cfg = llama_config(vocab_size=256, max_position_embeddings=32, num_key_value_heads=4)
    model = ph.convert(LlamaForCausalLM(cfg), encoding=name).eval()
    perturb(model)
    docs = _documents()
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d} for d in docs])
    assert batch["position_ids"][0].tolist() == [p for d in docs for p in range(len(d))]
    packed = _per_document_loss(model, batch, docs)
    alone = _alone_loss(model, docs)
    assert_close(packed, alone, n=llama_n(cfg, max(LENGTHS)) + cfg.vocab_size)
    # HF's own loss over the packed row: the token-weighted mean of the documents' losses
    with torch.no_grad():
        total = model(**batch).loss
    weights = torch.tensor([len(d) - 1 for d in docs], dtype=torch.float32)
    assert_close(total, (alone * weights).sum() / weights.sum(), n=llama_n(cfg, max(LENGTHS)) + cfg.vocab_size)


@pytest.mark.parametrize("name", ["rope", "alibi", "conv"])
def test_packed_documents_from_flash_attention_kwargs(name):
    """``return_flash_attn_kwargs=True``: documents from ``cu_seq_lens_q``, not positions."""
    model = ph.convert(LlamaForCausalLM(llama_config(vocab_size=256)), encoding=name).eval()
    perturb(model)
    docs = _documents()
    collate = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True)
    batch = collate([{"input_ids": d} for d in docs])
    with torch.no_grad():
        got = model(**batch).logits[0]
    start = 0
    for d in docs:
        with torch.no_grad():
            want = model(input_ids=torch.tensor([d])).logits[0]
        assert_close(got[start : start + len(d)], want, n=llama_n(model.config, len(d)))
        start += len(d)


@pytest.mark.parametrize("name", ["learned", "alibi", "t5"])
def test_gpt2_packed_documents_get_the_loss_they_get_alone(name):
    model = ph.convert(GPT2LMHeadModel(gpt2_config(vocab_size=256)), encoding=name).eval()
    perturb(model)
    docs = _documents()
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d} for d in docs])
    assert_close(_per_document_loss(model, batch, docs), _alone_loss(model, docs), n=2000)


def test_packing_is_what_separates_the_documents():
    """Control: the same row with positions 0..N-1 (one document) gives other losses, so the
    equality above comes from document boundaries, not from a model blind to context."""
    model = ph.convert(LlamaForCausalLM(llama_config(vocab_size=256)), encoding="alibi").eval()
    docs = _documents()
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d} for d in docs])
    one_row = dict(batch, position_ids=torch.arange(batch["input_ids"].shape[1])[None])
    diff = (_per_document_loss(model, one_row, docs) - _alone_loss(model, docs)).abs()
    assert diff[0] < 1e-5 and diff[1:].max() > 1e-3  # the first document has nothing before it


# ============================================================================ Trainer
def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example", ROOT / "examples" / "hf_trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("packed", [False, True])
def test_trainer_example_lowers_the_held_out_loss(tmp_path, packed):
    argv = ["--steps", "30", "--out", str(tmp_path), "--encoding", "rope,alibi" if packed else "t5"]
    result = _example().main(argv + (["--packed"] if packed else []))
    # 30 steps from ln(256) = 5.55 nats/byte (uniform): well below it, through HF's loss and optimizer
    assert result["eval_before"] > 5.0 and result["eval_after"] < result["eval_before"] - 1.5
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert [s["encoding"] for s in loaded.config.posenc_layers] == (["rope", "alibi"] if packed else ["t5", "t5"])


@pytest.mark.slow
def test_trainer_example_one_minute_run(tmp_path):
    """The example's default run (300 steps, about a minute on one CPU thread)."""
    result = _example().main(["--out", str(tmp_path)])
    assert result["eval_after"] < 2.7 < result["eval_before"]
