"""posenc.kernels.distance_attention against a dense transcription of its formula.

The reference materialises every pair's distance, evaluates the terms per pair and
runs a plain float32 softmax; the kernel must match it in outputs and in gradients of
q, k, v and every table parameter, causal and bidirectional, float32 and bfloat16, with
a KV-cache offset and with key padding (including a row that sees no key).
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import assert_close

import posenc
from posenc.kernels import DistanceTerms, distance_attention
from posenc.kernels.plan import Geometry, make_plan

B, H, DH = 2, 3, 8


def reference(q, k, v, terms: DistanceTerms, *, scale, causal, offset, kpm):
    q, k, v = q.float(), k.float(), v.float()
    Lq, Lk = q.shape[2], k.shape[2]
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)
    d = (j - i - offset).reshape(-1)
    if terms.rows is not None:
        d = terms.rows(d)
    q = q if terms.q is None else terms.q.float()
    s = q @ k.transpose(-1, -2)
    q_rel = q if terms.q_rel is None else terms.q_rel.float()
    if terms.rel_k is not None:
        s = s + torch.einsum(
            "bhid,hijd->bhij", q_rel, terms.rel_k(d).float().view(-1, Lq, Lk, DH).expand(H, -1, -1, -1)
        )
    if terms.rel_q is not None:
        s = s + torch.einsum("bhjd,hijd->bhij", k, terms.rel_q(d).float().view(-1, Lq, Lk, DH).expand(H, -1, -1, -1))
    s = s * scale
    if terms.bias is not None:
        s = s + terms.bias(d).view(H, Lq, Lk)
    allowed = torch.ones(1, 1, Lq, Lk, dtype=torch.bool)
    if causal:
        allowed = allowed & (j <= i + offset)
    if kpm is not None:
        allowed = allowed & kpm[:, None, None, :]
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = p @ v
    if terms.rel_v is not None:
        out = out + torch.einsum(
            "bhij,hijd->bhid", p, terms.rel_v(d).float().view(-1, Lq, Lk, DH).expand(H, -1, -1, -1)
        )
    return out


def _param(*shape, std=0.5):
    return (std * torch.randn(*shape)).requires_grad_()


def make_terms(kind: str, causal: bool):
    """name -> (terms, parameters): one of each shape of encoding."""
    if kind == "t5":  # a learned bias per bucket of d, constant beyond ±W
        W = 6
        table = _param(H, 2 * W + 1)
        return DistanceTerms(
            bias=lambda r: table[:, r], rows=lambda d: d.clamp(-W, W) + W, kind="clamp", far=(-W, W)
        ), [table]
    if kind == "shaw":  # shared key and value vectors per clipped distance
        K = 3
        tk, tv = _param(2 * K + 1, DH), _param(2 * K + 1, DH)
        return (
            DistanceTerms(
                rel_k=lambda r: tk[r][None],
                rel_v=lambda r: tv[r][None],
                rows=lambda d: d.clamp(-K, K) + K,
                kind="clamp",
                far=(-K, K),
            ),
            [tk, tv],
        )
    if kind == "deberta":  # per-head c2p and p2c vectors and a bias, bucketed (two distances a bucket)
        K = 4
        tk, tq, tb = _param(H, K + 1, DH), _param(H, K + 1, DH), _param(H, K + 1)
        return (
            DistanceTerms(
                rel_k=lambda r: tk[:, r],
                rel_q=lambda r: tq[:, r],
                bias=lambda r: tb[:, r],
                rows=lambda d: torch.div(d.clamp(-K, K) + K, 2, rounding_mode="floor"),
                kind="clamp",
                far=(-K, K),
            ),
            [tk, tq, tb],
        )
    if kind == "alibi":
        m = torch.tensor([0.5, 0.125, 1 / 64])
        if causal:
            return DistanceTerms(bias=lambda d: m[:, None] * d, kind="linear", far=(0, 0), slopes=(m, -m)), []
        return DistanceTerms(bias=lambda d: -m[:, None] * d.abs(), kind="linear", far=(0, 0), slopes=(m, -m)), []
    if kind == "kerple":  # learned, no far field
        r1, r2 = _param(H), _param(H)

        def bias(d):
            return -r1.exp()[:, None] * torch.log1p(r2.exp()[:, None] * d.abs().float())

        return DistanceTerms(bias=bias), [r1, r2]
    if kind == "xl":  # q + u against keys, q_rel = q + v against one vector per distance, no far field
        rk = _param(H, 64, DH)
        return DistanceTerms(rel_k=lambda d: rk[:, d + 32]), [rk]
    raise ValueError(kind)


KINDS = ["t5", "shaw", "deberta", "alibi", "kerple", "xl"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("setting", ["plain", "offset", "padding", "recompute"])
def test_distance_attention_equals_reference(kind, causal, dtype, setting):
    """``recompute``: the band's probabilities are recomputed in backward instead of kept."""
    _check_against_reference(kind, causal, dtype, setting)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("setting", ["plain", "offset", "padding", "recompute"])
