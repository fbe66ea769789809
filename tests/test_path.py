"""PaTH (Yang et al. 2025): the paper's transforms as explicit matrix products in float64, every
backend, the KV cache (plain, rolling window, chunked prefill), left padding, packed documents,
Transformer-XL memory, grouped k/v, and flash-linear-attention's layer weights through its
naive reference where fla imports."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from tests.conftest import DIM, HEAD_DIM, HEADS, assert_close, attention_n

import posenc
from posenc.encodings import path as path_module
from posenc.encodings.path import PaTH

L = 10


def _n(length=L, dh=HEAD_DIM):
    # a layer, the w projections and convolution (D + rank + K), and one Dh-dot per transform on the path
    return attention_n(dim=DIM, head_dim=dh, length=length) + DIM + 32 + 3 + length * dh


def _randomize(module, scale=0.3):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn_like(p))  # β spread over (0, 2), w in every direction


def _layer(seed=0, **kw) -> posenc.Attention:
    torch.manual_seed(seed)
    attn = posenc.Attention(DIM, HEADS, "path", head_dim=HEAD_DIM, **kw)
    _randomize(attn)
    return attn.eval()


def _x(B=2, n=L, seed=1):
    return torch.randn(B, n, DIM, generator=torch.Generator().manual_seed(seed))


def _visible(n, window=None):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    vis = j <= i
    return vis if window is None else vis & (i - j < window)


@torch.no_grad()
def _reference(attn: posenc.Attention, x: torch.Tensor, visible: torch.Tensor, keep=None):
    """The paper's formula in float64 with explicit ``Dh×Dh`` matrices::

    w_t = normalize(silu(Σ_m C[:, m]·(W2 W1 x)_{t−K+1+m}))   (rows before 0 are 0)
    β_t = 2σ(b + B x_t),  H_t = I − β_t w_t w_tᵀ
    s_ij = q_iᵀ H_i H_{i−1} ··· H_{j+1} k_j / √Dh,  softmax over the visible j, values, W_O,

    where a query applies only the H_m of keys it sees (``visible`` ``(L, L)`` or ``(B, L, L)``);
    ``keep`` ``(B, L)``: False rows (padding) enter the convolution as 0.
    """
    d = torch.float64
    enc = attn.encoding
    B, n, _ = x.shape
    H, Dh, Hw = attn.heads, attn.head_dim, enc.w_heads
    xd = x.to(d)

    def heads(t, h):  # (B, n, h·Dh) -> (B, H, n, Dh), query head g reading head g // (H/h)
        return t.view(B, n, h, Dh).transpose(1, 2).repeat_interleave(H // h, dim=1)

    q = heads(xd @ attn.q_proj.weight.to(d).T, H)
    k = heads(xd @ attn.k_proj.weight.to(d).T, attn.kv_heads)
    v = heads(xd @ attn.v_proj.weight.to(d).T, attn.kv_heads)
    u = xd
    for lin in enc.w_proj if isinstance(enc.w_proj, torch.nn.Sequential) else [enc.w_proj]:
        u = u @ lin.weight.to(d).T  # (B, n, Hw·Dh)
    if enc.w_conv1d is not None:
        if keep is not None:
            u = u * keep[..., None]
        C = enc.w_conv1d.weight.to(d)[:, 0]  # (Hw·Dh, K)
        K = C.shape[1]
        conv = torch.zeros_like(u)
        for t in range(n):
            for m in range(K):
                src = t - (K - 1) + m
                if src >= 0:
                    conv[:, t] += C[:, m] * u[:, src]
        u = conv * torch.sigmoid(conv)  # silu
    w = heads(u, Hw)
    w = w / torch.sqrt((w * w).sum(-1, keepdim=True) + 1e-6)
    beta = 2 * torch.sigmoid(xd @ enc.bt_proj.weight.to(d).T + enc.bt_proj.bias.to(d))  # (B, n, Hw)
    beta = beta.transpose(1, 2).repeat_interleave(H // Hw, dim=1)  # (B, H, n)
    eye = torch.eye(Dh, dtype=d)
    Hm = eye - beta[..., None, None] * w[..., :, None] * w[..., None, :]  # (B, H, n, Dh, Dh)
    vis = visible.expand(B, n, n)
    s = torch.full((B, H, n, n), float("-inf"), dtype=d)
    for i in range(n):
        for j in range(i + 1):
            P = eye.expand(B, H, Dh, Dh)
            for m in range(i, j, -1):  # H_i H_{i-1} ... H_{j+1}, the identity for a key row i does not see
                P = P @ torch.where(vis[:, i, m, None, None, None], Hm[:, :, m], eye)
            score = (q[:, :, i, None, :] @ P @ k[:, :, j, :, None])[..., 0, 0] / Dh**0.5
            s[:, :, i, j] = torch.where(vis[:, i, j, None], score, float("-inf"))
    o = torch.softmax(s, -1) @ v
    return o.transpose(1, 2).reshape(B, n, H * Dh) @ attn.o_proj.weight.to(d).T, s


def test_every_backend_matches_the_paper_formula():
    attn = _layer(chunk_size=3)  # chunk_size 3: several query blocks, each with its own keys
    x = _x()
    ref, s = _reference(attn, x, _visible(L))
    beta = attn.encoding.read_input(x, None, None).state["beta"]
    assert beta.min() < 0.5 and beta.max() > 1.5  # the transforms really reflect and shrink
    assert posenc.supported_backends(attn.encoding) == ["chunked", "eager"]
    mag = max(1.0, float(s[s > float("-inf")].abs().max()))
    with torch.no_grad():
        for backend in ("chunked", "eager"):
            assert_close(attn(x, backend=backend), ref.float(), n=_n(), magnitude=mag, msg=backend)
            pos = torch.stack([torch.arange(L) + 7, torch.arange(L) * 3])  # positions play no part
            assert_close(attn(x, pos=pos, backend=backend), ref.float(), n=_n(), magnitude=mag, msg=backend)


@pytest.mark.parametrize("options", [{"w_rank": None, "conv_size": 0}, {"w_rank": 4, "conv_size": 1}], ids=str)
def test_other_options_match_the_formula(options):
    attn = _layer(chunk_size=4, **options)
    x = _x()
    ref, s = _reference(attn, x, _visible(L))
    mag = max(1.0, float(s[s > float("-inf")].abs().max()))
    with torch.no_grad():
        for backend in ("chunked", "eager"):
            assert_close(attn(x, backend=backend), ref.float(), n=_n(), magnitude=mag, msg=backend)


@pytest.mark.parametrize("window", [None, 3], ids=["plain", "window3"])
def test_cached_decoding_equals_the_full_pass(window):
    """Token by token and in uneven pieces through the KV cache (a rolling WindowKVCache with
    ``window``): the cache keeps each key's w and β, the carry the convolution's last inputs."""
    attn = _layer(window=window)
    x = _x()
    ref, s = _reference(attn, x, _visible(L, window))
    mag = max(1.0, float(s[s > float("-inf")].abs().max()))
    with torch.no_grad():
        assert_close(attn(x), ref.float(), n=_n(), magnitude=mag, msg="full pass")
        for cuts in ((1,) * L, (4, 1, 3, 2)):
            cache, outs, i = attn.init_cache(2, L), [], 0
            for c in cuts:
                outs.append(attn(x[:, i : i + c], cache=cache))
                i += c
            assert_close(torch.cat(outs, 1), ref.float(), n=_n(), magnitude=mag, msg=f"cuts {cuts}")
            if window is not None:
                assert cache.k.shape[2] == window - 1 and cache.state["w"].shape[2] == window - 1


@pytest.mark.parametrize("w_heads", [None, 2], ids=["w-per-query-head", "w-per-key-head"])
def test_grouped_kv_matches_the_formula(w_heads):
    """``kv_heads=2`` of 4 heads; ``w_heads=2`` is fla's layout (w and β per key head)."""
    torch.manual_seed(0)
    attn = posenc.Attention(DIM, 4, "path", head_dim=4, kv_heads=2, w_heads=w_heads, chunk_size=3)
    _randomize(attn)
    attn.eval()
    x = _x()
    ref, s = _reference(attn, x, _visible(L))
    mag = max(1.0, float(s[s > float("-inf")].abs().max()))
    with torch.no_grad():
        for backend in ("chunked", "eager"):
            assert_close(attn(x, backend=backend), ref.float(), n=_n(dh=4), magnitude=mag, msg=backend)
        cache = attn.init_cache(2, L)
        steps = torch.cat([attn(x[:, i : i + 1], cache=cache) for i in range(L)], 1)
    assert_close(steps, ref.float(), n=_n(dh=4), magnitude=mag, msg="decoding")
    assert cache.k.shape[1] == 2 and cache.state["w"].shape[1] == (4 if w_heads is None else 2)


