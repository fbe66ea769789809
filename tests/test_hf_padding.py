"""Left-padded batches in converted HF models: each row's real tokens as if the row ran alone.

HF models are called with a 2-D ``attention_mask`` and, outside ``generate``, no
``position_ids`` (the model then numbers the tokens ``0 .. L-1``, pads included). posenc's HF
adapter numbers them from the mask instead, as ``generate`` does: a token's position is the
number of real tokens before it, a pad gets position 0. So an encoding that reads absolute
positions (``learned``, ``sinusoidal``, ``tupe``, ...) or neighbouring inputs (``conv``, whose
zero padding marks where the sequence starts; ``recurrent``) gives a left-padded row's real
tokens what it gives the row alone.

Oracles: each prompt run alone, unpadded; generation without a cache; the model's forward
with the position ids ``generate`` would pass. Tiny random configs (vocabulary 256, width 32,
2 layers, 4 heads), no download.
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close, attention_n

import posenc

transformers = pytest.importorskip("transformers")
from tests.test_hf import TINY_DECODER, gpt2_config, greedy, llama_n, logits, perturb  # noqa: E402
from transformers import (  # noqa: E402
    DynamicCache,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

import posenc.hf as ph  # noqa: E402

V = 256
CONFIG = TINY_DECODER | dict(vocab_size=V)  # width 32, 2 layers, 4 heads (2 key heads)
ENCODINGS = list(posenc.available())  # every one runs in a converted Llama
INPUT_STAGE = [n for n in ENCODINGS if posenc.get_class(n).stages & posenc.Stage.INPUT]
PAD = 5  # pads before the short prompt


def llama(name: str, **kw) -> torch.nn.Module:
    """A tiny Llama converted to ``name``, its encoding parameters moved off their init."""
    heads = dict(num_key_value_heads=4) if name.startswith("deberta") else {}  # (shared W_K: no grouped heads)
    model = ph.convert(LlamaForCausalLM(LlamaConfig(**(CONFIG | heads | kw))), encoding=name).eval()
    perturb(model)
    return model


def prompts(long: int = 9, short: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a, b, ids, mask)``: two prompts and their left-padded batch ``(2, long)`` with its mask."""
    a, b = torch.randint(1, V, (1, long)), torch.randint(1, V, (1, short))
    pads = torch.zeros(1, long - short, dtype=torch.long)
    ids = torch.cat((a, torch.cat((pads, b), 1)))
    mask = torch.ones_like(ids)
    mask[1, : long - short] = 0
    return a, b, ids, mask


@pytest.mark.parametrize("name", ENCODINGS)
def test_left_padded_forward_equals_each_row_alone(name):
    # an HF-style call: attention_mask, no position_ids
    torch.manual_seed(0)
    model = llama(name)
    a, b, ids, mask = prompts(4 + PAD, 4)
    got = logits(model, ids, attention_mask=mask)
    n = llama_n(model.config, ids.shape[1])
    assert_close(got[0], logits(model, a)[0], n=n, msg=f"{name}: the unpadded row")
    assert_close(got[1, PAD:], logits(model, b)[0], n=n, msg=f"{name}: the padded row's real tokens")
    # the position ids generate passes (from the mask, pads at 0) give the same logits, pads included
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    assert torch.equal(logits(model, ids, attention_mask=mask, position_ids=pos), got)


@pytest.mark.parametrize("name", ["learned", "sinusoidal", "conv", "recurrent"])
def test_gpt2_left_padded_forward_equals_each_row_alone(name):
    torch.manual_seed(0)
    model = ph.convert(GPT2LMHeadModel(gpt2_config(vocab_size=V)), encoding=name).eval()
    perturb(model)
    a, b, ids, mask = prompts(4 + PAD, 4)
    got = logits(model, ids, attention_mask=mask)
    D = model.config.n_embd  # (tests/test_hf.py's count for GPT-2)
    n = model.config.n_layer * (attention_n(dim=D, length=ids.shape[1]) + 7 * D) + 2 * D
    assert_close(got[0], logits(model, a)[0], n=n)
    assert_close(got[1, PAD:], logits(model, b)[0], n=n)


@pytest.mark.parametrize("name", ["rope", *INPUT_STAGE])
def test_left_padded_cached_generation_equals_uncached_and_each_row_alone(name):
    torch.manual_seed(0)
    model = llama(name)
    a, b, ids, mask = prompts(4 + PAD, 4)
    new = 6
    cached, cached_logits = greedy(model, ids, new, attention_mask=mask, cache=DynamicCache(config=model.config))
    uncached, uncached_logits = greedy(model, ids, new, attention_mask=mask, use_cache=False)
    n = llama_n(model.config, ids.shape[1] + new)
    assert torch.equal(cached, uncached)
    assert_close(cached_logits, uncached_logits, n=n)
    alone, alone_logits = greedy(model, b, new)
    assert torch.equal(cached[1, PAD:], alone[0])
    assert_close(cached_logits[1], alone_logits[0], n=n)


@pytest.mark.parametrize("name", ["rope", "learned", "conv"])
def test_left_padded_decoding_without_position_ids_equals_the_full_forward(name):
    # a hand-written decoding loop, as HF models are called: a growing mask, a cache, no position_ids
    torch.manual_seed(0)
    model = llama(name)
    _, _, ids, mask = prompts(3 + PAD, 3)
    tail = torch.randint(1, V, (2, 4))
    full_ids, full_mask = torch.cat((ids, tail), 1), torch.cat((mask, torch.ones_like(tail)), 1)
    want = logits(model, full_ids, attention_mask=full_mask)
    cache = DynamicCache(config=model.config)
    steps = [logits(model, ids, attention_mask=mask, cache=cache)]
    for t in range(tail.shape[1]):
        width = ids.shape[1] + t + 1
        steps.append(logits(model, tail[:, t : t + 1], attention_mask=full_mask[:, :width], cache=cache))
    got = torch.cat(steps, 1)
    real = full_mask.bool()
    assert_close(got[real], want[real], n=llama_n(model.config, full_ids.shape[1]))


@pytest.mark.parametrize("name", ["rope", "conv", "learned"])
def test_left_padded_generation_past_a_sliding_window_equals_uncached(name):
    # HF's sliding-window cache drops its oldest keys (kv_offset > 0); the padding of the keys
    # it still holds is the mask's columns from kv_offset on
    torch.manual_seed(0)
    stock = MistralForCausalLM(MistralConfig(**CONFIG, sliding_window=6)).eval()
    model = ph.convert(stock, encoding=name).eval()
    perturb(model)
    _, b, ids, mask = prompts(4 + PAD, 4)
    new = 10
    cache = DynamicCache(config=model.config)
    cached, cached_logits = greedy(model, ids, new, attention_mask=mask, cache=cache)
    assert type(cache.layers[0]).__name__ == "DynamicSlidingWindowLayer"
    uncached, uncached_logits = greedy(model, ids, new, attention_mask=mask, use_cache=False)
    n = llama_n(model.config, ids.shape[1] + new)
    assert torch.equal(cached, uncached)
    assert_close(cached_logits, uncached_logits, n=n)
    alone, alone_logits = greedy(model, b, new, cache=DynamicCache(config=model.config))
    assert torch.equal(cached[1, PAD:], alone[0])
    assert_close(cached_logits[1], alone_logits[0], n=n)