def test_bias_bands_split_by_keys_equal_reference(causal, dtype, setting, monkeypatch):
    """A bias without vector terms (Kerple) has its bands cut into pieces of 5 keys."""
    from posenc.kernels import relative

    monkeypatch.setattr(relative, "BIAS_BAND_KEYS", 5)
    _check_against_reference("kerple", causal, dtype, setting)


def _check_against_reference(kind, causal, dtype, setting):
    torch.manual_seed(0)
    Lq, offset = 19, 0
    Lk = Lq
    if setting == "offset":
        offset = 7
        Lk = Lq + offset
    kpm = None
    if setting == "padding":
        kpm = torch.ones(B, Lk, dtype=torch.bool)
        kpm[0, :5] = False  # left padding: the first queries of row 0 see no key when causal
        kpm[1, 9:13] = False
    terms, params = make_terms(kind, causal)
    q, k, v = (torch.randn(B, H, n, DH).to(dtype).requires_grad_() for n in (Lq, Lk, Lk))
    if kind == "xl":
        ub, vb = _param(H, DH), _param(H, DH)
        terms.q = q + ub[None, :, None].to(dtype)
        terms.q_rel = q + vb[None, :, None].to(dtype)
        params = [*params, ub, vb]
    scale = DH**-0.5
    grad = torch.randn(B, H, Lq, DH)
    leaves = [q, k, v, *params]
    outs, grads = [], []
    for fn in ("kernel", "reference"):
        kw = dict(scale=scale, causal=causal, offset=offset)
        if fn == "kernel":
            keep = 0 if setting == "recompute" else 2**30
            out = distance_attention(q, k, v, terms, key_padding_mask=kpm, block=4, keep_bytes=keep, **kw)
        else:
            out = reference(q, k, v, terms, kpm=kpm, **kw)
        outs.append(out.float())
        grads.append(torch.autograd.grad(out.float(), leaves, grad, retain_graph=True, allow_unused=True))
    n = DH + 2 * Lk
    assert_close(outs[0], outs[1], n=n, dtype=dtype, msg=f"{kind} output")
    for name, a, b in zip(["q", "k", "v"] + [f"param{i}" for i in range(len(params))], *grads):
        if b is None:
            assert a is None or not a.abs().any(), name
            continue
        assert a is not None, name
        assert_close(a.float(), b.float(), n=2 * n + B * Lq, dtype=dtype, msg=f"{kind} grad {name}")


def test_padded_row_is_zero_and_finite():
    terms, params = make_terms("t5", True)
    q, k, v = (torch.randn(1, H, 9, DH, requires_grad=True) for _ in range(3))
    kpm = torch.zeros(1, 9, dtype=torch.bool)
    out = distance_attention(q, k, v, terms, scale=0.3, causal=True, key_padding_mask=kpm, block=4)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v, *params))


