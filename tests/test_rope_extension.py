"""ReRoPE, Leaky ReRoPE and Self-Extend (``rope-extension``'s ``rope_extension``, issue 14 item 5).

Parity: against ``tests/extension_oracles.py``, a transcription of the official patches'
attention (bojone/rerope ``rerope_patch.py`` / ``leaky_rerope_patch.py``, datamllab/LongLM
``self_extend_patch/Llama.py``) built on HF Llama's rotary functions: their prefill path on a
whole sequence, and their separate ``q_len == 1`` decoding path (keys rotated by minus the
clipped or grouped distance) against posenc's KV-cache decoding.

Contract: the checks of ``tests/test_contract.py`` for every extension type (the suite there
runs over registered names with default options, so these option variants enrol here).
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close, attention_n, lm_n
from tests.extension_oracles import (
    leaky_rerope_decode,
    leaky_rerope_prefill,
    llama_rotary,
    rerope_decode,
    rerope_prefill,
    self_extend_decode,
    self_extend_prefill,
)
from tests.test_contract import assert_backend_equals_eager

import posenc
from posenc import Stage

HEADS, HEAD_DIM = 2, 16
DIM = HEADS * HEAD_DIM
TRAIN = 8  # the model's max_len (bojone's training_length: the log-n base)
L = 24  # three times the training length


def make_attn(ext, *, seed=0, max_len=TRAIN, dim=DIM, heads=HEADS, head_dim=HEAD_DIM, **kw) -> posenc.Attention:
    torch.manual_seed(seed)
    if ext is not None:  # (None: plain rope, the reference)
        kw["rope_extension"] = ext
    name = "rope" if ext is None else "rope-extension"
    attn = posenc.Attention(dim, heads, name, head_dim=head_dim, max_len=max_len, **kw)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return attn.eval()


def qkv(attn, x):
    B, n, _ = x.shape
    return [
        proj(x).view(B, n, attn.heads, attn.head_dim).transpose(1, 2)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
    ]


def out_proj(attn, o):
    B, _, n, _ = o.shape
    return attn.o_proj(o.transpose(1, 2).reshape(B, n, attn.heads * attn.head_dim))


def _x(B=2, n=L, seed=1, dim=DIM):
    return torch.randn(B, n, dim, generator=torch.Generator().manual_seed(seed))


def reference(ext, attn, x, pos, *, decode: bool = False):
    """The official patch's attention through ``attn``'s projections: its prefill path on all of
    ``x`` at ``pos`` ``(B, L)``, or (``decode``) its ``q_len == 1`` path for the last token of ``x``
    against keys ``0 .. L-1`` at default positions."""
    q, k, v = qkv(attn, x)
    if decode:
        q = q[:, :, -1:]
    rot = llama_rotary(attn.heads, attn.head_dim)
    kind, w, base = ext["type"], ext["window"], ext.get("scale_base", TRAIN)
    if kind == "rerope":
        o = (rerope_decode if decode else rerope_prefill)(q, k, v, pos, window=w, training_length=base, rotary=rot)
    elif kind == "leaky-rerope":
        scaled = llama_rotary(attn.heads, attn.head_dim, factor=ext["factor"])
        fn = leaky_rerope_decode if decode else leaky_rerope_prefill
        o = fn(q, k, v, pos, window=w, factor=ext["factor"], training_length=base, rotary=rot, rotary_scaled=scaled)
    else:
        fn, p = (self_extend_decode, pos[:, -1:]) if decode else (self_extend_prefill, pos)
        o = fn(q, k, v, p, group_size=ext["group_size"], window=w, scale_base=ext.get("scale_base"), rotary=rot)
    return out_proj(attn, o)


# the papers' settings scaled down: windows well inside the sequence, groups that do and do not divide W
PARITY = [
    {"type": "rerope", "window": 5},
    {"type": "rerope", "window": 5, "scale_base": 4},
    {"type": "leaky-rerope", "window": 5, "factor": 4},
    {"type": "leaky-rerope", "window": 3, "factor": 2},
    {"type": "self-extend", "window": 8, "group_size": 4},
    {"type": "self-extend", "window": 6, "group_size": 4},  # W/G = 1.5: float query positions
    {"type": "self-extend", "window": 6, "group_size": 3, "scale_base": 8},
]
N = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L)


def _id(ext) -> str:
    return "-".join(f"{v}" for v in ext.values())


@pytest.mark.parametrize("ext", PARITY, ids=_id)
@pytest.mark.parametrize("backend", ["eager", "chunked"])
def test_prefill_equals_official_attention(ext, backend):
    attn = make_attn(ext, chunk_size=5)
    x = _x()
    pos = torch.stack([torch.arange(L), torch.arange(L) + 3])  # (B, L): different positions per row
    with torch.no_grad():
        assert_close(attn(x, pos=pos, backend=backend), reference(ext, attn, x, pos), n=N, msg=str(ext))


def count_fast_maps(monkeypatch) -> list[bool]:
    """Record, per ``maps`` call, whether its fused path ran (True) or it fell back to ``chunked``."""
    import posenc.attend.backends as backends

    ran, inner = [], backends.score_map_attention

    def counted(*args, **kw):
        out = inner(*args, **kw)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(backends, "score_map_attention", counted)
    return ran


@pytest.mark.parametrize("ext", PARITY, ids=_id)
def test_maps_backend_equals_official_attention(ext, monkeypatch):
    """The fused score maps (one run of positions, not starting at 0) against the official prefill,
    whole and as a chunked prefill through the cache (grouped keys: tests/test_maps_backend.py)."""
    ran = count_fast_maps(monkeypatch)
    attn = make_attn(ext)
    x = _x()
    pos = torch.arange(L) + 3
    with torch.no_grad():
        want = reference(ext, attn, x, pos.expand(2, L))
        assert_close(attn(x, pos=pos, backend="maps"), want, n=N, msg=str(ext))
        cache = attn.init_cache(2, L)
        got = [attn(x[:, s : s + 7], cache=cache, backend="maps") for s in range(0, L, 7)]
        assert_close(torch.cat(got, 1), reference(ext, attn, x, torch.arange(L).expand(2, L)), n=N, msg=str(ext))
    assert ran and all(ran)


@pytest.mark.parametrize("ext", PARITY, ids=_id)
def test_cached_decoding_equals_official_decoding_and_full_forward(ext):
    """The references cache raw keys with their positions and, for ``q_len == 1``, rotate the
    keys by minus the clipped (ReRoPE), leaky or grouped (Self-Extend) distance; posenc's cache
    also holds raw keys and recomputes both maps per pair, so decoding equals the full forward."""
    attn = make_attn(ext)
    x = _x()
    prefill = 6
    with torch.no_grad():
        full = attn(x)
        cache = attn.init_cache(2, L)
        outs = [attn(x[:, :prefill], cache=cache)]
        for t in range(prefill, L):
            step = attn(x[:, t : t + 1], cache=cache)
            assert_close(
                step,
                reference(ext, attn, x[:, : t + 1], torch.arange(t + 1).expand(2, t + 1), decode=True),
                n=N,
                msg=f"{ext} step {t}",
            )
            outs.append(step)
    assert_close(torch.cat(outs, 1), full, n=N, msg=f"{ext}: cached decoding vs full forward")


def test_wide_window_is_plain_rope():
    """A window past every distance leaves only the near map: exactly RoPE (log-n off)."""
    x = _x()
    plain = make_attn(None)
    for ext in (
        {"type": "rerope", "window": L, "scale_base": None},
        {"type": "leaky-rerope", "window": L, "factor": 3, "scale_base": None},
        {"type": "self-extend", "window": L, "group_size": 4},
    ):
        with torch.no_grad():
            assert_close(make_attn(ext)(x), plain(x), n=N, msg=str(ext))


def test_far_pairs_see_clipped_or_grouped_distances():
    """Scores read off one layer: ReRoPE's far pairs all sit at distance w; Self-Extend's at the
    grouped distance, continuous with the neighbours at d = W (distances from the formulas,
    not from the implementation)."""
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, 1, HEAD_DIM).expand(1, HEADS, L, HEAD_DIM).contiguous()  # the same query everywhere
    k = q.clone()
    pos = torch.arange(L)[None]
    plain = posenc.build("rope", heads=HEADS, head_dim=HEAD_DIM)
    qr, kr = plain.rotate(q, k, pos, pos)
    by_distance = (qr[:, :, L - 1 :] @ kr.transpose(-1, -2))[0, :, 0].flip(-1)  # (H, L): RoPE score at distance d
    rr = posenc.build("rope-extension", heads=HEADS, head_dim=HEAD_DIM, rope_extension={"type": "rerope", "window": 5})
    s = rr.qk_scores(q, k, pos, pos)[0, :, L - 1].flip(-1)  # (H, L): at distance d = 0..L-1
    assert_close(s[:, :5], by_distance[:, :5], n=HEAD_DIM)
    assert_close(s[:, 5:], by_distance[:, 5:6].expand(-1, L - 5), n=HEAD_DIM)
    se = posenc.build(
        "rope-extension",
        heads=HEADS,
        head_dim=HEAD_DIM,
        rope_extension={"type": "self-extend", "window": 8, "group_size": 4},
    )
    s = se.qk_scores(q, k, pos, pos)[0, :, L - 1]  # query i = 23, keys j
    i = L - 1
    expected = [by_distance[:, i - j] if i - j < 8 else by_distance[:, i // 4 + 8 - 2 - j // 4] for j in range(L)]
    assert_close(s, torch.stack(expected, -1), n=HEAD_DIM)


def test_declarations():
    rope = posenc.build("rope", heads=HEADS, head_dim=HEAD_DIM, max_len=TRAIN)
    assert rope.stages == Stage.QK and rope.relative
    for ext, relative in (
        ({"type": "rerope", "window": 4}, False),  # log-n scaling with the training length
        ({"type": "rerope", "window": 4, "scale_base": None}, True),
        ({"type": "leaky-rerope", "window": 4, "factor": 2, "scale_base": None}, True),
        ({"type": "self-extend", "window": 4, "group_size": 2}, False),  # floor(i/G) is absolute
        ({"type": "dca", "chunk_size": 4, "local_size": 1}, False),  # so are its chunks floor(i/n)
    ):
        enc = posenc.build("rope-extension", heads=HEADS, head_dim=HEAD_DIM, max_len=TRAIN, rope_extension=ext)
        assert enc.stages == Stage.SCORES and enc.relative is relative, ext
        assert posenc.supported_backends(enc) == ["maps", "chunked", "eager"]
        assert posenc.select_backend(enc, "cuda") == "chunked"  # (maps' fused calls are the CPU kernel's)
        assert posenc.select_backend(enc, "cpu") == "maps"
        assert enc.rope_extension.get("scale_base") == ext.get(
            "scale_base", TRAIN if ext["type"] in ("rerope", "leaky-rerope") else None
        )
    # a class of its own: rope takes no rope_extension, and says which class does
    assert "rope_extension" in posenc.registry.options_of(posenc.get_class("rope-extension"))
    assert "rope_extension" not in posenc.registry.options_of(posenc.get_class("rope"))
    with pytest.raises(
        ValueError, match=r"unknown option\(s\) \['rope_extension'\] for encoding 'rope';.*'rope-extension' takes them"
    ):
        posenc.build("rope", heads=HEADS, head_dim=HEAD_DIM, rope_extension={"type": "rerope", "window": 4})


# ---------------------------------------------------------------------------- contract
CONTRACT = [
    {"type": "rerope", "window": 3},
    {"type": "rerope", "window": 3, "scale_base": None},
    {"type": "leaky-rerope", "window": 3, "factor": 2},
    {"type": "self-extend", "window": 3, "group_size": 2},
    {"type": "dca", "chunk_size": 3, "local_size": 1},  # chunks of 2 tokens: all three maps in use
]
CL = 8  # L of the contract checks; max_len 4: positions past it, both maps in use
N_C = attention_n(dim=DIM, head_dim=HEAD_DIM, length=CL)
N_C_GRAD = attention_n(dim=DIM, head_dim=HEAD_DIM, length=CL, grad=True)
N_LM = lm_n(dim=DIM, depth=2, length=CL)


def make_lm(ext, seed=0):
    torch.manual_seed(seed)
    lm = posenc.TransformerLM(32, DIM, 2, HEADS, encoding="rope-extension", max_len=4, rope_extension=ext)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return lm.eval()


@pytest.mark.parametrize("ext", CONTRACT, ids=_id)
def test_contract(ext):
    attn = make_attn(ext, max_len=4, chunk_size=3)
    x = _x(n=CL)
    # shapes, dtypes, gradients to every parameter
    for dtype in (torch.float32, torch.bfloat16):
        y = attn.to(dtype)(x.to(dtype))
        assert y.shape == x.shape and y.dtype == dtype and torch.isfinite(y).all()
    attn.float()
    xi = x.clone().requires_grad_(True)
    attn(xi).square().sum().backward()
    for name, p in attn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    attn.zero_grad()
    with torch.no_grad():
        # explicit positions equal the default ones
        assert_close(attn(x, pos=torch.arange(CL).expand(2, CL)), attn(x), n=N_C)
        # declared shift invariance
        base, shifted = attn(x), attn(x, pos=torch.arange(CL) + 5)
        if attn.encoding.relative:
            assert_close(shifted, base, n=N_C + CL + 5)
        else:
            assert not torch.allclose(shifted, base, atol=1e-3)
    # backends equal the eager oracle (outputs and gradients), with different positions per row
    pos = torch.stack([torch.arange(CL), torch.arange(CL) + 3])
    assert_backend_equals_eager(attn, x, pos, "chunked", n=N_C, n_grad=N_C_GRAD, msg=str(ext))
    for b in ("sdpa", "dense", "flex"):
        with pytest.raises(ValueError, match="cannot run encoding 'rope-extension'"):
            attn(x, backend=b)
    # ... with a cache, and a fully padded row gives 0, not NaN, on both backends
    kpm = torch.ones(2, CL, dtype=torch.bool)
    kpm[0], kpm[1, :3] = False, False
    outs = {}
    for b in ("eager", "chunked"):
        cache = attn.init_cache(2, CL)
        with torch.no_grad():
            outs[b] = torch.cat([attn(x[:, :5], cache=cache, backend=b), attn(x[:, 5:], cache=cache, backend=b)], 1)
        xi = x.clone().requires_grad_(True)
        y = attn(xi, key_padding_mask=kpm, backend=b)
        assert torch.equal(y[0].detach(), torch.zeros(CL, DIM)) and torch.equal(y[1, :3].detach(), torch.zeros(3, DIM))
        y.sum().backward()
        assert torch.isfinite(xi.grad).all()
    assert_close(outs["chunked"], outs["eager"], n=N_C)


@pytest.mark.parametrize("ext", CONTRACT, ids=_id)
def test_contract_model(ext):
    lm = make_lm(ext)
    t = torch.randint(0, 32, (2, 10))
    with torch.no_grad():
        full = lm(t)
        cache = lm.init_cache(batch_size=2, max_len=12)
        steps = torch.cat([lm(t[:, i : i + 1], cache=cache) for i in range(10)], 1)
        assert_close(steps, full, n=N_LM, msg=f"{ext}: token by token")
        cache = lm.init_cache(batch_size=2, max_len=12)
        chunks = torch.cat([lm(t[:, :4], cache=cache), lm(t[:, 4:7], cache=cache), lm(t[:, 7:], cache=cache)], 1)
        assert_close(chunks, full, n=N_LM, msg=f"{ext}: chunked prefill")
        other = make_lm(ext, seed=1)
        other.load_state_dict(lm.state_dict())
        assert_close(other(t), full, n=N_LM)
        with torch.device("meta"):
            meta = posenc.TransformerLM(32, DIM, 2, HEADS, encoding="rope-extension", max_len=4, rope_extension=ext)
        meta.to_empty(device="cpu")
        for m in meta.modules():
            if isinstance(m, posenc.PositionEncoding):
                m.init_buffers()
        meta.load_state_dict(lm.state_dict())
        assert_close(meta(t), full, n=N_LM)


@pytest.mark.parametrize(
    "ext,kw,match",
    [
        ("rerope", {}, "must be a dict or None"),
        ({"type": "rope"}, {}, "type must be one of"),
        ({"window": 4}, {}, "type must be one of"),
        ({"type": "rerope"}, {}, r"needs \['window'\]"),
        ({"type": "leaky-rerope", "window": 4}, {}, r"needs \['factor'\]"),
        ({"type": "self-extend", "window": 4}, {}, r"needs \['group_size'\]"),
        ({"type": "rerope", "window": 4, "group_size": 2}, {}, r"unknown rope_extension key\(s\) \['group_size'\]"),
        ({"type": "rerope", "window": 0}, {}, "window must be a positive int, got 0"),
        ({"type": "rerope", "window": 2.5}, {}, "window must be a positive int, got 2.5"),
        ({"type": "self-extend", "window": 4, "group_size": 0}, {}, "group_size must be a positive int"),
        ({"type": "leaky-rerope", "window": 4, "factor": 1}, {}, "factor .* must be > 1, got 1"),
        (
            {"type": "rerope", "window": 4, "scale_base": 1},
            {},
            r"scale_base must be a number > 1 or None \(no log-n scaling\), got 1",
        ),
        ({"type": "rerope", "window": 4}, {"causal": False}, "causal"),
        # a class of its own (rope-extension) that takes neither axes nor rope_scaling
        ({"type": "rerope", "window": 4}, {"axes": 2}, r"unknown option\(s\) \['axes'\] for encoding 'rope-extension'"),
        (
            {"type": "rerope", "window": 4},
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            r"unknown option\(s\) \['rope_scaling'\] for encoding 'rope-extension'; valid options: base",
        ),
    ],
)
def test_bad_extension_raises(ext, kw, match):
    err = TypeError if isinstance(ext, str) else ValueError
    with pytest.raises(err, match=match):
        posenc.build("rope-extension", heads=HEADS, head_dim=HEAD_DIM, max_len=TRAIN, rope_extension=ext, **kw)


def test_qk_scores_of_plain_rope_raises():
    rope = posenc.build("rope", heads=HEADS, head_dim=HEAD_DIM)
    q = torch.randn(1, HEADS, 3, HEAD_DIM)
    assert not rope.stages & posenc.Stage.SCORES  # the SCORES stage is rope-extension's, a class of its own
    with pytest.raises(NotImplementedError):
        rope.qk_scores(q, q, torch.arange(3)[None], torch.arange(3)[None])
