"""A converted model's HF cache holds rotated keys (posenc.hf.keys): decoding rotates only the new ones.

The reference is stock HF: a stock Llama's cache holds keys after its own rotary embedding, and
a converted model's cache must hold the same tensors; generation (greedy, beam search, a cropped
cache) equals stock's; the exact path (raw keys, every one rotated again) still serves what it
cannot: encodings whose rotation depends on the call (dynamic NTK), static caches, a cache
filled before conversion.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    StaticCache,
)

import posenc.hf  # noqa: E402
from posenc.hf.attention import layer_encoding  # noqa: E402
from posenc.hf.keys import MARK  # noqa: E402

TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))


def _llama(rope_parameters=None, **kw):
    torch.manual_seed(0)
    cfg = LlamaConfig(**{
        "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, **kw,
    })  # fmt: skip
    if rope_parameters is not None:
        cfg.rope_parameters = rope_parameters
    return LlamaForCausalLM(cfg).eval()


def _pair(model):
    twin = type(model)(model.config).eval()
    twin.load_state_dict(model.state_dict())
    return model, posenc.hf.convert(twin)


ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_cache_holds_the_keys_a_stock_cache_holds(rope):
    """After a prompt and two decoding steps, every layer's cached keys equal stock HF's (which
    rotates before caching); the logits of each step equal stock's; the layers carry the mark.
    (Values within rounding: a decoding step's one-row attention packs grouped heads, which
    rounds apart from stock's ``enable_gqa`` call, and the next layer's values follow.)"""
    stock, ours = _pair(_llama(ROPES[rope]))
    caches = (DynamicCache(config=stock.config), DynamicCache(config=ours.config))
    with torch.no_grad():
        for part in (TOKENS[:, :16], TOKENS[:, 16:17], TOKENS[:, 17:18]):
            a = stock(part, cache=caches[0], use_cache=True).logits
            b = ours(part, cache=caches[1], use_cache=True).logits
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    for i, (s, o) in enumerate(zip(caches[0].layers, caches[1].layers)):
        torch.testing.assert_close(o.keys, s.keys, rtol=0, atol=1e-6, msg=f"layer {i}")
        torch.testing.assert_close(o.values, s.values, rtol=0, atol=1e-6, msg=f"layer {i}")
        assert o.__dict__[MARK] is layer_encoding(ours.model.layers[i].self_attn)


def test_generation_greedy_beams_and_crop_equal_stock():
    """Greedy and beam-search generation (the cache is reordered between steps) give stock's
    tokens; a cache cropped back (assisted decoding) continues as an uncropped one does."""
    stock, ours = _pair(_llama(ROPES["yarn"]))
    prompt = TOKENS[:, :10]
    for kw in ({"do_sample": False}, {"do_sample": False, "num_beams": 3}):
        a = stock.generate(prompt, max_new_tokens=8, min_new_tokens=8, **kw)
        b = ours.generate(prompt, max_new_tokens=8, min_new_tokens=8, **kw)
        assert torch.equal(a, b), kw
    with torch.no_grad():
        cache = DynamicCache(config=ours.config)
        ours(TOKENS[:, :20], cache=cache, use_cache=True)
        cache.crop(-8)  # back to 12 tokens
        got = ours(TOKENS[:, 12:14], cache=cache, use_cache=True).logits
        want = ours(TOKENS[:, :14]).logits[:, 12:14]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_sliding_window_layers_keep_rotated_keys():
    """A sliding-window model (Mistral, window 6) decoding past its window equals the full forward."""
    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=6,
    )  # fmt: skip
    stock, ours = _pair(MistralForCausalLM(cfg).eval())
    with torch.no_grad():
        cache = DynamicCache(config=ours.config)
        steps = [ours(TOKENS[:, :9], cache=cache, use_cache=True).logits[:, -1]]
        steps += [ours(TOKENS[:, i : i + 1], cache=cache, use_cache=True).logits[:, -1] for i in range(9, 16)]
        full = stock(TOKENS[:, :16]).logits[:, 8:16]
    torch.testing.assert_close(torch.stack(steps, 1), full, rtol=0, atol=1e-5)
    assert all(MARK in layer.__dict__ for layer in cache.layers)


def test_decoding_with_autograd_on_equals_no_grad():
    """Called without no_grad (keys need grad): the rotated rows replace the cache's tensor
    instead of being written into it; logits and the gradient path are those of no_grad."""
    _, ours = _pair(_llama())
    cache = DynamicCache(config=ours.config)
    ours(TOKENS[:, :8], cache=cache, use_cache=True)
    out = ours(TOKENS[:, 8:9], cache=cache, use_cache=True).logits
    out.sum().backward()
    with torch.no_grad():
        want = ours(TOKENS[:, :9]).logits[:, 8:9]
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=1e-5)
    assert ours.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_exact_path_where_keys_cannot_be_kept_rotated():
    """Dynamic NTK (its angles depend on the call's length) and a static cache keep the exact
    path: cached == uncached, and no mark on the cache."""
    _, ours = _pair(_llama({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))
    with torch.no_grad():
        cache = DynamicCache(config=ours.config)
        ours(TOKENS[:, :12], cache=cache, use_cache=True)
        got = ours(TOKENS[:, 12:13], cache=cache, use_cache=True).logits
        want = ours(TOKENS[:, :13]).logits[:, 12:13]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not any(MARK in layer.__dict__ for layer in cache.layers)
    # a static cache (updated in place, free slots after the tokens): raw keys, the exact path
    _, rope = _pair(_llama())
    with torch.no_grad():
        cache = StaticCache(config=rope.config, max_cache_len=32)
        rope(TOKENS[:, :12], cache=cache, use_cache=True)
        got = rope(TOKENS[:, 12:13], cache=cache, use_cache=True).logits
        want = rope(TOKENS[:, :13]).logits[:, 12:13]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not any(MARK in layer.__dict__ for layer in cache.layers)


def test_swapping_the_encoding_under_a_live_cache_is_refused():
    """A cache whose keys one encoding rotated is not continued by another (their angles differ)."""
    _, ours = _pair(_llama())
    with torch.no_grad():
        cache = DynamicCache(config=ours.config)
        ours(TOKENS[:, :8], cache=cache, use_cache=True)
        swapped = posenc.hf.convert(ours, encoding="rope", base=500.0)
        with pytest.raises(ValueError, match="holds keys rotated by"):
            swapped(TOKENS[:, 8:9], cache=cache, use_cache=True)


def test_a_nan_written_to_the_cache_stays_reported():
    """The backends read only a step's new keys for NaN (AttentionMask.checked_keys); what the
    rows written earlier held is kept on the cache layer: a NaN in a prompt token's keys makes
    later step of that batch row NaN, as the full forward is (the check of every key of the call);
    the other row stays as it is."""
    _, ours = _pair(_llama())
    with torch.no_grad():
        ours.model.embed_tokens.weight[TOKENS[0, 2]] = float("nan")
        cache = DynamicCache(config=ours.config)
        ours(TOKENS[:, :8], cache=cache, use_cache=True)
        step = ours(TOKENS[:, 8:9], cache=cache, use_cache=True).logits
        full = ours(TOKENS[:, :9]).logits[:, 8:9]
    assert TOKENS[0, 2] not in TOKENS[1, :9]  # (row 1 never reads the NaN embedding)
    assert torch.isnan(full[0]).all() and torch.isfinite(full[1]).all()
    assert torch.equal(torch.isnan(step), torch.isnan(full))
    torch.testing.assert_close(step[1], full[1], rtol=0, atol=1e-5)
    for layer in cache.layers:  # what the rows written held, per batch row
        flag = layer.__dict__["posenc_nonfinite"]
        assert torch.isnan(flag[0]).all() and torch.equal(flag[1], torch.zeros_like(flag[1]))


def test_an_inf_after_finite_steps_stays_reported():
    """Steps whose rows are all finite keep no flag tensor (CPU: posenc.kernels.flash.known_finite);
    an inf in a later step's keys makes that batch row NaN from then on, as the full forward does."""
    _, ours = _pair(_llama())
    ids = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(2))
    ids[0, 10] = 95  # (the one token whose embedding turns inf)
    with torch.no_grad():
        cache = DynamicCache(config=ours.config)
        ours(ids[:, :8], cache=cache, use_cache=True)
        ours(ids[:, 8:10], cache=cache, use_cache=True)
        assert all(layer.__dict__["posenc_nonfinite"] == "finite" for layer in cache.layers)
        ours.model.embed_tokens.weight[95] = float("inf")
        steps = [ours(ids[:, i : i + 1], cache=cache, use_cache=True).logits for i in (10, 11)]
        full = ours(ids[:, :12]).logits[:, 10:12]
    assert torch.isnan(full[0]).all() and torch.isfinite(full[1]).all()
    step = torch.cat(steps, 1)
    assert torch.equal(torch.isnan(step), torch.isnan(full))
    torch.testing.assert_close(step[1], full[1], rtol=0, atol=1e-5)


