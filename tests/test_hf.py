"""posenc inside Hugging Face models (``posenc.hf``): parity with stock HF, generation, round trips.

Oracles: stock ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` (transformers 5.x) with the same
random weights; HF's own decoder layers run by hand with chosen rotations (per-layer
encodings); a transcription of Meta's complex-number rotary for the checkpoint layouts;
``use_cache=False`` generation for cached generation. Tiny random configs, no download.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from tests.conftest import assert_close, attention_n
from torch.nn.attention import SDPBackend, sdpa_kernel

import posenc

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

import posenc.hf as ph  # noqa: E402

V = 97
# every registered encoding: the adapter runs them all (complex-order without a vocabulary, as
# built here, rotates the embeddings; with one it builds them from ids, which is refused below);
# those that read the layer's hidden state (read_input: fox, inkling) through posenc.hf.hidden
HIDDEN_STATE = [n for n in posenc.available() if posenc.get_class(n).defines("read_input")]
ENCODINGS = list(posenc.available())


# the tiny decoder every HF family's test config starts from (tests/test_hf_families.py too)
TINY_DECODER = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    initializer_range=0.3,  # sharp attention: logits that depend on every position term
)


def llama_config(**kw) -> LlamaConfig:
    return LlamaConfig(**(TINY_DECODER | kw))


def gpt2_config(**kw) -> GPT2Config:
    base = dict(
        vocab_size=V,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        initializer_range=0.3,
    )
    return GPT2Config(**(base | kw), bos_token_id=None, eos_token_id=None)


def llama_n(cfg, length: int) -> int:
    """Reduction length behind a Llama's logits (see tests/conftest.py): per layer the
    attention, the SwiGLU MLP (D, then I) and two RMSNorms (D each); then the final norm and head."""
    D, I = cfg.hidden_size, cfg.intermediate_size
    layer = attention_n(dim=D, length=length, head_dim=cfg.head_dim) + D + I + 2 * D
    return cfg.num_hidden_layers * layer + 2 * D


def perturb(model: torch.nn.Module) -> None:
    """Move every encoding parameter off its init (zero-initialised ones included), so a
    test cannot pass because a term is still zero."""
    with torch.no_grad():
        for p in model.posenc_stack.parameters():
            p.add_(0.1 * torch.randn_like(p))


def logits(model, ids, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **kw).logits


# ============================================================================ parity with stock HF
SCALINGS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_rope_equals_stock_llama_logits(scaling):
    # 48 tokens past max_position_embeddings=32: dynamic NTK rescales, yarn/llama3 use their ramps
    cfg = llama_config(max_position_embeddings=32, rope_parameters=SCALINGS[scaling])
    stock = LlamaForCausalLM(cfg).eval()
    ours = ph.convert(stock, encoding="rope")
    assert ours.model.posenc.encoding(0).rope_type == scaling
    ids = torch.randint(0, V, (2, 48))
    assert_close(logits(ours, ids), logits(stock, ids), n=llama_n(cfg, 48))
    # left padding: HF's position ids from the attention mask, the padded keys masked
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    got, want = (
        logits(ours, ids, attention_mask=mask, position_ids=pos),
        logits(stock, ids, attention_mask=mask, position_ids=pos),
    )
    assert_close(got[mask.bool()], want[mask.bool()], n=llama_n(cfg, 48))


def test_convert_leaves_the_source_model_as_it_was():
    stock = LlamaForCausalLM(llama_config()).eval()
    ids = torch.randint(0, V, (1, 12))
    before = logits(stock, ids)
    ours = ph.convert(stock, encoding="alibi")
    assert stock.config._attn_implementation == "sdpa" and ours.config._attn_implementation == "posenc"
    assert type(stock.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"
    assert torch.equal(logits(stock, ids), before)
    assert ours.model.embed_tokens.weight is stock.model.embed_tokens.weight  # weights shared, not copied
    assert not torch.allclose(logits(ours, ids), before)


def test_gpt2_learned_equals_stock_gpt2():
    cfg = gpt2_config()
    stock = GPT2LMHeadModel(cfg).eval()
    ours = ph.convert(stock, encoding=["learned", "nope"])  # wpe becomes layer 0's learned table
    assert type(ours.transformer.wpe).__name__ == "PositionsOff"
    ids = torch.randint(0, V, (2, 20))
    D = cfg.n_embd
    n = cfg.n_layer * (attention_n(dim=D, length=20) + 5 * D + 2 * D) + 2 * D
    assert_close(logits(ours, ids), logits(stock, ids), n=n)


def test_per_layer_encodings_equal_hf_layers_run_by_hand():
    """["rope", "nope"]: layer 0 rotates, layer 1 does not. The oracle runs HF's own decoder
    layers with HF's rotation for layer 0 and the identity for layer 1."""
    cfg = llama_config(attn_implementation="eager")
    stock = LlamaForCausalLM(cfg).eval()
    ours = ph.convert(stock, encoding=["rope", "nope"])
    ids = torch.randint(0, V, (2, 16))
    pos = torch.arange(16)[None]
    with torch.no_grad():
        m = stock.model
        h = m.embed_tokens(ids)
        cos, sin = m.rotary_emb(h, pos)
        causal = torch.full((16, 16), float("-inf")).triu(1)[None, None]
        h = m.layers[0](h, attention_mask=causal, position_embeddings=(cos, sin), position_ids=pos)
        h = m.layers[1](h, attention_mask=causal, position_embeddings=(torch.ones_like(cos), torch.zeros_like(sin)))
        want = stock.lm_head(m.norm(h))
    assert_close(logits(ours, ids), want, n=llama_n(cfg, 16))


