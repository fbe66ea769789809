"""Issue 64's smaller defects of ``posenc extend`` (and of ``posenc.hf.convert`` on a GGUF-loaded
model), each pinned by a test that failed before its fix; and the estimate extend prints first."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import posenc.hf as ph  # noqa: E402
from posenc.cli import main  # noqa: E402

L = 32  # training length of the tiny checkpoint


def llama(**kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=L, bos_token_id=None, eos_token_id=None,
               pad_token_id=None)  # fmt: skip
    return LlamaForCausalLM(LlamaConfig(**(cfg | kw))).eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    llama().save_pretrained(path)
    return path


def run(*args) -> int:
    try:
        return main(["extend", *map(str, args)])
    except SystemExit as e:
        return e.code


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