def test_a_nan_query_is_reported_and_leaves_the_cache_flag_clean():
    """The cache's check reads a step's queries with its new rows (one host read on CPU:
    ``AttentionMask.checked_queries``); a NaN in the queries alone makes that head NaN, as the
    full forward does, and does not mark the cache: the next finite step is finite again."""
    _, ours = _pair(_llama(num_hidden_layers=1, attention_bias=True))
    heads = []
    ours.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda m, a: heads.append(a[0].detach()))
    bias = ours.model.layers[0].self_attn.q_proj.bias
    with torch.no_grad():
        cache = DynamicCache(config=ours.config)
        ours(TOKENS[:, :8], cache=cache, use_cache=True)
        kept = bias.clone()
        bias[:8] = float("nan")  # (query head 0 of 4, head_dim 8)
        ours(TOKENS[:, 8:9], cache=cache, use_cache=True)
        step = heads[-1].view(2, 1, 4, 8)
        assert cache.layers[0].__dict__["posenc_nonfinite"] == "finite"  # (the rows written are finite)
        ours(TOKENS[:, :9])
        full = heads[-1][:, 8:9].view(2, 1, 4, 8)
        bias.copy_(kept)
        after = ours(TOKENS[:, 9:10], cache=cache, use_cache=True).logits
    assert torch.isnan(step[:, :, 0]).all() and torch.isfinite(step[:, :, 1:]).all()
    assert torch.equal(torch.isnan(step), torch.isnan(full))
    torch.testing.assert_close(step[:, :, 1:], full[:, :, 1:], rtol=0, atol=1e-5)
    assert torch.isfinite(after).all()