# ============================================================================ generation
def _generate(model, ids, **kw):
    return model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0, **kw)


def greedy(model, ids, new: int = 32, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """``new`` greedily generated tokens and each step's next-token logits, ``(B, new, V)``."""
    out = model.generate(
        ids, max_new_tokens=new, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kw
    )
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("name", ENCODINGS)
def test_cached_generation_equals_uncached(name):
    cfg = llama_config(num_key_value_heads=4) if name.startswith("deberta") else llama_config()
    model = ph.convert(LlamaForCausalLM(cfg), encoding=name).eval()
    perturb(model)
    ids = torch.randint(1, V, (2, 7))
    cached, cached_logits = greedy(model, ids, past_key_values=DynamicCache(config=model.config))
    uncached, uncached_logits = greedy(model, ids, use_cache=False)
    assert cached.shape == (2, 7 + 32)
    assert torch.equal(cached, uncached)
    assert_close(cached_logits, uncached_logits, n=llama_n(cfg, 7 + 32))


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "conv"])
def test_static_cache_generation_equals_uncached(name):
    model = ph.convert(LlamaForCausalLM(llama_config()), encoding=name).eval()
    perturb(model)
    ids = torch.randint(1, V, (2, 5))
    static, static_logits = greedy(model, ids, cache_implementation="static")
    uncached, uncached_logits = greedy(model, ids, use_cache=False)
    assert torch.equal(static, uncached)
    assert_close(static_logits, uncached_logits, n=llama_n(model.config, 5 + 32))


@pytest.mark.parametrize("name", ENCODINGS)
def test_gpt2_cached_generation_equals_uncached(name):
    model = ph.convert(GPT2LMHeadModel(gpt2_config()), encoding=name).eval()
    perturb(model)
    ids = torch.randint(1, V, (2, 6))
    cached, cached_logits = greedy(model, ids)
    uncached, uncached_logits = greedy(model, ids, use_cache=False)
    assert torch.equal(cached, uncached)
    D = model.config.n_embd
    n = model.config.n_layer * (attention_n(dim=D, length=6 + 32) + 7 * D) + 2 * D
    assert_close(cached_logits, uncached_logits, n=n)


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "xl", "shaw", "learned", "xpos"])
def test_left_padded_batch_generates_what_each_prompt_generates_alone(name):
    model = ph.convert(LlamaForCausalLM(llama_config()), encoding=name).eval()
    perturb(model)
    a, b = torch.randint(1, V, (1, 9)), torch.randint(1, V, (1, 4))
    ids = torch.cat((a, torch.cat((torch.zeros(1, 5, dtype=torch.long), b), 1)))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    batch = _generate(model, ids, attention_mask=mask)
    assert torch.equal(batch[0], _generate(model, a)[0])
    assert torch.equal(batch[1, 5:], _generate(model, b)[0])


