"""The contract suite: every registered encoding, in every mode it supports.

Parametrised over ``posenc.available()``, so an encoding that registers is enrolled
with no opt-in. What it checks, for every encoding and mode: shapes and dtypes, gradients
to every parameter, explicit ``arange`` positions equal ``None``, cached decoding equals
the full forward, declared shift invariance, behaviour past ``max_len``, every backend
equals the eager oracle (outputs and gradients), fully padded rows give 0 (no NaN across
layers), ``state_dict`` round trip, meta-device construction, errors on bad input.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests.conftest import (
    DIM,
    HEAD_DIM,
    HEADS,
    MAX_LEN,
    assert_close,
    attention_n,
    encoding_modes,
    lm_n,
    mode_id,
    tolerance,
)

import posenc
from posenc import Stage

MODES = encoding_modes()
CAUSAL = [(n, c) for n, c in MODES if c]
L = 8
# reduction lengths behind the compared values (tolerances: tests/conftest.py's rule)
N_ATTN = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L)
N_ATTN_GRAD = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L, grad=True)
N_LM = lm_n(dim=DIM, depth=2, length=L)


def make_attn(name: str, causal: bool, seed: int = 0, **kw) -> posenc.Attention:
    torch.manual_seed(seed)
    attn = posenc.Attention(DIM, HEADS, name, head_dim=HEAD_DIM, causal=causal, max_len=MAX_LEN, **kw)
    _randomize(attn)
    return attn


def make_lm(name: str, seed: int = 0, depth: int = 2) -> posenc.TransformerLM:
    torch.manual_seed(seed)
    lm = posenc.TransformerLM(vocab_size=32, dim=DIM, depth=depth, heads=HEADS, encoding=name, max_len=MAX_LEN)
    _randomize(lm)
    return lm.eval()


def _randomize(module: torch.nn.Module) -> None:
    """Give every parameter non-trivial values (zero-initialised parameters hide bugs)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))


