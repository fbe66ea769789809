"""The contract suite for positions with axes (``pos`` ``(B, L, A)``).

Enrolment is by declaration, with no per-encoding list: every registered encoding whose
default instance reads ``A > 1`` coordinates (``mrope``) runs with that ``A``; every one that
takes an ``axes`` option runs with ``axes=2`` and ``axes=3``, and with ``rope_mixed=True``
when it takes that option. Every encoding that reads one position per token must refuse
positions with axes with a ``ValueError``.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from tests.conftest import assert_close, attention_n, encoding_modes, lm_n, mode_id
from tests.test_contract import assert_backend_equals_eager

import posenc
from posenc.positions import grid
from posenc.registry import options_of

HEADS, HEAD_DIM = 2, 12  # 6 rotary pairs: 3 per axis for A = 2, 2 for A = 3
DIM, MAX_LEN = HEADS * HEAD_DIM, 16
SIZES = {2: (2, 4), 3: (2, 2, 2)}  # L = 8 tokens
L = 8
N_ATTN = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L)
N_ATTN_GRAD = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L, grad=True)
N_LM = lm_n(dim=DIM, depth=2, length=L)


def _axis_modes() -> list[tuple[str, bool, dict]]:
    out = []
    for name, causal in encoding_modes():
        cls = posenc.get_class(name)
        variants = []
        default_axes = posenc.build(name, heads=HEADS, head_dim=HEAD_DIM, max_len=MAX_LEN, causal=causal).axes
        if default_axes > 1:
            variants.append({})
        if "axes" in options_of(cls):
            variants += [{"axes": 2}, {"axes": 3}]
            if "rope_mixed" in options_of(cls):
                variants.append({"axes": 2, "rope_mixed": True})
        out += [(name, causal, v) for v in variants]
    return out


AXIS_MODES = _axis_modes()


def _id(p) -> str:
    name, causal, opts = p
    return mode_id((name, causal)) + "".join(f"-{k}={v}" for k, v in opts.items())


def make_attn(name, causal, options, seed=0, **kw) -> posenc.Attention:
    torch.manual_seed(seed)
    attn = posenc.Attention(DIM, HEADS, name, head_dim=HEAD_DIM, causal=causal, max_len=MAX_LEN, **options, **kw)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return attn


def make_lm(name, options, seed=0) -> posenc.TransformerLM:
    torch.manual_seed(seed)
    lm = posenc.TransformerLM(32, DIM, 2, HEADS, encoding=name, max_len=MAX_LEN, head_dim=HEAD_DIM, **options)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return lm.eval()


def _x(B=2, seed=1, dtype=torch.float32):
    return torch.randn(B, L, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _pos(axes: int) -> torch.Tensor:
    """(B=2, L, A): a grid, and the same grid moved by a different amount on every axis."""
    g = grid(*SIZES[axes])
    return torch.stack((g, g + torch.arange(1, axes + 1)))


def test_enrolment_covers_the_multi_axis_encodings():
    names = {(n, tuple(sorted(o.items()))) for n, _, o in AXIS_MODES}
    for expected in [
        ("mrope", ()),
        ("rope", (("axes", 2),)),
        ("sinusoidal", (("axes", 3),)),
        ("learned", (("axes", 2),)),
    ]:
        assert expected in names
    assert ("rope", (("axes", 2), ("rope_mixed", True))) in names


@pytest.mark.parametrize("mode", AXIS_MODES, ids=_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shapes_and_dtypes(mode, dtype):
    name, causal, opts = mode
    attn = make_attn(name, causal, opts).to(dtype)
    A = attn.encoding.axes
    y = attn(_x(dtype=dtype), pos=_pos(A))
    assert y.shape == (2, L, DIM) and y.dtype == dtype and torch.isfinite(y.float()).all()
    lm = make_lm(name, opts).to(dtype)
    logits = lm(torch.randint(0, 32, (2, L)), pos=_pos(A))
    assert logits.shape == (2, L, 32) and torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("mode", AXIS_MODES, ids=_id)
def test_gradients_reach_every_parameter(mode):
    name, causal, opts = mode
    attn = make_attn(name, causal, opts)
    x = _x().requires_grad_()
    pos = _pos(attn.encoding.axes)
    y = attn(x, pos=pos)
    (y * torch.randn(2, L, DIM)).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for pname, p in attn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} {opts}: no gradient for {pname}"


@pytest.mark.parametrize("mode", AXIS_MODES, ids=_id)
def test_one_position_per_token_is_the_diagonal(mode):
    """``(L,)`` / ``(B, L)`` / ``None`` positions mean the same coordinate on every axis."""
    name, causal, opts = mode
    attn = make_attn(name, causal, opts)
    A = attn.encoding.axes
    x = _x()
    diag = torch.arange(L).unsqueeze(-1).expand(L, A)
    ref = attn(x, pos=diag)
    assert_close(attn(x), ref, n=N_ATTN)
    assert_close(attn(x, pos=torch.arange(L)), ref, n=N_ATTN)
    assert_close(attn(x, pos=torch.arange(L).expand(2, L)), ref, n=N_ATTN)


@pytest.mark.parametrize("mode", [m for m in AXIS_MODES if m[1]], ids=_id)
def test_kv_cache_decoding_equals_full_forward(mode):
    name, _, opts = mode
    lm = make_lm(name, opts)
    A = lm.blocks[0].attn.encoding.axes
    t, pos = torch.randint(0, 32, (2, L)), _pos(A)
    with torch.no_grad():
        full = lm(t, pos=pos)
        cache = lm.init_cache(batch_size=2, max_len=L + 2)
        steps = [lm(t[:, i : i + 1], pos=pos[:, i : i + 1], cache=cache) for i in range(L)]
        assert_close(torch.cat(steps, 1), full, n=N_LM, msg=f"{name} {opts}: token by token")
        assert cache.layers[0].pos.shape == (2, L + 2, A)
        cache = lm.init_cache(batch_size=2, max_len=L)
        chunks = [lm(t[:, :3], pos=pos[:, :3], cache=cache), lm(t[:, 3:], pos=pos[:, 3:], cache=cache)]
        assert_close(torch.cat(chunks, 1), full, n=N_LM, msg=f"{name} {opts}: chunked prefill")


@pytest.mark.parametrize("mode", AXIS_MODES, ids=_id)
def test_shift_invariance_along_each_axis(mode):
    """Relative encodings: unchanged when one axis shifts, changed when its distances stretch;
    absolute ones: changed by a shift of any axis."""
    name, causal, opts = mode
    attn = make_attn(name, causal, opts).eval()
    A = attn.encoding.axes
    x, pos = _x(), _pos(A)
    with torch.no_grad():
        base = attn(x, pos=pos)
        for a in range(A):
            shifted = pos.clone()
            shifted[..., a] += 5
            out = attn(x, pos=shifted)
            if attn.encoding.relative:
                assert_close(out, base, n=N_ATTN + L + 5, msg=f"{name} {opts}: axis {a}")
                stretched = pos.clone()
                stretched[..., a] *= 3  # distances along axis a change: the output must follow
                moved = attn(x, pos=stretched)
                assert not torch.allclose(moved, base, rtol=1e-4, atol=1e-5), f"{name} {opts}: axis {a} unused"
            else:
                assert not torch.allclose(out, base, rtol=1e-4, atol=1e-5), f"{name} {opts}: axis {a} unused"


@pytest.mark.parametrize("mode", AXIS_MODES, ids=_id)
def test_backends_equal_eager_oracle(mode):
    name, causal, opts = mode
    attn = make_attn(name, causal, opts, chunk_size=3)
    pos = _pos(attn.encoding.axes)
    for backend in posenc.supported_backends(attn.encoding):
        if backend != "eager":
            assert_backend_equals_eager(attn, _x(), pos, backend, n=N_ATTN, n_grad=N_ATTN_GRAD, msg=f"{name} {opts}")


@pytest.mark.parametrize("mode", AXIS_MODES, ids=_id)
def test_state_dict_and_meta_device(mode):
    name, causal, opts = mode
    a, b = make_attn(name, causal, opts, seed=0), make_attn(name, causal, opts, seed=1)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    x, pos = _x(), _pos(a.encoding.axes)
    assert_close(b(x, pos=pos), a(x, pos=pos), n=N_ATTN)
    with torch.device("meta"):
        meta = posenc.Attention(DIM, HEADS, name, head_dim=HEAD_DIM, causal=causal, max_len=MAX_LEN, **opts)
    meta.to_empty(device="cpu")
    meta.encoding.init_buffers()
    meta.load_state_dict(a.state_dict())
    assert_close(meta(x, pos=pos), a(x, pos=pos), n=N_ATTN)


@pytest.mark.parametrize("mode", AXIS_MODES, ids=_id)
def test_wrong_number_of_axes_raises(mode):
    name, causal, opts = mode
    attn = make_attn(name, causal, opts)
    A = attn.encoding.axes
    wrong = torch.zeros(2, L, A + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"\(B, L, {A}\).*got shape \(2, {L}, {A + 1}\)"):
        attn(_x(), pos=wrong)
    lm = make_lm(name, opts)
    with pytest.raises(ValueError, match=rf"axes={A}"):
        lm(torch.randint(0, 32, (2, L)), pos=wrong)


@pytest.mark.parametrize("mode", encoding_modes(), ids=mode_id)
def test_one_axis_encodings_refuse_positions_with_axes(mode):
    name, causal = mode
    attn = posenc.Attention(DIM, HEADS, name, head_dim=HEAD_DIM, causal=causal, max_len=MAX_LEN)
    if attn.encoding.axes > 1:
        return
    pos = _pos(2)
    with pytest.raises(ValueError, match=r"one position per token \(axes=1\).*\(2, 8, 2\)"):
        attn(_x(), pos=pos)
    with pytest.raises(ValueError, match=r"looks like \(L, A\) positions with A=2 axes"):
        attn(_x(), pos=pos[0])
    lm = posenc.TransformerLM(32, DIM, 1, HEADS, encoding=name, max_len=MAX_LEN, head_dim=HEAD_DIM)
    with pytest.raises(ValueError, match=r"one position per token"):
        lm(torch.randint(0, 32, (2, L)), pos=pos)


def test_axes_option_is_documented_where_it_exists():
    for name in posenc.available():
        cls = posenc.get_class(name)
        if "axes" in options_of(cls):
            assert "axes" in (inspect.getdoc(cls) or "") + (inspect.getmodule(cls).__doc__ or ""), name
