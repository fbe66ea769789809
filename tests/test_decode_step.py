"""A decoding step's two shortcuts: SDPA on a one-row query of grouped heads packs each key
head's query heads as rows (posenc.attend.backends._one_row_packed), and a converted model's
``apply_rotary_pos_emb`` returns q and k as they are for the identity rotation its rotary stand-in
hands it (posenc.hf.off.skip_identity). Each against a direct computation, not posenc's own."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from tests.conftest import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

import posenc
from posenc.attend.backends import _one_row_packed, attend
from posenc.mask import AttentionMask

B, H, HK, DH, LK = 2, 6, 2, 8, 13


def _reference(q, k, v, keep):
    """Softmax attention written out: query head h reads key head h // (H / Hk); ``keep`` (B, Lk)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("padded", [False, True])
def test_one_row_of_grouped_heads_is_the_same_attention(padded):
    torch.manual_seed(0)
    q, k, v = torch.randn(B, H, 1, DH), torch.randn(B, HK, LK, DH), torch.randn(B, HK, LK, DH)
    keep = torch.ones(B, LK, dtype=torch.bool)
    if padded:
        keep[1, :4] = False  # a left-padded row
    enc = posenc.build("nope", heads=H, head_dim=DH)
    mask = AttentionMask(causal=True, offset=LK - 1, key_padding=keep if padded else None)
    pos = torch.arange(LK)
    got = attend(enc, q, k, v, pos[-1:], pos, mask, backend="sdpa")
    assert_close(got, _reference(q, k, v, keep), n=DH + 2 * LK)
    # the shortcut ran: the packed query has the key heads' count, each group's heads as rows
    dense = mask.dense(1, LK)
    packed = _one_row_packed(q, k, {"attn_mask": dense})
    assert packed is not None and packed.shape == (B, HK, H // HK, DH)
    assert torch.equal(packed[:, 1, 2], q[:, 1 * (H // HK) + 2, 0])


def test_one_row_packing_refuses_what_would_change_the_attention():
    q, k = torch.randn(B, H, 1, DH), torch.randn(B, HK, LK, DH)
    assert _one_row_packed(torch.randn(B, H, 2, DH), k, {}) is None  # more than one row
    assert _one_row_packed(q, torch.randn(B, H, LK, DH), {}) is None  # ungrouped heads
    assert _one_row_packed(q, k, {"is_causal": True}) is None
    assert _one_row_packed(q, k, {"dropout_p": 0.1}) is None
    assert _one_row_packed(q, k, {"attn_mask": torch.zeros(B, H, 1, LK)}) is None  # per-head (sinks)
    assert _one_row_packed(q, k, {"dropout_p": 0.0, "attn_mask": None}) is not None


class _Count(TorchDispatchMode):
    """Counts the aten ops a block runs."""

    def __enter__(self):
        self.ops = collections.Counter()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=16,
                      num_hidden_layers=2, vocab_size=64, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def test_the_identity_rotation_is_skipped_and_any_other_call_rotates():
    pytest.importorskip("transformers")
    import transformers.models.llama.modeling_llama as ml

    import posenc.hf as ph
    from posenc.hf.off import RotaryOff

    stock = _llama()
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        want = stock(ids).logits
    ours = ph.convert(_llama())
    ph.convert(_llama())  # (a second conversion does not wrap the wrapper)
    fn = ml.apply_rotary_pos_emb
    assert getattr(fn, "posenc_skips_identity", False)
    assert getattr(fn.__wrapped__, "posenc_skips_identity", False) is False
    # in the converted model's forward HF's rotate_half no longer runs (its neg, twice a layer in stock)
    negs = {}
    for name, model in (("stock", stock), ("ours", ours)):
        with torch.no_grad(), _Count() as counted:
            model(ids)
        negs[name] = counted.ops["aten.neg.default"]
    assert negs["stock"] >= 2 * 2 and negs["ours"] <= 1, negs  # (ours: the sine table's sign, once a forward)
    q, k = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8)
    cos, sin = RotaryOff(8)(q, torch.arange(12)[None])
    got_q, got_k = fn(q, k, cos, sin)
    assert got_q is q and got_k is k  # nothing computed for the marked identity
    kt = torch.randn(1, 12, 2, 8).transpose(1, 2)  # (as HF's projection hands the keys: a transposed view)
    got_k = fn(q, kt, cos, sin)[1]
    assert got_k.is_contiguous() and torch.equal(got_k, kt)  # (what HF's cache update copies fastest)
    # an unmarked (cos, sin): HF's rotation, written out (x·cos + rotate_half(x)·sin)
    ang = torch.arange(12)[:, None] * torch.tensor([1.0, 0.1, 0.01, 0.001])
    c, s = torch.cat((ang.cos(), ang.cos()), -1)[None], torch.cat((ang.sin(), ang.sin()), -1)[None]
    half = lambda x: torch.cat((-x[..., 4:], x[..., :4]), -1)  # noqa: E731
    rq, rk = fn(q, k, c, s)
    assert torch.equal(rq, q * c[:, None] + half(q) * s[:, None])
    assert torch.equal(rk, k * c[:, None] + half(k) * s[:, None])
    with torch.no_grad():  # a stock model in the same process, and the converted one, as before
        assert torch.equal(stock(ids).logits, want)
        assert torch.equal(ours(ids).logits, want)


def _module(source: str):
    import types

    mod = types.ModuleType("fake_modeling")
    exec(compile(source, "fake_modeling", "exec"), mod.__dict__)
    return mod


ATTN = """
import torch
from torch import nn
class Attn(nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)
"""


def test_only_the_q_k_cos_sin_form_is_wrapped():
    from posenc.hf.off import RotaryOff, skip_identity

    other = _module("def apply_rotary_pos_emb(x, cos, sin):\n    return x * cos + x * sin\n" + ATTN)
    before = other.apply_rotary_pos_emb
    skip_identity([other.Attn()])
    assert other.apply_rotary_pos_emb is before  # (one tensor at a time: some families' form)
    optional = _module("def apply_rotary_pos_emb(q, k=None, cos=None, sin=None):\n    return q, k\n" + ATTN)
    before = optional.apply_rotary_pos_emb
    skip_identity([optional.Attn()])
    assert optional.apply_rotary_pos_emb is before
    plain = _module("def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):\n"
                    "    return q * cos + 1, k * cos + 1\n" + ATTN)  # fmt: skip
    skip_identity([plain.Attn(), plain.Attn()])
    wrapped = plain.apply_rotary_pos_emb
    skip_identity([plain.Attn()])
    assert plain.apply_rotary_pos_emb is wrapped  # idempotent
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4)
    cos, sin = RotaryOff(4)(q, torch.arange(3)[None])
    assert plain.Attn()(q, k, cos, sin)[0] is q
    assert torch.equal(plain.Attn()(q, k, torch.ones(1, 3, 4), sin)[0], q + 1)  # unmarked: the function runs