def _x(B=2, L=L, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, DIM, generator=g).to(dtype)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shapes_and_dtypes(mode, dtype):
    name, causal = mode
    attn = make_attn(name, causal).to(dtype)
    y = attn(_x(dtype=dtype))
    assert y.shape == (2, L, DIM) and y.dtype == dtype
    assert torch.isfinite(y.float()).all()
    lm = make_lm(name).to(dtype)
    logits = lm(torch.randint(0, 32, (2, L)))
    assert logits.shape == (2, L, 32) and logits.dtype == dtype


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_bf16_autocast_forward_and_backward(mode):
    """float32 weights under a bfloat16 autocast (how the training loop runs bf16): the
    encoding's float32 position math meets bf16 matmuls without a dtype error, and the
    result stays close to the float32 one."""
    name, causal = mode
    attn = make_attn(name, causal)
    x = _x().requires_grad_()
    ref = attn(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attn(x)
    y.float().square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert (y.float() - ref).abs().max() < 0.1 * ref.abs().max() + 0.05


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_gradients_reach_every_parameter(mode):
    name, causal = mode
    attn = make_attn(name, causal)
    x = _x().requires_grad_()
    w = torch.randn(2, L, DIM)
    y = attn(x)
    (y * w).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for pname, p in attn.named_parameters():
        assert p.grad is not None, f"{name}: no gradient for {pname}"
        if p.grad.abs().sum() > 0:
            continue
        # an exactly zero gradient is right only for a parameter the output does not depend on
        # (e.g. a per-head constant added to every score of a row: the softmax cancels it)
        with torch.no_grad():
            p.add_(1.0)
            moved = attn(x)
            p.sub_(1.0)
        assert_close(
            moved, y.detach(), n=N_ATTN, msg=f"{name}: zero gradient for {pname}, yet the output depends on it"
        )


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_explicit_arange_equals_none(mode):
    name, causal = mode
    attn = make_attn(name, causal)
    x = _x()
    ref = attn(x)
    assert_close(attn(x, pos=torch.arange(L)), ref, n=N_ATTN)
    assert_close(attn(x, pos=torch.arange(L).expand(2, L)), ref, n=N_ATTN)
    lm = make_lm(name)
    t = torch.randint(0, 32, (2, L))
    assert_close(lm(t, pos=torch.arange(L)), lm(t), n=N_LM)


@pytest.mark.parametrize("name", [n for n, _ in CAUSAL])
def test_kv_cache_decoding_equals_full_forward(name):
    lm = make_lm(name)
    t = torch.randint(0, 32, (2, 10))
    with torch.no_grad():
        full = lm(t)
        cache = lm.init_cache(batch_size=2, max_len=12)
        steps = [lm(t[:, i : i + 1], cache=cache) for i in range(10)]
        assert cache.length == 10
        assert_close(torch.cat(steps, dim=1), full, n=N_LM, msg=f"{name}: token by token")
        cache = lm.init_cache(batch_size=2, max_len=12)
        chunks = [lm(t[:, :4], cache=cache), lm(t[:, 4:7], cache=cache), lm(t[:, 7:], cache=cache)]
        assert_close(torch.cat(chunks, dim=1), full, n=N_LM, msg=f"{name}: chunked prefill")


@pytest.mark.parametrize("name", [n for n, _ in CAUSAL])
def test_head_dim_other_than_dim_over_heads(name):
    """``heads·head_dim != dim`` (an explicit ``head_dim``: Qwen3-0.6B, Gemma): what acts on the
    layer's input gets the layer's width (posenc.layer.setup.build_for_layer), the model runs
    forward and decodes with its cache as it runs whole."""
    torch.manual_seed(0)
    kw = dict(vocab_size=32, dim=DIM, depth=2, heads=HEADS, head_dim=2 * HEAD_DIM, encoding=name, max_len=MAX_LEN)
    lm = posenc.TransformerLM(**kw)
    _randomize(lm)
    lm.eval()
    t = torch.randint(0, 32, (2, 10))
    with torch.no_grad():
        full = lm(t)
        cache = lm.init_cache(batch_size=2, max_len=12)
        steps = torch.cat([lm(t[:, i : i + 1], cache=cache) for i in range(10)], dim=1)
    assert torch.isfinite(full).all()
    assert_close(steps, full, n=lm_n(dim=2 * HEADS * HEAD_DIM, depth=2, length=L + 2), msg=name)


def test_an_input_and_score_encoding_that_is_not_told_the_width_is_refused():
    """No registered encoding is one (DeBERTa's EMD takes ``hidden_size``): a user's encoding with
    an input stage and a bias, whose input table is ``heads·head_dim`` wide, cannot serve a layer
    of another width, and says so before anything runs."""
    from posenc.layer.setup import _sizes

    class Both(posenc.PositionEncoding):
        def embed(self, x, pos):
            return x

        def bias(self, q_pos, k_pos):
            return torch.zeros(self.heads, q_pos.shape[-1], k_pos.shape[-1])

    assert Both.stages == Stage.INPUT | Stage.BIAS

    with pytest.raises(ValueError, match=r"encoding 'both' has an input stage and a score stage: .* 2 x 16 != 16"):
        _sizes(Both, "both", HEADS, 2 * HEAD_DIM, DIM)
    assert _sizes(Both, "both", HEADS, HEAD_DIM, DIM) == (HEADS, HEAD_DIM)  # widths agree: as built


@pytest.mark.parametrize("name", [n for n, _ in CAUSAL])
def test_windowed_kv_cache_decoding_equals_full_forward(name):
    """A window (3) in layer 0 and chunks (4) in layer 1: the rolling caches keep O(W) keys."""
    torch.manual_seed(0)
    specs = [posenc.LayerSpec(name, window=3), posenc.LayerSpec(name, chunk=4)]
    cfg = posenc.ModelConfig(32, DIM, 2, HEADS, encoding=name, max_len=MAX_LEN, head_dim=HEAD_DIM, layers=specs)
    lm = posenc.TransformerLM(config=cfg)
    _randomize(lm)
    lm.eval()
    t = torch.randint(0, 32, (2, 10))
    with torch.no_grad():
        full = lm(t)
        for cuts in ((1,) * 10, (4, 3, 3)):
            cache, outs, i = lm.init_cache(batch_size=2, max_len=12), [], 0
            for c in cuts:
                outs.append(lm(t[:, i : i + c], cache=cache))
                i += c
            assert_close(torch.cat(outs, dim=1), full, n=N_LM, msg=f"{name}: steps {cuts}")


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_relative_encodings_are_shift_invariant(mode):
    name, causal = mode
    attn = make_attn(name, causal).eval()
    x = _x()
    with torch.no_grad():
        base = attn(x, pos=torch.arange(L))
        shifted = attn(x, pos=torch.arange(L) + 5)
    if attn.encoding.relative:
        # shifted positions round their angles/distances differently: one more term per score
        assert_close(shifted, base, n=N_ATTN + L + 5, msg=f"{name} declares relative=True")
        return
    # absolute: invariance must break at some shift (FIRE is relative below its threshold
    # of 512 positions; tables of max_len positions cannot shift past it)
    # ("broken": further apart than the rounding allowed to a relative encoding at that shift)
    magnitude = max(1.0, float(base.abs().amax()))
    broken = not torch.allclose(shifted, base, **tolerance(n=N_ATTN + L + 5, magnitude=magnitude))
    for shift in (1000, 100_000):  # (Llama 4's temperature steps every 8192 positions)
        if not broken and (attn.encoding.extrapolates or attn.encoding.max_len is None):
            with torch.no_grad():
                far = attn(x, pos=torch.arange(L) + shift)
            broken = not torch.allclose(far, base, **tolerance(n=N_ATTN + L + shift, magnitude=magnitude))
    assert broken, f"{name} declares relative=False"


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_past_max_len_works_or_raises(mode):
    name, causal = mode
    attn = make_attn(name, causal)
    pos = torch.arange(MAX_LEN - 2, MAX_LEN - 2 + L)
    if attn.encoding.extrapolates:
        assert torch.isfinite(attn(_x(), pos=pos)).all()
    else:
        with pytest.raises(ValueError, match="max_len"):
            attn(_x(), pos=pos)
        lm = make_lm(name)
        with pytest.raises(ValueError, match="max_len"):
            lm(torch.randint(0, 32, (1, MAX_LEN + 1)))


BACKEND_CASES = [
    (n, c, b)
    for n, c in MODES
    for b in posenc.supported_backends(posenc.build(n, heads=HEADS, head_dim=HEAD_DIM, max_len=MAX_LEN, causal=c))
    if b != "eager"
]


def assert_backend_equals_eager(attn, x, pos, backend, *, n, n_grad, msg=""):
    """``backend`` against the eager oracle on the same layer: outputs, and gradients of the
    input and every parameter (FlexAttention has no CPU backward: outputs only)."""
    with_grad = backend != "flex"
    outs, grads = {}, {}
    for b in ("eager", backend):
        attn.zero_grad()
        xi = x.clone().requires_grad_(with_grad)
        with torch.set_grad_enabled(with_grad):
            y = attn(xi, pos=pos, backend=b)
        outs[b] = y.detach()
        if with_grad:
            (y * torch.linspace(-1, 1, x.shape[-1])).sum().backward()
            grads[b] = [xi.grad] + [p.grad.clone() for p in attn.parameters()]
    assert_close(outs[backend], outs["eager"], n=n, msg=f"{msg}/{backend} output")
    for g, ge in zip(grads.get(backend, []), grads.get("eager", [])):
        assert_close(g, ge, n=n_grad, msg=f"{msg}/{backend} gradient")


@pytest.mark.parametrize("name,causal,backend", BACKEND_CASES, ids=lambda v: str(v))
def test_backend_equals_eager_oracle(name, causal, backend):
    attn = make_attn(name, causal, chunk_size=3)  # chunk_size 3 exercises the chunked relative path
    pos = torch.stack([torch.arange(L), torch.arange(L) + 3])  # (B, L): different positions per row
    assert_backend_equals_eager(attn, _x(), pos, backend, n=N_ATTN, n_grad=N_ATTN_GRAD, msg=name)


ALL_BACKEND_CASES = [
    (n, c, b)
    for n, c in MODES
    for b in posenc.supported_backends(posenc.build(n, heads=HEADS, head_dim=HEAD_DIM, max_len=MAX_LEN, causal=c))
]


@pytest.mark.parametrize("name,causal,backend", ALL_BACKEND_CASES, ids=lambda v: str(v))
def test_fully_padded_row_gives_zero_not_nan(name, causal, backend):
    """A query row that sees no key: output 0 on every backend, finite gradients (issue 11)."""
    attn = make_attn(name, causal)
    x = _x()
    kpm = torch.ones(2, L, dtype=torch.bool)
    kpm[0] = False  # row 0 sees nothing at all
    if causal:
        kpm[1, :3] = False  # left padding: the first 3 queries of row 1 see no key
    with_grad = backend != "flex"  # FlexAttention has no CPU backward
    xi = x.clone().requires_grad_(with_grad)
    with torch.set_grad_enabled(with_grad):
        y = attn(xi, key_padding_mask=kpm, backend=backend)
    assert torch.isfinite(y).all(), f"{name}/{backend}: non-finite output"
    bias = attn.o_proj.bias if attn.o_proj.bias is not None else torch.zeros(DIM)
    assert torch.equal(y[0].detach(), bias.detach().expand(L, DIM)), "a row that sees nothing attends to nothing"
    if causal:
        assert torch.equal(y[1, :3].detach(), bias.detach().expand(3, DIM))
    if with_grad:
        y.sum().backward()
        assert torch.isfinite(xi.grad).all()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in attn.parameters())