@pytest.mark.parametrize("causal", [True, False])
def test_plan_covers_every_visible_pair_once(causal):
    """Each (row, key) the mask allows lands in exactly one flash call, strip or band;
    flash calls hold no masked pair (bands and strips mask theirs)."""
    cases = (("clamp", (-3, 5), None), ("clamp", (-2, -2), None), ("linear", (0, 0), None))
    for kind, far, band_keys in (*cases, ("none", None, None), ("none", None, 3)):
        for Lq, offset in ((13, 0), (5, 9), (1, 20)):
            g = Geometry(Lq, Lq + offset, causal, offset, -offset)
            plan = make_plan(g, kind, far, block=4, band_keys=band_keys)
            if band_keys:
                assert all(b.k1 - b.k0 <= band_keys for b in plan.bands)
            calls = torch.zeros(Lq, g.Lk, dtype=torch.long)
            for c in plan.calls:
                for r in range(c.r0, c.r1):
                    hi = min(c.k1, c.k0 + (r - c.r0) + 1) if c.causal else c.k1
                    if c.flip:  # rows and keys counted from the end
                        calls[Lq - 1 - r, g.Lk - hi : g.Lk - c.k0] += 1
                    else:
                        calls[r, c.k0 : hi] += 1
            seen = calls.clone()
            for b in plan.bands:
                seen[b.r0 : b.r1, b.k0 : b.k1] += 1
            for s in plan.strips:
                for r in range(s.r0, s.r1):
                    lo, hi = max(0, r + s.first), min(g.Lk, r + s.first + s.width)
                    seen[r, lo:hi] += 1
            i, j = torch.arange(Lq)[:, None], torch.arange(g.Lk)
            visible = (j <= i + offset) if causal else torch.ones_like(seen, dtype=torch.bool)
            assert (seen[visible] == 1).all(), (kind, far, Lq, offset)
            assert (calls[~visible] == 0).all(), (kind, far, Lq, offset)


def test_bad_arguments():
    terms, _ = make_terms("t5", True)
    q = torch.randn(1, H, 4, DH)
    with pytest.raises(ValueError, match="key_padding_mask"):
        distance_attention(q, q, q, terms, scale=1.0, causal=True, key_padding_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="kind"):
        make_plan(Geometry(4, 4, True), "other", None, 2)
    with pytest.raises(ValueError, match="block"):
        make_plan(Geometry(4, 4, True), "none", None, 0)


# ---------------------------------------------------------------- ALiBi: far keys left out
@pytest.fixture
def cut_pieces(monkeypatch):
    """Records every flash-call piece :func:`posenc.kernels.segments._head_groups` hands out."""
    from posenc.kernels import segments

    pieces = []
    real = segments._head_groups

    def spy(call, cuts, delta, n_heads):
        groups = real(call, cuts, delta, n_heads)
        pieces.append((call, n_heads, groups))
        return groups

    monkeypatch.setattr(segments, "_head_groups", spy)
    return pieces


def _dropped(pieces):
    """``(head, rows, keys)`` of every key range a call left out for a head."""
    out = []
    for call, n_heads, groups in pieces:
        for h in range(n_heads):
            ks = [ks for hs, ks in groups if h in range(n_heads)[hs]]
            a, b = (ks[0].start or 0, ks[0].stop or call.k1 - call.k0) if ks else (0, 0)
            rows = slice(call.r0, call.r1)
            if a > 0:
                out.append((h, rows, slice(call.k0, call.k0 + a)))
            if b < call.k1 - call.k0:
                out.append((h, rows, slice(call.k0 + b, call.k1)))
    return out


def _alibi_long(causal):
    m = torch.tensor([1.0, 0.5, 0.01])  # two steep heads whose far keys underflow, one that never does
    bias = (lambda d: m[:, None] * d) if causal else (lambda d: -m[:, None] * d.abs())
    return DistanceTerms(bias=bias, kind="linear", far=(0, 0), slopes=(m, -m))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("offset", [0, 37])