def test_left_padding_and_packed_documents_equal_each_sequence_alone():
    """Padding rows enter the convolution as 0 and transform nothing; packed documents neither
    convolve across their boundary nor transform each other."""
    attn = _layer(chunk_size=3)
    x = _x(B=1)
    ref, s = _reference(attn, x, _visible(L))
    y = _x(B=1, n=6, seed=2)
    ref_y, s_y = _reference(attn, y, _visible(6))
    mag = max(1.0, float(s[s > float("-inf")].abs().max()), float(s_y[s_y > float("-inf")].abs().max()))
    pad = 3
    padded = torch.cat([torch.randn(1, pad, DIM), x], 1)
    kpm = torch.cat([torch.zeros(1, pad, dtype=torch.bool), torch.ones(1, L, dtype=torch.bool)], 1)
    docs = torch.tensor([[0] * L + [1] * 6])
    with torch.no_grad():
        for backend in ("chunked", "eager"):
            got = attn(padded, key_padding_mask=kpm, backend=backend)
            assert_close(got[:, pad:], ref.float(), n=_n(), magnitude=mag, msg=f"left padding, {backend}")
            got = attn(torch.cat([x, y], 1), document_ids=docs, backend=backend)
            assert_close(got[:, :L], ref.float(), n=_n(), magnitude=mag, msg=f"document 0, {backend}")
            assert_close(got[:, L:], ref_y.float(), n=_n(), magnitude=mag, msg=f"document 1, {backend}")
        # left padding with the cache: prefill the padded prompt, then decode
        cache = attn.init_cache(1, pad + L)
        first = attn(padded[:, : pad + 4], cache=cache, key_padding_mask=kpm[:, : pad + 4])
        rest = [
            attn(padded[:, t : t + 1], cache=cache, key_padding_mask=kpm[:, : t + 1]) for t in range(pad + 4, pad + L)
        ]
    assert_close(torch.cat([first, *rest], 1)[:, pad:], ref.float(), n=_n(), magnitude=mag, msg="padded decoding")