@pytest.mark.parametrize("name", [n for n, _ in CAUSAL])
def test_left_padding_no_nan_crosses_layers(name):
    """A left-padded batch through a 2-layer model: the real tokens' logits stay finite and
    equal those of the unpadded sequence at the same positions (issue 11)."""
    lm = make_lm(name, depth=2)
    toks = torch.randint(0, 32, (1, 6))
    pad = 3
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), toks], 1)
    kpm = torch.cat([torch.zeros(1, pad, dtype=torch.bool), torch.ones(1, 6, dtype=torch.bool)], 1)
    pos = torch.cat([torch.zeros(pad, dtype=torch.long), torch.arange(6)])[None]  # real tokens at 0..5
    with torch.no_grad():
        out = lm(padded, pos=pos, key_padding_mask=kpm)
        ref = lm(toks)
    assert torch.isfinite(out).all()
    assert_close(out[:, pad:], ref, n=lm_n(dim=DIM, depth=2, length=L + 1), msg=name)


@pytest.mark.parametrize("name", [n for n, _ in CAUSAL])
def test_backends_equal_eager_with_cache(name):
    lm = make_lm(name, depth=1)
    attn = lm.blocks[0].attn
    x = _x()
    for backend in posenc.supported_backends(attn.encoding):
        if backend == "eager":
            continue
        outs = {}
        for b in ("eager", backend):
            cache = attn.init_cache(2, L)
            with torch.no_grad():
                outs[b] = torch.cat([attn(x[:, :5], cache=cache, backend=b), attn(x[:, 5:], cache=cache, backend=b)], 1)
        assert_close(outs[backend], outs["eager"], n=N_ATTN, msg=f"{name}/{backend}")


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_state_dict_round_trip(mode):
    name, causal = mode
    a, b = make_attn(name, causal, seed=0), make_attn(name, causal, seed=1)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    x = _x()
    assert_close(b(x), a(x), n=N_ATTN)
    lm_a, lm_b = make_lm(name, seed=0), make_lm(name, seed=1)
    lm_b.load_state_dict(lm_a.state_dict())
    t = torch.randint(0, 32, (2, L))
    assert_close(lm_b(t), lm_a(t), n=N_LM)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_meta_device_construction(mode):
    name, causal = mode
    real = make_attn(name, causal)
    with torch.device("meta"):
        meta = posenc.Attention(DIM, HEADS, name, head_dim=HEAD_DIM, causal=causal, max_len=MAX_LEN)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.encoding.init_buffers()
    meta.load_state_dict(real.state_dict())
    x = _x()
    assert_close(meta(x), real(x), n=N_ATTN)
    with torch.device("meta"):
        lm = posenc.TransformerLM(32, DIM, 2, HEADS, encoding=name, max_len=MAX_LEN)
    assert all(p.is_meta for p in lm.parameters())


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_bad_input_raises(mode):
    name, causal = mode
    attn = make_attn(name, causal)
    with pytest.raises(ValueError, match=r"shape \(B, L, 16\)"):
        attn(torch.randn(L, DIM))
    with pytest.raises(ValueError, match=r"shape \(B, L, 16\)"):
        attn(torch.randn(2, L, DIM + 1))
    with pytest.raises(TypeError, match="integer dtype"):
        attn(_x(), pos=torch.arange(L).float())
    with pytest.raises(ValueError, match="non-negative.*-3"):
        attn(_x(), pos=torch.arange(L) - 3)
    with pytest.raises(ValueError, match=f"length {L + 1}.*length {L}"):
        attn(_x(), pos=torch.arange(L + 1))
    with pytest.raises(ValueError, match=r"shape \(L,\) or \(B, L\)"):
        attn(_x(), pos=torch.arange(L).view(1, 1, L))
    enc = attn.encoding
    q = torch.randn(2, HEADS, L, HEAD_DIM)
    k = torch.randn(2, HEADS, L, HEAD_DIM)
    short = torch.arange(L - 1)
    if enc.stages & Stage.QK:
        with pytest.raises(ValueError, match=f"{L - 1}.*{L}"):
            enc.rotate(q, k, short, torch.arange(L))
    if enc.stages & Stage.TERMS:
        with pytest.raises(ValueError, match=f"{L - 1}"):
            enc.score_terms(q, k, short, torch.arange(L))
    lm = make_lm(name)
    with pytest.raises(TypeError, match="integer"):
        lm(torch.rand(2, L))
    with pytest.raises(ValueError, match=r"\(B, L\)"):
        lm(torch.randint(0, 32, (L,)))


@pytest.mark.parametrize("name", posenc.available())
def test_unknown_option_lists_valid_ones(name):
    with pytest.raises(ValueError, match="unknown option.*bogus.*valid options"):
        posenc.build(name, heads=HEADS, head_dim=HEAD_DIM, max_len=MAX_LEN, bogus=1)


@pytest.mark.parametrize("name", posenc.available())
def test_declared_metadata(name):
    cls = posenc.get_class(name)
    assert cls.name == name and cls.kind and cls.paper and 1950 < cls.year < 2100
    assert cls.__module__.startswith("posenc.encodings.")
    doc = __import__(cls.__module__, fromlist=["_"]).__doc__ or ""
    assert str(cls.year) in doc or cls.paper.split(",")[0].split()[0] in doc, f"{name}: module docstring names no paper"