# ============================================================================ bf16 far out
def test_rope_bf16_logits_follow_float32_at_positions_up_to_32k():
    # torch 2.13 on a CPU with AMX: under ATEN_CPU_CAPABILITY=default the bf16 flash kernel
    # still takes its AMX path and fails ("pack_vnni2 is only supported when avx512 is
    # supported"); stock HF's sdpa fails alike. There, SDPA's math kernel runs instead.
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        with sdpa_kernel(SDPBackend.MATH):
            _bf16_follows_float32()
    else:
        _bf16_follows_float32()


def _bf16_follows_float32():
    cfg = llama_config(max_position_embeddings=32768)
    model = ph.convert(LlamaForCausalLM(cfg), encoding="rope").eval()
    low = copy.deepcopy(model).to(torch.bfloat16)
    ids = torch.randint(0, V, (2, 64))
    for start in (0, 32768 - 64):
        pos = torch.arange(start, start + 64)[None]
        want = logits(model, ids, position_ids=pos)
        got = logits(low, ids, position_ids=pos).float()
        assert_close(got, want, n=llama_n(cfg, 64), dtype=torch.bfloat16, msg=f"positions from {start}")


# ============================================================================ save / load
@pytest.mark.parametrize(
    "family,encoding",
    [
        ("llama", ["rope", "alibi"]),
        ("llama", ["t5", "t5"]),
        ("llama", ["learned", "nope"]),
        ("llama", "xpos"),
        ("llama", "fire"),
        ("gpt2", ["learned", "t5"]),
    ],
)
def test_save_pretrained_round_trips_through_auto_classes(tmp_path, family, encoding):
    stock = LlamaForCausalLM(llama_config()) if family == "llama" else GPT2LMHeadModel(gpt2_config())
    model = ph.convert(stock, encoding=encoding).eval()
    perturb(model)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    names = [s["encoding"] for s in saved["posenc_layers"]]
    assert names == (encoding if isinstance(encoding, list) else [encoding] * 2)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    ids = torch.randint(0, V, (2, 11))
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    if encoding == ["t5", "t5"]:  # T5 shares its table across layers, as in the paper
        assert len(loaded.model.posenc.encodings) == 1


def test_posenc_llama_config_builds_directly():
    cfg = ph.PosencLlamaConfig(**llama_config().to_dict() | {"posenc_layers": [{"encoding": "kerple"}] * 2})
    model = ph.PosencLlamaForCausalLM(cfg)
    assert model.config.posenc_layers[0] == {"encoding": "kerple", "options": {}}
    assert logits(model.eval(), torch.randint(0, V, (1, 5))).shape == (1, 5, V)


def test_layer_patterns_and_layer_specs_convert_like_lists():
    """posenc's one syntax for per-layer encodings (posenc.layers) works in convert too."""
    stock = LlamaForCausalLM(llama_config(num_hidden_layers=4))
    want = ph.convert(stock, encoding=["rope", "rope", "rope", "alibi"]).config.posenc_layers
    assert ph.convert(stock, encoding="rope*3,alibi").config.posenc_layers == want
    assert ph.convert(stock, encoding=posenc.layers("rope*3,alibi")).config.posenc_layers == want
    assert [s["encoding"] for s in ph.convert(stock, encoding="rope,nope").config.posenc_layers] == ["rope", "nope"] * 2
    # a layer's window, chunks and sinks carry over (tests/test_hf_windows.py runs them)
    specs = ph.convert(stock, encoding="rope(window=8)*3,rope(sinks=true)").config.posenc_layers
    assert [s.get("window") for s in specs] == [8, 8, 8, None] and [s.get("sinks", False) for s in specs][-1]
    assert [s.get("chunk") for s in ph.convert(stock, encoding="irope").config.posenc_layers] == [8192] * 3 + [None]