def test_a_padded_key_between_seen_ones_transforms_nothing():
    """A hole (key 4 of row 0 padded, between keys the later queries see): the per-key path, where a
    query skips the transform of a key it does not see, as the formula with ``H_4 = I`` for them (and
    the padded row entering the convolution as 0)."""
    attn = _layer(chunk_size=3)
    x = _x()
    kpm = torch.ones(2, L, dtype=torch.bool)
    kpm[0, 4] = False
    visible = _visible(L)[None] & kpm[:, None, :]  # (B, L, L)
    ref, s = _reference(attn, x, visible, keep=kpm)
    mag = max(1.0, float(s[s > float("-inf")].abs().max()))
    with torch.no_grad():
        for backend in ("chunked", "eager"):
            got = attn(x, key_padding_mask=kpm, backend=backend)
            assert_close(got, ref.float(), n=_n(), magnitude=mag, msg=backend)


def test_blocked_and_per_key_scores_agree_on_every_seen_key():
    """The UT-transform blocks (several, the last one padded) against the key-by-key loop, for
    causal rows, left-padded rows and a row that sees nothing, with β over (0, 2)."""
    g = torch.Generator().manual_seed(3)
    B, H, Lq, Lk, Dh = 2, 2, 12, 40, 8
    q, k = torch.randn(B, H, Lq, Dh, generator=g), torch.randn(B, H, Lk, Dh, generator=g)
    w = F.normalize(torch.randn(B, H, Lk, Dh, generator=g), dim=-1)
    beta = 2 * torch.rand(B, H, Lk, generator=g)
    see = (torch.arange(Lk) <= torch.arange(Lk - Lq, Lk)[:, None]).expand(B, 1, Lq, Lk).clone()
    see[1, :, :, :9] = False  # row 1: left padding
    see[1, :, 0] = False  # and one query that sees nothing
    last = torch.where(see, torch.arange(Lk), -1).amax(-1)
    blocked = path_module.blocked_scores(q, k, w, beta, last)
    per_key = path_module.per_key_scores(q, k, w, beta, see)
    assert Lk % path_module.BLOCK and Lk > 2 * path_module.BLOCK
    mag = float(per_key.abs().max())
    assert_close(blocked.masked_fill(~see, 0), per_key.masked_fill(~see, 0), n=Lk * Dh, magnitude=mag)


def test_memory_keys_equal_the_full_pass():
    """Transformer-XL memory: w and β read from cat(memory, x), the convolution across both."""
    attn = _layer()
    x = _x()
    with torch.no_grad():
        full = attn(x)
        got = attn(x[:, 4:], memory=x[:, :4])
    assert_close(got, full[:, 4:], n=_n())


