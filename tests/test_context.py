"""The score-side context (:mod:`posenc.context`): what the layer hands an encoding, per call and per block."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import DIM, HEAD_DIM, HEADS, assert_close, attention_n

import posenc
from posenc.base import PositionEncoding
from posenc.context import Context, Tables, table


def test_tables_memo_is_by_identity_of_owner_and_inputs():
    t, made = Tables(), []
    a, b = torch.arange(4), torch.arange(4)  # equal values, different tensors

    def make(tag):
        made.append(tag)
        return tag

    owner = object()
    assert t.get(owner, "cos", (a,), lambda: make(1)) == 1
    assert t.get(owner, "cos", (a,), lambda: make(2)) == 1  # same owner, same tensor: memo
    assert t.get(owner, "cos", (b,), lambda: make(3)) == 3  # another tensor: computed again
    assert t.get(object(), "cos", (a,), lambda: make(4)) == 4  # another owner
    assert t.get(owner, "sin", (a,), lambda: make(5)) == 5  # another table
    assert made == [1, 3, 4, 5] and t.hits == 1
    assert table(None, owner, "cos", (a,), lambda: 7) == 7  # no context: no memo


def test_block_narrows_rows_keys_and_state():
    B, H, Lq, Lk, D = 2, 3, 5, 7, 4
    ctx = Context(
        torch.arange(Lq)[None] + 2,
        torch.arange(Lk)[None],
        x=torch.randn(B, Lq, D),
        q_state={"c": torch.randn(B, H, Lq)},
        k_state={"c": torch.randn(B, H, Lk)},
        mask=torch.ones(1, 1, Lq, Lk, dtype=torch.bool),
        qk=torch.randn(B, H, Lq, Lk),
    )
    b = ctx.block(slice(1, 3), slice(2, 6))
    assert torch.equal(b.q_pos, ctx.q_pos[:, 1:3]) and torch.equal(b.k_pos, ctx.k_pos[:, 2:6])
    assert torch.equal(b.x, ctx.x[:, 1:3])
    assert torch.equal(b.q_state["c"], ctx.q_state["c"][:, :, 1:3])
    assert torch.equal(b.k_state["c"], ctx.k_state["c"][:, :, 2:6])
    assert b.mask is None and b.qk is None  # set per block by the score sum


def test_need_names_the_field_and_the_encoding():
    ctx = Context(torch.arange(3)[None], torch.arange(3)[None])
    with pytest.raises(ValueError, match=r"encoding 'fox' reads ctx\.k_state"):
        ctx.need("k_state", "fox")
    with pytest.raises(ValueError, match=r"encoding 'inkling' reads ctx\.x"):
        ctx.need("x", "inkling")


class _KeyCounter(PositionEncoding):
    """A test encoding that reads the hidden state: bias = w·(c_i − c_j), c the running count of
    tokens whose first feature is positive (per-key state kept by the cache, carried across calls)."""

    name = "_test-key-counter"  # stages READ | BIAS: the methods it defines

    def read_input(self, x, k, v, carry=None):
        step = (x[..., 0] > 0).float()[:, None].expand(-1, self.heads, -1)  # (B, H, L)
        c = step.cumsum(-1) + (0.0 if carry is None else carry)
        return posenc.InputRead(k, v, {"c": c}, c[..., -1:])

    @property
    def relative(self) -> bool:
        return True

    def bias(self, q_pos, k_pos, ctx=None):
        c_q, c_k = ctx.need("q_state", self.name)["c"], ctx.need("k_state", self.name)["c"]
        return 0.5 * (c_q[..., :, None] - c_k[..., None, :])  # (B, H, Lq, Lk)


@pytest.mark.parametrize("window", [None, 3])
def test_per_key_state_and_carry_survive_the_cache(window):
    """A read_input encoding: decoding token by token (per-key state in the cache, carry between
    calls; a rolling window cache keeps the state of the keys it keeps) equals the full pass, on
    every backend that runs it."""
    torch.manual_seed(0)
    enc = _KeyCounter(heads=HEADS, head_dim=HEAD_DIM)
    attn = posenc.Attention(DIM, HEADS, enc, head_dim=HEAD_DIM, window=window)
    L = 9
    x = torch.randn(2, L, DIM)
    n = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L)
    with torch.no_grad():
        full = attn(x, backend="eager")
        for b in posenc.supported_backends(enc):
            assert_close(attn(x, backend=b), full, n=n, msg=b)
        cache = attn.init_cache(2, L)
        steps = torch.cat([attn(x[:, t : t + 1], cache=cache, backend="eager") for t in range(L)], 1)
    assert_close(steps, full, n=n)
    assert cache.state["c"].shape[2] == (L if window is None else window - 1)
    # the bias changes the output (a test encoding whose state were ignored would pass the above)
    plain = posenc.Attention(DIM, HEADS, "nope", head_dim=HEAD_DIM, window=window)
    plain.load_state_dict(attn.state_dict())
    with torch.no_grad():
        assert not torch.allclose(plain(x), full)