# ============================================================================ errors
def test_errors_name_the_bad_value():
    llama = LlamaForCausalLM(llama_config())
    with pytest.raises(TypeError, match="LlamaForCausalLM, GPT2LMHeadModel"):
        ph.convert(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="'complex-order' with these options builds the token embedding"):
        ph.convert(llama, encoding="complex-order", vocab_size=V)
    with pytest.raises(ValueError, match="unknown encoding 'nonesuch'"):
        ph.convert(llama, encoding="nonesuch")
    with pytest.raises(ValueError, match="lists 3 layers, the model has 2"):
        ph.convert(llama, encoding=["rope"] * 3)
    with pytest.raises(ValueError, match=r"\['num_buckets'\] do not apply to layer 0's encoding 'rope'"):
        ph.convert(llama, encoding=["rope", "t5"], num_buckets=16)
    with pytest.raises(TypeError, match="encoding\\[1\\]"):
        ph.convert(llama, encoding=["rope", 3])
    with pytest.raises(ValueError, match="shares its 't5' encoding with an earlier layer but HF gives it another"):
        ph.convert(GPT2LMHeadModel(gpt2_config(scale_attn_by_inverse_layer_idx=True)), encoding="t5")
    with pytest.raises(ValueError, match="one spec per layer \\(2\\), got 1"):
        ph.PosencLlamaConfig(**llama_config().to_dict() | {"posenc_layers": [{"encoding": "rope"}]})
    with pytest.raises(ValueError, match="'to' must be|to must be"):
        ph.rope_layout({}, llama_config(), to="meta")
    with pytest.raises(ValueError, match=r"layer 0 \(rope\(kv_heads=1\)\) sets \['kv_heads'\]"):
        ph.convert(llama, encoding="rope(kv_heads=1)")


def test_posenc_implementation_on_an_unconverted_model_is_an_error():
    stock = LlamaForCausalLM(llama_config())
    stock.set_attn_implementation("posenc")  # registered, but no encoding attached
    with pytest.raises(ValueError, match="posenc.hf.convert"):
        stock(torch.randint(0, V, (1, 4)))


def test_prepared_4d_masks_are_refused():
    model = ph.convert(LlamaForCausalLM(llama_config()), encoding="alibi")
    with pytest.raises(ValueError, match="builds its own masks"):
        model(torch.randint(0, V, (1, 4)), attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))


def test_import_without_transformers_names_the_extra():
    code = "import sys; sys.modules['transformers'] = None\nimport posenc.hf"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert out.returncode != 0 and "pip install 'posenc[hf]'" in out.stderr


def _env():
    import os

    src = str(__import__("pathlib").Path(posenc.__file__).parents[1])
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_mask_function_is_registered_so_the_causal_mask_is_not_dropped():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_MASK_ATTENTION_FUNCTIONS["posenc"] is ph.mask_interface
    assert ALL_ATTENTION_FUNCTIONS["posenc"] is ph.attention_forward
    # a causal model: the last token's logits do not change the earlier ones
    model = ph.convert(LlamaForCausalLM(llama_config()), encoding="nope").eval()
    ids = torch.randint(0, V, (1, 10))
    other = ids.clone()
    other[0, -1] = (ids[0, -1] + 1) % V
    assert torch.equal(logits(model, ids)[0, :-1], logits(model, other)[0, :-1])


def test_readme_hugging_face_section_runs(tmp_path, monkeypatch):
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Use it in a Hugging Face model", 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    assert len([line for line in code.strip().splitlines() if line.strip()]) == 10
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert type(scope["model"]).__name__ == "PosencLlamaForCausalLM"
    assert [s["encoding"] for s in scope["model"].config.posenc_layers] == ["rope", "rope", "rope", "nope"]
    assert scope["out"].shape[0] == 1 and 8 < scope["out"].shape[1] <= 8 + 16  # generation may stop at EOS
