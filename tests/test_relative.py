"""Shaw et al. relative positions (``shaw``): parity with tensor2tensor, Music Transformer, NEZHA.

tensor2tensor is TensorFlow 1 code and is not installable next to torch, so its functions
are transcribed here line by line (``common_attention.py``), with every ``(L, L, Dh)``
tensor they build: the unoptimised oracle the gather/scatter fast path is checked against.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tests.conftest import assert_close, attention_n

import posenc


# --------------------------------------------------------------------------- tensor2tensor
def _generate_relative_positions_matrix(length_q, length_k, max_relative_position):
    range_vec_k = torch.arange(length_k)
    range_vec_q = range_vec_k[-length_q:]
    distance_mat = range_vec_k[None, :] - range_vec_q[:, None]
    distance_mat_clipped = distance_mat.clamp(-max_relative_position, max_relative_position)
    return distance_mat_clipped + max_relative_position


def _generate_relative_positions_embeddings(length_q, length_k, table, max_relative_position):
    """``table``: ``(2k+1, depth)`` -> ``(length_q, length_k, depth)``."""
    return table[_generate_relative_positions_matrix(length_q, length_k, max_relative_position)]


def _relative_attention_inner(x, y, z, transpose):
    """x ``[B, H, Lq, Lk or D]``, y ``[B, H, Lk, D]``, z ``[Lq, Lk, D]``."""
    batch_size, heads, length = x.shape[:3]
    xy = x @ (y.transpose(-1, -2) if transpose else y)
    x_t = x.permute(2, 0, 1, 3).reshape(length, heads * batch_size, -1)
    x_tz = x_t @ (z.transpose(-1, -2) if transpose else z)
    x_tz_t = x_tz.reshape(length, batch_size, heads, -1).permute(1, 2, 0, 3)
    return xy + x_tz_t


def dot_product_attention_relative(q, k, v, bias, rel_k, rel_v, max_relative_position):
    """``common_attention.dot_product_attention_relative`` (q already scaled by Dh^-0.5)."""
    Lq, Lk = q.shape[2], k.shape[2]
    relations_keys = _generate_relative_positions_embeddings(Lq, Lk, rel_k, max_relative_position)
    relations_values = _generate_relative_positions_embeddings(Lq, Lk, rel_v, max_relative_position)
    logits = _relative_attention_inner(q, k, relations_keys, True)
    if bias is not None:
        logits = logits + bias
    weights = torch.softmax(logits, dim=-1)
    return _relative_attention_inner(weights, v, relations_values, False)


# --------------------------------------------------------------------------- Music Transformer
def get_relative_embeddings_left(embeddings, max_relative_position, length):
    """``[max_relative_position, D]`` (last row = distance 0) -> ``[length, D]``; beyond: zeros."""
    pad_length = max(length - max_relative_position, 0)
    start_slice = max(max_relative_position - length, 0)
    padded = F.pad(embeddings, (0, 0, pad_length, 0))
    return padded[start_slice : start_slice + length]


def _relative_position_to_absolute_position_masked(x):
    batch, heads, length, _ = x.shape
    x = F.pad(x, (1, 0))
    x = x.reshape(batch, heads, 1 + length, length)
    return x[:, :, 1:]


def _absolute_position_to_relative_position_masked(x):
    batch, heads, length, _ = x.shape
    x = F.pad(x, (0, 0, 1, 0))
    x = x.reshape(batch, heads, length, length + 1)
    return x[:, :, :, 1:]


def dot_product_self_attention_relative_v2(q, k, v, key_emb, value_emb, max_relative_position):
    """Masked (causal) relative attention with the skew, keys and values (q pre-scaled)."""
    length = q.shape[2]
    bias = torch.triu(torch.full((length, length), -1e9), diagonal=1)
    logits = q @ k.transpose(-1, -2)
    rel_k = get_relative_embeddings_left(key_emb, max_relative_position, length)
    rel_logits = q @ rel_k.t()
    logits = logits + _relative_position_to_absolute_position_masked(rel_logits) + bias
    weights = torch.softmax(logits, dim=-1)
    ret = weights @ v
    relative_weights = _absolute_position_to_relative_position_masked(weights)
    rel_v = get_relative_embeddings_left(value_emb, max_relative_position, length)
    return ret + relative_weights @ rel_v


# --------------------------------------------------------------------------- helpers
def _qkv(attn, x):
    B, L, _ = x.shape
    H, Dh = attn.heads, attn.head_dim

    def split(t):
        return t.view(B, L, H, Dh).transpose(1, 2)

    return split(attn.q_proj(x)), split(attn.k_proj(x)), split(attn.v_proj(x))


def _out(attn, o):
    B, H, L, Dh = o.shape
    return attn.o_proj(o.transpose(1, 2).reshape(B, L, H * Dh))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["chunked", "eager"])
def test_parity_with_tensor2tensor(causal, backend):
    torch.manual_seed(0)
    k_max, L, H, Dh = 3, 9, 4, 8
    attn = posenc.Attention(H * Dh, H, "shaw", causal=causal, max_relative_position=k_max, chunk_size=4)
    enc = attn.encoding
    x = torch.randn(2, L, H * Dh)
    with torch.no_grad():
        q, k, v = _qkv(attn, x)
        bias = torch.triu(torch.full((L, L), -1e9), diagonal=1) if causal else None
        ref = _out(attn, dot_product_attention_relative(q * Dh**-0.5, k, v, bias, enc.rel_k, enc.rel_v, k_max))
        got = attn(x, backend=backend)
    assert_close(got, ref, n=attention_n(dim=H * Dh, head_dim=Dh, length=L) + Dh + L)


def test_per_head_tables_against_transcription():
    """per_head=True: tensor2tensor's formula applied head by head with each head's tables."""
    torch.manual_seed(1)
    k_max, L, H, Dh = 2, 7, 3, 4
    attn = posenc.Attention(H * Dh, H, "shaw", causal=False, max_relative_position=k_max, per_head=True)
    enc = attn.encoding
    assert enc.rel_k.shape == (H, 2 * k_max + 1, Dh)
    x = torch.randn(2, L, H * Dh)
    with torch.no_grad():
        q, k, v = _qkv(attn, x)
        heads = [
            dot_product_attention_relative(
                q[:, h : h + 1] * Dh**-0.5, k[:, h : h + 1], v[:, h : h + 1], None, enc.rel_k[h], enc.rel_v[h], k_max
            )
            for h in range(H)
        ]
        ref = _out(attn, torch.cat(heads, 1))
        assert_close(attn(x), ref, n=attention_n(dim=H * Dh, head_dim=Dh, length=L) + Dh + L)


@pytest.mark.parametrize("L", [6, 8])
def test_causal_parity_with_music_transformer_skew(L):
    """Music Transformer's skew equals the gather when no distance is clipped (L <= k + 1).

    Past the table, Music Transformer uses zero vectors where Shaw clips; with ``L - 1 <= k``
    the two definitions coincide, so the comparison is exact.
    """
    torch.manual_seed(2)
    k_max, H, Dh = 7, 2, 8
    attn = posenc.Attention(H * Dh, H, "shaw", causal=True, max_relative_position=k_max)
    enc = attn.encoding
    x = torch.randn(3, L, H * Dh)
    with torch.no_grad():
        q, k, v = _qkv(attn, x)
        # rows for distances -k .. 0 (last row = distance 0), as get_relative_embeddings_left wants
        key_emb, value_emb = enc.rel_k[: k_max + 1], enc.rel_v[: k_max + 1]
        ref = _out(attn, dot_product_self_attention_relative_v2(q * Dh**-0.5, k, v, key_emb, value_emb, k_max + 1))
        assert_close(attn(x, backend="chunked"), ref, n=attention_n(dim=H * Dh, head_dim=Dh, length=L) + Dh + L)


def test_nezha_sinusoidal_table():
    """NEZHA ``_generate_relative_positions_embeddings``: row r is the interleaved sinusoid of r."""
    k_max, depth = 5, 6
    enc = posenc.build("shaw", heads=2, head_dim=depth, max_relative_position=k_max, table="sinusoidal")
    vocab_size = 2 * k_max + 1
    table = np.zeros([vocab_size, depth])
    for pos in range(vocab_size):
        for i in range(depth // 2):
            table[pos, 2 * i] = np.sin(pos / np.power(10000, 2 * i / depth))
            table[pos, 2 * i + 1] = np.cos(pos / np.power(10000, 2 * i / depth))
    # NEZHA's angles in float64, ours rounded once: |Δangle| <= eps·2k (angles <= 2k), sin 1-Lipschitz
    assert_close(enc.rel_k, torch.tensor(table, dtype=torch.float32), n=1, magnitude=2 * k_max)
    assert enc.rel_v is enc.rel_k and not list(enc.parameters())
    # the table is a rebuildable non-persistent buffer
    assert "rel_k" not in enc.state_dict()
    enc.rel_k = torch.zeros_like(enc.rel_k)
    enc.init_buffers()
    assert_close(enc.rel_k, torch.tensor(table, dtype=torch.float32), n=1, magnitude=2 * k_max)


def test_nezha_attention_matches_tensor2tensor():
    torch.manual_seed(3)
    k_max, L, H, Dh = 4, 10, 2, 8
    attn = posenc.Attention(H * Dh, H, "shaw", causal=False, max_relative_position=k_max, table="sinusoidal")
    x = torch.randn(1, L, H * Dh)
    with torch.no_grad():
        q, k, v = _qkv(attn, x)
        tab = attn.encoding.rel_k
        ref = _out(attn, dot_product_attention_relative(q * Dh**-0.5, k, v, None, tab, tab, k_max))
        assert_close(attn(x), ref, n=attention_n(dim=H * Dh, head_dim=Dh, length=L) + Dh + L)


def test_clipping_beyond_k_and_shift_invariance():
    torch.manual_seed(4)
    enc = posenc.build("shaw", heads=2, head_dim=4, max_relative_position=2)
    q_pos, k_pos = torch.tensor([[3, 10]]), torch.tensor([[0, 4, 20]])
    idx = enc.rel_index(q_pos, k_pos)
    assert idx.tolist() == [[[0, 3, 4], [0, 0, 4]]]
    q, k = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 3, 4)
    assert torch.equal(enc.score_terms(q, k, q_pos, k_pos), enc.score_terms(q, k, q_pos + 7, k_pos + 7))


def test_relative_backend_has_no_L2_Dh_tensor():
    """Peak extra memory of one forward stays far below an (L, L, Dh) float tensor."""
    torch.manual_seed(5)
    L, H, Dh = 512, 2, 64
    attn = posenc.Attention(H * Dh, H, "shaw", causal=True, backend="chunked", max_relative_position=64)
    x = torch.randn(1, L, H * Dh)
    sizes = []

    class Track(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    sizes.append(t.numel())
            return out

    with torch.no_grad(), Track():
        attn(x)
    assert max(sizes) < L * L * Dh / 16, max(sizes)


def test_bad_options():
    with pytest.raises(ValueError, match="max_relative_position"):
        posenc.build("shaw", heads=2, head_dim=4, max_relative_position=0)
    with pytest.raises(ValueError, match="table"):
        posenc.build("shaw", heads=2, head_dim=4, table="rope")
    with pytest.raises(ValueError, match="per_head"):
        posenc.build("shaw", heads=2, head_dim=4, table="sinusoidal", per_head=True)
    enc = posenc.build("shaw", heads=2, head_dim=4)
    with pytest.raises(ValueError, match="lengths"):
        enc.score_terms(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.arange(2)[None], torch.arange(3)[None])
    assert enc.scale == pytest.approx(1 / math.sqrt(4))
