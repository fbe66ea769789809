"""examples/extend_tiny_llama.py's training rows, and how ``posenc extend`` names the model in its plots."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.conftest import assert_close  # noqa: E402

from posenc.extend.passkey import QUESTION, Tokens  # noqa: E402
from posenc.extend.report import shown  # noqa: E402


def example():
    path = Path(__file__).resolve().parents[1] / "examples" / "extend_tiny_llama.py"
    spec = importlib.util.spec_from_file_location("extend_tiny_llama", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_passkey_rows_mark_their_answer_and_never_hold_an_evaluation_key():
    ex = example()
    held = ex.eval_keys([256, 512], 5)
    # the keys posenc extend draws (passkey.passkey_accuracy's seeds), 2 lengths x 5 depths x 5 trials
    assert "".join(random.Random("256/0.5/3").choices("0123456789", k=5)) in held and len(held) <= 50
    rows = ex.Rows(b"abcdefgh" * 200, 256, 2, 400, seed=0, held_out=held)
    tail = len(Tokens()(QUESTION))
    for i in range(0, 400, 2):  # the passkey rows
        r = rows[i]
        ids = r["input_ids"]
        assert ids.shape == (256,) and torch.equal(r["labels"], ids)
        key = bytes(ids[-5:].tolist()).decode()
        assert key.isdigit() and key not in held
        assert torch.equal(r["answer"].nonzero().flatten(), torch.arange(250, 256))  # " " + 5 digits
        assert bytes(ids[-6 - tail : -6].tolist()).decode() == QUESTION
    assert not rows[1]["answer"].any() and torch.equal(rows[1]["labels"], rows[1]["input_ids"])


def test_copy_rows_repeat_a_corpus_window_and_the_others_are_plain_windows():
    r = random.Random(0)
    data = bytes(r.randrange(256) for _ in range(5000))
    rows = example().Rows(data, 300, 2, 40, seed=0, held_out=set(), copy_every=4)
    for i in range(1, 40, 2):
        ids = bytes(rows[i]["input_ids"].tolist())
        assert len(ids) == 300
        if i % 4 == 1:  # the copy rows: 150 bytes of the corpus, twice
            assert ids[:150] == ids[150:] and ids[:150] in data
        else:
            assert ids in data and ids[:150] != ids[150:]


def test_a_training_length_too_short_for_the_prompt_is_refused():
    with pytest.raises(ValueError, match=r"--seq-len 128: the passkey prompt needs >= 252 bytes"):
        example().Rows(b"x" * 1000, 128, 2, 10, seed=0, held_out=set())


def test_the_plots_name_the_model_relative_to_the_run_folder_never_by_its_absolute_path():
    assert shown("/tmp/exrun2/out/model", Path("/tmp/exrun2/out/extend")) == "../model"
    assert shown("/tmp/exrun2/out/extend/model", Path("/tmp/exrun2/out/extend")) == "model"
    assert shown("/models/Llama-2-7b-hf", Path("/home/u/runs/e")) == "Llama-2-7b-hf"
    assert shown("/tmp/x/runs/quick (rope, seed 0)", Path("/tmp/x/runs/quick/ext")) == "quick (rope, seed 0)"


def test_the_loss_is_the_mean_over_all_tokens_plus_the_weighted_mean_over_the_answers():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, bos_token_id=None, eos_token_id=None,
                                         pad_token_id=None))  # fmt: skip
    ids = torch.randint(0, 256, (2, 12))
    answer = torch.zeros(2, 12, dtype=torch.bool)
    answer[0, 9:] = True  # row 0's last three tokens
    logp = model(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]  # (2, 11)
    want = -logp.mean() + 3.0 * -logp[0, 8:].mean()
    trainer = object.__new__(example().MixedTrainer)  # compute_loss reads nothing of Trainer's state
    trainer.answer_weight = 3.0
    got = trainer.compute_loss(model, {"input_ids": ids, "labels": ids.clone(), "answer": answer})
    assert_close(got, want, n=256 + 2 * 11)  # the same logits; log-softmax over 256, means over <= 22


def test_the_saved_tokenizer_reads_bytes_as_their_values():
    """The example saves a tokenizer (for ``--tasks``) that gives the ids the model was trained on."""
    tok = example().byte_tokenizer()
    text = "The pass key is 68513.\n\tÜber € \x00\x7f end"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    assert len(tok) == 256 and tok.eos_token_id is None and tok.bos_token_id is None
    assert Tokens(tok, 256)(text) == Tokens()(text)