def test_alibi_far_keys_left_out_equal_reference(causal, dtype, offset, cut_pieces):
    """Over 400 keys the steep heads' calls leave far keys out (the spy sees it), and the
    output and every gradient still equal the dense float32 reference."""
    torch.manual_seed(1)
    Lq = 400 - offset
    terms = _alibi_long(causal)
    q, k, v = (torch.randn(B, H, n, DH).to(dtype).requires_grad_() for n in (Lq, 400, 400))
    grad = torch.randn(B, H, Lq, DH)
    kw = dict(scale=DH**-0.5, causal=causal, offset=offset)
    out = distance_attention(q, k, v, terms, block=64, **kw)
    ref = reference(q, k, v, terms, kpm=None, **kw)
    dropped = _dropped(cut_pieces)
    assert {h for h, _, _ in dropped} == {0, 1}, "the steep heads leave keys out, the shallow one none"
    n = DH + 2 * 400
    assert_close(out.float(), ref, n=n, dtype=dtype, msg="output")
    got = torch.autograd.grad(out.float(), (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, b in zip("qkv", got, want):
        assert_close(a.float(), b.float(), n=2 * n + B * Lq, dtype=dtype, msg=f"grad {name}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_alibi_left_out_keys_have_weight_below_smallest_normal(causal, cut_pieces):
    """The bound behind the cut, at its tightest: every query is ``u``, the far keys are
    ``+a·u`` (the largest score Cauchy–Schwarz allows) and the near keys ``-a·u`` (the
    smallest), so a far key's weight is within ``1 - e^-m`` of ``e^(2·scale·|q|·|k| - m·|d|)``.
    In float64, every key a call left out still has weight below float32's smallest normal."""
    L, near = 500, 120
    u = torch.randn(DH, dtype=torch.float64)
    u = 1.5 * u / u.norm()
    q = u.expand(1, H, L, DH).clone()
    j = torch.arange(L)
    far = ((j < L - near) if causal else ((j < L // 2 - near) | (j >= L // 2 + near))).double()
    k = (2 * far - 1)[:, None] * u  # +u far, -u near
    k = k.expand(1, H, L, DH).clone()
    v = torch.randn(1, H, L, DH, dtype=torch.float64)
    terms = _alibi_long(causal)
    scale = DH**-0.5
    distance_attention(q.float(), k.float(), v.float(), terms, scale=scale, causal=causal, block=32)
    dropped = _dropped(cut_pieces)
    assert dropped, "the steep heads leave keys out"
    s = scale * q @ k.transpose(-1, -2)
    d = (j[None, :] - j[:, None]).double()
    s = s + terms.bias(d.long().view(-1)).double().view(H, L, L)
    if causal:
        s = s.masked_fill(j[None, :] > j[:, None], float("-inf"))
    p = torch.softmax(s, -1)[0]
    worst = max(float(p[h, rows, keys].max()) for h, rows, keys in dropped)
    assert worst < 2.0**-126, worst  # e^-87.3
    # and the cut is not needlessly far: here some left-out key comes within e^-5 of it
    assert worst > math.exp(-95.0), worst


# ---------------------------------------------------------------- the blockwise backend
# small tables so that a 40-token sequence reaches every far field
DISTANCE_ENCODINGS = {
    "alibi": {},
    "t5": {"num_buckets": 8, "max_distance": 12},
    "kerple": {},
    "shaw": {"max_relative_position": 5},
    "xl": {},
    "deberta": {"position_buckets": 8, "max_relative_positions": 12},
    "deberta-shared": {"position_buckets": 8, "max_relative_positions": 12, "share_att_key": True},
    "deberta-emd": {"position_buckets": 8, "max_relative_positions": 12, "share_att_key": False},
}


def _encoding_name(key: str) -> str:
    """A key is a registered name, or one with a suffix naming its options (``deberta-shared``)."""
    return key if key in posenc.available() else key.split("-")[0]


def _distance_attn(key: str, causal: bool, dtype=torch.float32):
    name = _encoding_name(key)
    opts = dict(DISTANCE_ENCODINGS[key])
    if opts.get("share_att_key"):
        opts["hidden_size"] = 16
    torch.manual_seed(0)
    attn = posenc.Attention(16, 2, name, head_dim=8, causal=causal, max_len=64, **opts)
    with torch.no_grad():
        for p in attn.parameters():  # random tables and biases, not their zero/one inits
            p.add_(0.3 * torch.randn_like(p))
    return attn.to(dtype)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of the kernel behind the ``blockwise`` backend."""
    from posenc.kernels import backend as kb

    calls = []
    real = kb.distance_attention

    def spy(*a, **kw):
        calls.append(kw["block"])
        return real(*a, **kw)

    monkeypatch.setattr(kb, "distance_attention", spy)
    return calls


def test_blockwise_backend_covers_every_distance_encoding():
    have = {
        n
        for n in posenc.available()
        if "blockwise" in posenc.supported_backends(posenc.build(n, heads=2, head_dim=8, max_len=16))
    }
    assert have == {_encoding_name(k) for k in DISTANCE_ENCODINGS}


@pytest.mark.parametrize("key", list(DISTANCE_ENCODINGS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_blockwise_backend_equals_eager(key, causal, dtype, kernel_calls):
    """The encodings' ``distance_terms`` through the kernel (not its fallback) equal the
    eager oracle: outputs and gradients of the input and every parameter."""
    attn = _distance_attn(key, causal, dtype)
    if causal is False and attn.encoding.causal_only:
        pytest.skip("causal only")
    L = 40
    x = torch.randn(2, L, 16).to(dtype)
    pos = torch.stack([torch.arange(L), torch.arange(L) + 5])  # consecutive, one distance for both rows
    outs, grads = {}, {}
    for b in ("eager", "blockwise"):
        attn.zero_grad()
        xi = x.clone().requires_grad_()
        y = attn(xi, pos=pos, backend=b)
        (y.float() * torch.linspace(-1, 1, 16)).sum().backward()
        outs[b] = y.detach().float()
        grads[b] = [xi.grad.float()] + [p.grad.float() for p in attn.parameters() if p.grad is not None]
    assert kernel_calls, "the blockwise backend fell back instead of running the kernel"
    n = 2 * 16 + 8 + 2 * L
    assert_close(outs["blockwise"], outs["eager"], n=n, dtype=dtype, msg=f"{key} output")
    assert len(grads["blockwise"]) == len(grads["eager"])
    for g, ge in zip(grads["blockwise"], grads["eager"]):
        assert_close(g, ge, n=2 * n + 2 * L, dtype=dtype, msg=f"{key} gradient")


def test_blockwise_backend_falls_back(kernel_calls):
    """Positions that are not consecutive, or a mask field the kernel does not know, run the
    general backend (same result as eager, kernel not called)."""
    import dataclasses

    from posenc.kernels.backend import kernel_mask

    attn = _distance_attn("t5", True)
    x = torch.randn(2, 12, 16)
    pos = torch.arange(12) * 2  # strided positions
    assert_close(attn(x, pos=pos, backend="blockwise"), attn(x, pos=pos, backend="eager"), n=80)
    assert not kernel_calls
    assert kernel_mask(posenc.AttentionMask(causal=True, offset=3, key_padding=torch.ones(1, 5, dtype=torch.bool)))

    @dataclasses.dataclass(frozen=True)
    class Windowed(posenc.AttentionMask):
        window: int | None = None

    assert kernel_mask(Windowed(window=None)) and not kernel_mask(Windowed(window=4))


@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "t5", "shaw"])
def test_bfloat16_runs_in_float32_where_the_cpu_kernel_cannot(name, monkeypatch):
    """On CPUs without AVX-512, torch 2.13's fused CPU kernel raises for bfloat16 from 64
    keys on (``pack_vnni2``); posenc then runs it in float32 and casts back. Forced here
    (whatever this CPU has): every fused backend equals eager in output and gradients."""
    from posenc.kernels import flash

    monkeypatch.setattr(flash, "_bf16_flash_works", lambda: False)
    assert flash.needs_upcast(torch.zeros(1, dtype=torch.bfloat16))
    assert not flash.needs_upcast(torch.zeros(1)) and not flash.needs_upcast(torch.zeros(1, dtype=torch.float16))
    torch.manual_seed(0)
    attn = posenc.Attention(32, 2, name, causal=True, max_len=128).bfloat16()
    x = torch.randn(1, 128, 32).bfloat16()
    outs = {}
    for b in [b for b in posenc.supported_backends(attn.encoding) if b in ("sdpa", "dense", "blockwise")] + ["eager"]:
        attn.zero_grad()
        xi = x.clone().requires_grad_()
        y = attn(xi, backend=b)
        y.float().sum().backward()
        outs[b] = (y.float(), xi.grad.float())
    eager = outs.pop("eager")
    assert outs
    for b, (y, g) in outs.items():
        assert_close(y, eager[0], n=2 * 32 + 8 + 2 * 128, dtype=torch.bfloat16, msg=f"{name} {b} output")
        assert_close(g, eager[1], n=4 * 32 + 16 + 4 * 128, dtype=torch.bfloat16, msg=f"{name} {b} gradient")