def test_gradients_equal_between_backends_and_reach_every_parameter():
    attn = _layer(chunk_size=3)
    grads = {}
    for backend in ("chunked", "eager"):
        attn.zero_grad()
        x = _x().requires_grad_()
        (attn(x, backend=backend) * torch.linspace(-1, 1, DIM)).sum().backward()
        grads[backend] = [x.grad] + [p.grad.clone() for p in attn.parameters()]
    for g, ge in zip(grads["chunked"], grads["eager"], strict=True):
        assert_close(g, ge, n=2 * _n() + 2 * L, magnitude=max(1.0, float(ge.abs().max())))
    for name, p in attn.encoding.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_errors_and_init():
    enc = PaTH(heads=HEADS, head_dim=HEAD_DIM)
    assert enc.bt_proj.bias.eq(0).all() and 0.015 < float(enc.bt_proj.weight.std()) < 0.025  # fla's init
    assert enc.w_conv1d.weight.shape == (HEADS * HEAD_DIM, 1, 3) and enc.w_proj[0].weight.shape == (32, DIM)
    q = k = torch.randn(1, HEADS, 4, HEAD_DIM)
    pos = torch.arange(4)
    with pytest.raises(ValueError, match="'path' reads its transforms .* from ctx.k_state.*posenc.Attention"):
        enc.qk_scores(q, k, pos, pos)
    read = enc.read_input(torch.randn(1, 3, DIM), k[:, :, :3], k[:, :, :3])
    with pytest.raises(ValueError, match="holds 3 keys' transforms for 4 keys"):
        enc.qk_scores(q, k, pos, pos, ctx=posenc.Context(pos, pos, k_state=read.state))
    with pytest.raises(ValueError, match=r"hidden_size=16\), got \(1, 4, 24\)"):
        enc.read_input(torch.randn(1, 4, 24), q, q)
    attn = posenc.Attention(24, HEADS, "path", head_dim=HEAD_DIM)  # the layer tells it its width
    assert attn.encoding.hidden_size == 24 and attn(torch.randn(1, 4, 24)).shape == (1, 4, 24)
    for bad, match in (
        ({"w_heads": 3}, "w_heads must be a positive int dividing heads=2"),
        ({"w_rank": 0}, "w_rank must be an int >= 1 or None"),
        ({"conv_size": -1}, "conv_size must be an int >= 0"),
        ({"init_std": 0.0}, "init_std must be a number > 0"),
    ):
        with pytest.raises(ValueError, match=match):
            PaTH(heads=HEADS, head_dim=HEAD_DIM, **bad)
    with pytest.raises(ValueError, match="causal only"):
        posenc.Attention(DIM, HEADS, "path", causal=False)


def _fla(module: str):
    """An fla module, or a skip: fla imports only beside triton, which posenc does not depend on."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # ImportError, or fla's own device checks
        pytest.skip(
            f"flash-linear-attention does not import here ({type(e).__name__}: {e}); it needs fla-core and "
            "triton, which import on a CPU too but are no dependency of posenc"
        )


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_fla_layer_weights_through_fla_naive_reference(kv_heads):
    """fla 0.6's ``PaTHAttention`` (its default low-rank w, 3-tap SiLU convolution, 2σ β) loaded
    into posenc by parameter name, run through fla's ``naive_path_attn``: equal element-wise.
    fla's layer kernels need a GPU; the naive reference, its modules' weights and its β
    expression run here, with the convolution as the ``nn.Conv1d`` its ``ShortConvolution`` is
    and the L2 norm written out (fla's is a Triton kernel)."""
    naive = _fla("fla.ops.path_attn.naive").naive_path_attn
    layer_cls = _fla("fla.layers.path_attn").PaTHAttention
    torch.manual_seed(0)
    ref = layer_cls(hidden_size=DIM, num_heads=4, num_kv_heads=kv_heads)
    _randomize(ref)
    attn = posenc.Attention(DIM, 4, "path", kv_heads=kv_heads, w_heads=kv_heads, chunk_size=3)
    own = attn.state_dict()
    theirs = {n: t for n, t in ref.state_dict().items() if n in own}
    theirs.update({f"encoding.{n}": t for n, t in ref.state_dict().items() if f"encoding.{n}" in own})
    assert set(theirs) == set(own)  # every posenc parameter has its fla namesake
    attn.load_state_dict(theirs)
    x = _x()
    B, Dh = x.shape[0], DIM // 4
    with torch.no_grad():
        q = ref.q_proj(x).view(B, L, 4, Dh)
        k, v = ref.k_proj(x).view(B, L, kv_heads, Dh), ref.v_proj(x).view(B, L, kv_heads, Dh)
        w = ref.w_proj(x)  # (B, L, kv_dim)
        w = F.silu(torch.nn.Conv1d.forward(ref.w_conv1d, w.transpose(1, 2))[..., :L]).transpose(1, 2)
        w = w.view(B, L, kv_heads, Dh).float()
        w = w / torch.sqrt(w.square().sum(-1, keepdim=True) + 1e-6)
        beta = ref.bt_proj(x).float().sigmoid() * 2  # fla's expression (layers/path_attn.py)
        o = naive(q, k, v, w, beta, torch.zeros(B, L, 4), scale=Dh**-0.5)
        expected = ref.o_proj(o.reshape(B, L, DIM))
        for backend in ("chunked", "eager"):
            assert_close(attn(x, backend=backend), expected, n=_n(dh=Dh), msg=backend)
        cache = attn.init_cache(B, L)
        steps = torch.cat([attn(x[:, i : i + 1], cache=cache) for i in range(L)], 1)
    assert_close(steps, expected, n=_n(dh=Dh), msg="decoding")