def test_checked_queries_and_keys_leave_nothing_to_read():
    """``propagate_nonfinite`` returns the output itself when the cache checked every key and the
    queries (a NaN in them is then the cache's to report); with the queries unchecked it reads them."""
    from posenc.kernels.flash import propagate_nonfinite
    from posenc.mask import AttentionMask

    q, k, v, out = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 1, 4)
    q[0, 1] = float("nan")
    assert propagate_nonfinite(out, q, k, v, 5, True) is out
    got = propagate_nonfinite(out, q, k, v, 5, False)
    assert torch.isnan(got[0, 1]).all() and torch.equal(got[0, 0], out[0, 0])
    mask = AttentionMask(causal=True, offset=4, checked_keys=5, checked_queries=True)
    assert mask.narrow(0, 1, 5).checked_queries and mask.narrow(0, 1, 5).checked_keys == 4
    with pytest.raises(ValueError, match="checked_queries must be a bool"):
        AttentionMask(checked_queries=1)


def test_sink_window_stream_follows_its_evictions():
    """``posenc extend``'s sink-window stream evicts rows and gives positions inside the cache
    (StreamingLLM's pos_shift): every block's logits equal the stock model run without a cache
    on the tokens the cache kept plus the block, at positions 0, 1, ... (its cache keeps raw keys:
    posenc.hf.keys.keep_raw_keys). One layer, so that a kept token's keys do not depend on the
    tokens evicted before it (with more, StreamingLLM keeps what they were computed with)."""
    from posenc.extend.evaluate import _hf_stream, sink_block

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    stock, ours = _pair(LlamaForCausalLM(cfg).eval())
    sink = {"sinks": 2, "window": 8}
    ids = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(1))
    kept, s, block = [], 0, sink_block(sink["window"])
    with torch.no_grad():
        for logits, _ in _hf_stream(ours, ids, 4, sink):
            if len(kept) >= sink["sinks"] + sink["window"]:  # (the stream's eviction, replayed)
                kept = kept[: sink["sinks"]] + kept[len(kept) - (sink["window"] - block) :]
            m = logits.shape[0]
            seq = torch.tensor(kept + ids[s : s + m].tolist())[None]
            want = stock(seq, position_ids=torch.arange(seq.shape[1])[None]).logits[0, -m:]
            torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)
            kept += ids[s : s + m].tolist()
            s += m
    assert s == 30 and len(kept) < 30  # (it evicted)


def test_keep_raw_keys_is_refused_on_a_cache_holding_rotated_keys():
    """``keep_raw_keys`` on a cache a converted model already filled with rotated keys: one clear error
    (its rows could not be rotated again at other positions)."""
    from posenc.hf.keys import keep_raw_keys

    _, ours = _pair(_llama())
    cache = DynamicCache(config=ours.config)
    with torch.no_grad():
        ours(TOKENS[:, :4], cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="already holds rotated keys"):
        keep_raw_keys(cache)
    assert keep_raw_keys(DynamicCache(config=ours.config)).__dict__["posenc_raw_keys"] is True
