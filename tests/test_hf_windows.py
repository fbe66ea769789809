"""Windows, chunks and sinks through ``posenc.hf`` (issue 26, item 4).

A posenc layer's ``window``/``chunk``/``sinks`` (a :class:`posenc.LayerSpec`, a pattern, the
``gemma3``/``irope``/``gpt-oss`` presets) reach the adapter's mask and backends. Oracles: stock
``MistralForCausalLM`` (Llama plus HF's sliding window) with the same weights for a window;
gpt-oss's own ``eager_attention_forward`` (its sink softmax) run inside a stock Llama for
sinks; a causal chunk mask written out (Llama 4's ``i // C == j // C``) for chunks; and
stock ModernBERT for its inclusive bidirectional window, with a control that the exclusive
reading differs. Tiny random configs, no download.
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close
from tests.test_hf import V, greedy, llama_config, llama_n, logits, perturb
from tests.test_hf_families import V as FV
from tests.test_hf_families import family_n, stock_model

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AttentionInterface,
    DynamicCache,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)
from transformers.masking_utils import AttentionMaskInterface, eager_mask  # noqa: E402

import posenc.hf as ph  # noqa: E402


def test_layer_window_equals_stock_mistral_sliding_window():
    """``rope(window=6)`` on a Llama is Mistral with ``sliding_window=6``: the same weights give
    the same logits, and cached generation past the window equals uncached."""
    cfg = llama_config()
    llama = LlamaForCausalLM(cfg).eval()
    mistral = MistralForCausalLM(MistralConfig(**cfg.to_dict() | {"sliding_window": 6}))
    mistral.load_state_dict(llama.state_dict())
    ours = ph.convert(llama, encoding="rope(window=6)").eval()
    assert [s["window"] for s in ours.config.posenc_layers] == [6, 6]
    ids = torch.randint(1, V, (2, 20))
    assert_close(logits(ours, ids), logits(mistral.eval(), ids), n=llama_n(cfg, 20))
    assert not torch.allclose(logits(ours, ids), logits(llama, ids), atol=1e-3)  # the window matters here
    ids = torch.randint(1, V, (2, 4))
    cached, cached_logits = greedy(ours, ids, 16, cache=DynamicCache(config=ours.config))
    uncached, uncached_logits = greedy(ours, ids, 16, use_cache=False)
    assert torch.equal(cached, uncached)
    assert_close(cached_logits, uncached_logits, n=llama_n(cfg, 20))


def test_layer_chunks_equal_a_written_out_chunk_mask():
    """``rope(chunk=4)``: query ``i`` sees key ``j`` iff ``j <= i`` and ``i // 4 == j // 4``."""
    cfg = llama_config(attn_implementation="eager")
    stock = LlamaForCausalLM(cfg).eval()
    ours = ph.convert(stock, encoding="rope(chunk=4)").eval()
    ids = torch.randint(1, V, (2, 18))
    i, j = torch.arange(18)[:, None], torch.arange(18)[None]
    keep = (j <= i) & (i // 4 == j // 4)
    additive = torch.zeros(18, 18).masked_fill(~keep, float("-inf"))[None, None].expand(2, 1, 18, 18)
    want = logits(stock, ids, attention_mask=additive)
    assert_close(logits(ours, ids), want, n=llama_n(cfg, 18))
    cached, _ = greedy(ours, ids[:, :3], 16, cache=DynamicCache(config=ours.config))
    assert torch.equal(cached, greedy(ours, ids[:, :3], 16, use_cache=False)[0])


def test_layer_sinks_equal_gpt_oss_sink_softmax():
    """``rope(sinks=true)``: one learned logit per head joins every softmax row, as gpt-oss's own
    attention function computes it (``s_aux``), run here inside a stock Llama."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    cfg = llama_config()
    stock = LlamaForCausalLM(cfg).eval()
    ours = ph.convert(stock, encoding="rope(sinks=true)").eval()
    perturb(ours)
    with torch.no_grad():
        for p in ours.model.posenc.sinks.values():
            p.copy_(torch.randn_like(p))
    AttentionInterface.register("gpt_oss_sinks", eager_attention_forward)
    AttentionMaskInterface.register("gpt_oss_sinks", eager_mask)
    oracle = LlamaForCausalLM(cfg).eval()
    oracle.load_state_dict(stock.state_dict())
    for i, layer in enumerate(oracle.model.layers):
        layer.self_attn.sinks = ours.model.posenc.sinks[str(i)]
    oracle.set_attn_implementation("gpt_oss_sinks")
    ids = torch.randint(1, V, (2, 16))
    assert_close(logits(ours, ids), logits(oracle, ids), n=llama_n(cfg, 16))
    assert {k for k in ours.state_dict() if "sinks" in k} == {
        "model.posenc.sinks.0",
        "model.posenc.sinks.1",
    }


@pytest.mark.parametrize(
    "preset,depth",
    [("gemma3(window=4)", 6), ("irope(chunk=4)", 4), ("gpt-oss(window=4)", 2)],
)
def test_presets_convert_and_cached_generation_equals_uncached(preset, depth):
    model = ph.convert(LlamaForCausalLM(llama_config(num_hidden_layers=depth)), encoding=preset).eval()
    perturb(model)
    specs = model.config.posenc_layers
    assert any(s.get("window") == 4 or s.get("chunk") == 4 for s in specs)
    ids = torch.randint(1, V, (2, 5))
    cached, cached_logits = greedy(model, ids, 16, cache=DynamicCache(config=model.config))
    uncached, uncached_logits = greedy(model, ids, 16, use_cache=False)
    assert torch.equal(cached, uncached)
    assert_close(cached_logits, uncached_logits, n=llama_n(model.config, 21))


def test_modernbert_local_window_is_inclusive():
    """ModernBERT's local layers see ``|i - j| <= local_attention // 2`` (9 keys for 8): posenc's
    ``window=5`` (``|i - j| < 5``). Parity with stock is in tests/test_hf_families.py; the control
    here: reading HF's half-window as posenc's exclusive ``window=4`` changes the logits."""
    stock = stock_model("modernbert")
    ours = ph.convert(stock, encoding="rope").eval()
    ids = torch.randint(1, stock.config.vocab_size, (1, 20))
    masks = []

    def spy(*args, **kwargs):
        m = ph.mask_interface(*args, **kwargs)
        masks.append(m)
        return m

    AttentionMaskInterface.register("posenc", spy)
    try:
        got = logits(ours, ids)

        def narrow(*args, **kwargs):
            m = ph.mask_interface(*args, **kwargs)
            if m.window is not None:
                m.window -= 1
            return m

        AttentionMaskInterface.register("posenc", narrow)
        off_by_one = logits(ours, ids)
    finally:
        AttentionMaskInterface.register("posenc", ph.mask_interface)
    assert sorted(((m.causal, m.window) for m in masks), key=str) == [(False, 5), (False, None)]
    want = logits(stock, ids)
    assert_close(got, want, n=family_n(stock.config, 20))
    assert (off_by_one - want).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_static_cache_with_sliding_windows_equals_uncached(family):
    """HF's static cache keeps a sliding layer's last W keys in a ring (StaticSlidingWindowLayer)."""
    stock = stock_model(family)
    model = ph.convert(stock).eval()
    ids = torch.randint(1, FV, (2, 5))
    static, static_logits = greedy(model, ids, 16, cache_implementation="static")
    uncached, uncached_logits = greedy(model, ids, 16, use_cache=False)
    assert torch.equal(static, uncached) and torch.equal(
        static, greedy(stock, ids, 16, cache_implementation="static")[0]
    )
    assert_close(static_logits, uncached_logits, n=family_n(model.config, 5 + 16))
