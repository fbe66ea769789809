"""The ``maps`` backend (:mod:`posenc.kernels.maps`): an encoding's score maps through the CPU's
fused kernel, each over only the keys it holds, merged by log-sum-exp.

Against the eager oracle (every pair's score from ``qk_scores``, one softmax): block sizes on
both sides of the window and the chunk, grouped keys, positions not starting at 0, chunked
prefill and decoding through the cache, bfloat16. Where the fused path does not apply (positions
per row, padding, a gradient), the backend runs ``chunked``: the same outputs, and the fallback
is seen to happen. Parity with the official implementations: tests/test_rope_extension.py and
tests/test_dca.py (``maps`` there).
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close, attention_n
from tests.test_contract import assert_backend_equals_eager
from tests.test_rope_extension import count_fast_maps

import posenc
from posenc.kernels.maps import score_map_attention

HEADS, KV, HEAD_DIM = 4, 2, 8
DIM = HEADS * HEAD_DIM
L = 70
N = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L)
EXTS = [
    {"type": "rerope", "window": 9},
    {"type": "rerope", "window": 1, "scale_base": None},  # every pair but the diagonal is far
    {"type": "leaky-rerope", "window": 12, "factor": 3},
    {"type": "self-extend", "window": 10, "group_size": 3},
    {"type": "self-extend", "window": 40, "group_size": 4},  # a window wider than a block of 16 rows
    {"type": "dca", "chunk_size": 14, "local_size": 3},
    {"type": "dca", "chunk_size": 40, "local_size": 4},  # chunks of 36: blocks cut at their edges
]


def _id(ext) -> str:
    return "-".join(str(v) for v in ext.values())


def make_attn(ext, seed=0) -> posenc.Attention:
    torch.manual_seed(seed)
    attn = posenc.Attention(DIM, HEADS, "rope-extension", kv_heads=KV, max_len=16, rope_extension=ext)
    return attn.eval()


def _x(B=2, n=L, seed=1):
    return torch.randn(B, n, DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [3, 16, 256])
@pytest.mark.parametrize("ext", EXTS, ids=_id)
def test_equals_eager(ext, rows, monkeypatch):
    """Whole sequences at positions 5.., in blocks of ``rows`` query rows."""
    import posenc.attend.backends as backends

    ran = count_fast_maps(monkeypatch)
    inner = backends.score_map_attention
    monkeypatch.setattr(backends, "score_map_attention", lambda *a, **kw: inner(*a, **kw, rows=rows))
    attn, x, pos = make_attn(ext), _x(), torch.arange(L) + 5
    with torch.no_grad():
        assert_close(attn(x, pos=pos, backend="maps"), attn(x, pos=pos, backend="eager"), n=N, msg=str(ext))
    assert ran == [True]


@pytest.mark.parametrize("ext", EXTS, ids=_id)
def test_cached_prefill_and_decoding_equal_eager(ext, monkeypatch):
    """Chunks of 11 tokens appended to the cache, then one token at a time: the full forward."""
    ran = count_fast_maps(monkeypatch)
    attn, x = make_attn(ext), _x()
    with torch.no_grad():
        want = attn(x, backend="eager")
        cache = attn.init_cache(2, L)
        got = [attn(x[:, s : s + 11], cache=cache, backend="maps") for s in range(0, 55, 11)]
        got += [attn(x[:, s : s + 1], cache=cache, backend="maps") for s in range(55, L)]
    assert_close(torch.cat(got, 1), want, n=N, msg=str(ext))
    assert len(ran) == 5 + L - 55 and all(ran)


@pytest.mark.parametrize("ext", EXTS[::3], ids=_id)
def test_bfloat16_equals_eager(ext):
    attn, x = make_attn(ext).to(torch.bfloat16), _x().to(torch.bfloat16)
    with torch.no_grad():
        got, want = attn(x, backend="maps"), attn(x, backend="eager")
    assert got.dtype == torch.bfloat16
    assert_close(got, want, n=N, dtype=torch.bfloat16, msg=str(ext))


@pytest.mark.parametrize("ext", EXTS[::3], ids=_id)
def test_falls_back_where_the_fused_path_does_not_apply(ext, monkeypatch):
    """Positions per row, a padded key, a gradient: ``chunked`` runs, equal to eager (with gradients)."""
    ran = count_fast_maps(monkeypatch)
    attn, x = make_attn(ext), _x()
    per_row = torch.stack([torch.arange(L), torch.arange(L) + 3])
    n_grad = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L, grad=True)
    for pos in (per_row, torch.arange(L)):  # with a gradient: chunked before the fused path is asked
        assert_backend_equals_eager(attn, x, pos, "maps", n=N, n_grad=n_grad, msg=str(ext))
    assert ran == []
    kpm = torch.ones(2, L, dtype=torch.bool)
    kpm[1, :4] = False
    with torch.no_grad():
        y = attn(x, key_padding_mask=kpm, backend="maps")
        assert_close(y, attn(x, key_padding_mask=kpm, backend="eager"), n=N, msg=str(ext))
        attn(x, pos=per_row, backend="maps")
    assert ran == [False, False]


def test_the_kernel_declines_what_it_cannot_run():
    """``score_map_attention`` answers None (the caller's fallback) off one causal run of positions."""
    enc = posenc.build("rope-extension", heads=2, head_dim=8, rope_extension={"type": "rerope", "window": 3})
    q = k = v = torch.randn(1, 2, 6, 8)
    run = torch.arange(6)[None]
    assert score_map_attention(enc, q, k, v, run, run, posenc.AttentionMask(causal=True)) is not None
    for q_pos, k_pos, mask in (
        (run, run, posenc.AttentionMask(causal=False)),
        (run, run, posenc.AttentionMask(causal=True, window=4)),
        (run.flip(-1), run.flip(-1), posenc.AttentionMask(causal=True)),
        (run * 2, run * 2, posenc.AttentionMask(causal=True)),
    ):
        assert score_map_attention(enc, q, k, v, q_pos, k_pos, mask) is None
    plain = posenc.build("rope", heads=2, head_dim=8)
    assert score_map_attention(plain, q, k, v, run, run, posenc.AttentionMask(causal=True)) is None


def test_a_block_reads_each_map_in_unmasked_parts():
    """For a block of 16 rows inside ReRoPE's window of 40, both maps run without a mask: the near
    map's band as a reversed triangle, a full part and the diagonal triangle; the far map's as a full
    part and a triangle (key positions inclusive, from the window, not from the implementation)."""
    from posenc.kernels.maps import _parts

    enc = posenc.build("rope-extension", heads=2, head_dim=8, rope_extension={"type": "rerope", "window": 40})
    near, far = enc.score_maps()
    p0, p1 = 100, 115  # rows at positions 100 .. 115; near: keys p - 39 .. p; far: keys 0 .. p - 40
    assert _parts(near, p0, p1, 0) == [(61, 76, "flipped"), (77, 99, "full"), (100, 115, "causal")]
    assert _parts(far, p0, p1, 0) == [(0, 59, "full"), (60, 75, "causal")]
    assert _parts(far, 20, 35, 0) == []  # no row is 40 tokens from a key yet
    assert _parts(near, 0, 15, 0) == [(0, 15, "causal")]
