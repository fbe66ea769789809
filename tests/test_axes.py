"""Positions with axes: M-RoPE against HF Qwen2-VL, axial RoPE against rotary-embedding-torch
and rope-vit, RoPE-Mixed against rope-vit's formula, 2-D/3-D sinusoids against
positional-encodings, per-axis learned tables, and the position helpers (grid, Qwen2-VL ids)."""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import assert_close

import posenc
from posenc.positions import grid, mrope_positions

H, DH = 4, 16


def _qk(B, L, dh=DH, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, L, dh, generator=g), torch.randn(B, H, L, dh, generator=g)


def _rot_close(got, want, max_pos):
    """A rotation ``x·cos φ + swap(x)·sin φ`` (2 terms) computed two ways; angles ``p·θ`` (θ <= 1)
    rounded differently are ``eps·max_pos`` apart, so the terms' size is ``|x|·(1 + max_pos)``."""
    assert_close(got, want, n=2, magnitude=max(1.0, float(want.abs().amax())) * (1.0 + max_pos))


# --------------------------------------------------------------------------- M-RoPE / Qwen2-VL
def _qwen2vl_text_config(section, theta=10000.0):
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig

    return Qwen2VLTextConfig(
        hidden_size=H * DH,
        num_attention_heads=H,
        num_key_value_heads=H,
        intermediate_size=32,
        num_hidden_layers=1,
        vocab_size=64,
        rope_parameters={"rope_type": "default", "rope_theta": theta, "mrope_section": list(section)},
    )


def _qwen2vl_model():
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    vision = dict(depth=1, embed_dim=16, hidden_size=H * DH, num_heads=2, mlp_ratio=1, spatial_merge_size=2)
    cfg = Qwen2VLConfig(text_config=_qwen2vl_text_config([2, 3, 3]).to_dict(), vision_config=vision)
    return Qwen2VLModel(cfg)


@pytest.mark.parametrize("section", [[2, 3, 3], [4, 2, 2], [1, 1, 1, 2, 2, 1]], ids=str)
def test_mrope_equals_hf_qwen2vl_rotary(section):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb

    rotary = Qwen2VLRotaryEmbedding(_qwen2vl_text_config(section, theta=1e4))
    pos = torch.stack((mrope_positions(3, (3, 4), 2, (2, 2, 3)), mrope_positions(5, (4, 2, 2), 3, (1, 5), start=40)))
    q, k = _qk(2, pos.shape[1])
    cos, sin = rotary(q, pos.permute(2, 0, 1))  # HF: position_ids (3, B, L)
    want = apply_rotary_pos_emb(q, k, cos, sin)
    enc = posenc.build("mrope", heads=H, head_dim=DH, mrope_section=section)
    got = enc.rotate(q, k, pos, pos)
    mp = int(pos.max())
    _rot_close(got[0], want[0], mp)
    _rot_close(got[1], want[1], mp)


def test_mrope_on_text_is_1d_rope_bit_for_bit():
    enc = posenc.build("mrope", heads=H, head_dim=DH)
    rope = posenc.build("rope", heads=H, head_dim=DH)
    q, k = _qk(2, 12)
    pos = torch.stack((torch.arange(12), torch.arange(12) + 1000))  # (B, L): one position per token
    for a, b in zip(enc.rotate(q, k, pos, pos), rope.rotate(q, k, pos, pos)):
        assert torch.equal(a, b)
    diag = pos.unsqueeze(-1).expand(2, 12, 3)  # t = h = w
    for a, b in zip(enc.rotate(q, k, diag, diag), rope.rotate(q, k, pos, pos)):
        assert torch.equal(a, b)


def test_mrope_positions_equal_hf_get_rope_index():
    model = _qwen2vl_model()
    # image/video_grid_thw count patches before the vision encoder's 2x2 spatial merge
    cases = [
        ([3, (2, 3), 2], [(1, 4, 6)], None),
        ([(3, 3), 4, (2, 1), 1], [(1, 6, 6), (1, 4, 2)], None),
        ([2, (2, 3, 3), 3], None, [(2, 6, 6)]),  # video with t <= max(h, w): both conventions agree
    ]
    for segments, images, videos in cases:
        types = []
        for s in segments:
            types += [0] * s if isinstance(s, int) else [1 if len(s) == 2 else 2] * math.prod(s)
        ids = torch.zeros(1, len(types), dtype=torch.long)
        kw = {}
        if images:
            kw["image_grid_thw"] = torch.tensor(images)
        if videos:
            kw["video_grid_thw"] = torch.tensor(videos)
        want, _ = model.get_rope_index(ids, torch.tensor([types]), **kw)
        got = mrope_positions(*segments)
        assert torch.equal(got, want[:, 0].T), (segments, got.T, want[:, 0])


def test_mrope_continues_after_a_video_longer_than_wide():
    """t > max(h, w): the next segment starts one past the largest position (Qwen2-VL release)."""
    pos = mrope_positions(2, (5, 2, 2), 1)
    assert pos[-1].tolist() == [7, 7, 7]  # video at 2..6 on t, 2..3 on h and w
    assert torch.equal(mrope_positions(3, start=8), torch.arange(8, 11).unsqueeze(-1).expand(3, 3))


# --------------------------------------------------------------------------- axial RoPE
@pytest.mark.parametrize("sizes", [(3, 5), (2, 3, 4)], ids=str)
def test_axial_rope_equals_rotary_embedding_torch(sizes):
    from rotary_embedding_torch import RotaryEmbedding, apply_rotary_emb

    A = len(sizes)
    dh = 24  # 12 pairs: 6 per axis for 2 axes, 4 for 3
    ref = RotaryEmbedding(dim=dh // A, theta=100)  # per-axis rotary dim, interleaved pairs
    freqs = ref.get_axial_freqs(*sizes).reshape(-1, dh)  # (N, Dh): axis 0 first, then axis 1, ...
    N = freqs.shape[0]
    q, k = _qk(2, N, dh)
    enc = posenc.build("rope", heads=H, head_dim=dh, axes=A, base=100.0, layout="interleaved")
    pos = grid(*sizes)
    got_q, got_k = enc.rotate(q, k, pos, pos)
    _rot_close(got_q, apply_rotary_emb(freqs, q), max(sizes))
    _rot_close(got_k, apply_rotary_emb(freqs, k), max(sizes))


def _ropevit_rotate(x, pos_x, pos_y, freqs_x, freqs_y):
    """Heo et al. 2024 (RoPE-Mixed, their eq. with per-head frequencies): complex pair ``t`` of head
    ``h`` is multiplied by ``exp(i (θ^x_{h,t} p^x + θ^y_{h,t} p^y))``; pairs are interleaved
    (``x_{2t} + i x_{2t+1}``) as in naver-ai/rope-vit. Axial is the case θ^y = 0 on the first
    half of the pairs and θ^x = 0 on the second."""
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))  # (B, H, N, Dh/2)
    ang = pos_x.double()[None, :, None] * freqs_x.double()[:, None, :]  # (H, N, Dh/2)
    ang = ang + pos_y.double()[None, :, None] * freqs_y.double()[:, None, :]
    out = xc * torch.polar(torch.ones_like(ang), ang)
    return torch.view_as_real(out).flatten(-2).float()


def test_axial_rope_equals_rope_vit_formula():
    h, w, theta = 4, 6, 100.0
    mag = 1 / theta ** (torch.arange(0, DH, 4)[: DH // 4].double() / DH)  # rope-vit compute_axial_cis
    zero = torch.zeros_like(mag)
    fx, fy = torch.cat((mag, zero)).expand(H, -1), torch.cat((zero, mag)).expand(H, -1)
    q, k = _qk(2, h * w)
    pos = grid(h, w).flip(-1)  # rope-vit: x = t % w (column) first, y = t // w (row)
    enc = posenc.build("rope", heads=H, head_dim=DH, axes=2, base=theta, layout="interleaved")
    got_q, _ = enc.rotate(q, k, pos, pos)
    _rot_close(got_q, _ropevit_rotate(q, pos[:, 0], pos[:, 1], fx, fy), max(h, w))


def test_rope_mixed_equals_rope_vit_formula_and_learns():
    h, w = 3, 5
    torch.manual_seed(0)
    enc = posenc.build("rope", heads=H, head_dim=DH, axes=2, rope_mixed=True, base=10.0, layout="interleaved")
    assert enc.freqs.shape == (2, H, DH // 2) and enc.freqs.requires_grad
    q, k = _qk(2, h * w)
    pos = grid(h, w).flip(-1)
    got_q, got_k = enc.rotate(q, k, pos, pos)
    fx, fy = enc.freqs.detach()
    # float32 einsum of two products there (like rope-vit), float64 here
    _rot_close(got_q, _ropevit_rotate(q, pos[:, 0], pos[:, 1], fx, fy), 2 * max(h, w))
    _rot_close(got_k, _ropevit_rotate(k, pos[:, 0], pos[:, 1], fx, fy), 2 * max(h, w))
    (got_q * got_k).sum().backward()
    assert enc.freqs.grad is not None and enc.freqs.grad.abs().sum() > 0


@pytest.mark.parametrize("axes", [2, 3])
def test_rope_mixed_init_turns_the_axial_bands_per_head(axes):
    """Band g of head h points along column g of a rotation R_h (rope-vit init_random_2d_freqs for A = 2)."""
    dh = 8 * axes  # 4 pairs per band
    torch.manual_seed(1)
    enc = posenc.build("rope", heads=H, head_dim=dh, axes=axes, rope_mixed=True, base=10.0)
    n = dh // 2 // axes
    mag = 1 / 10.0 ** (torch.arange(0, 2 * n, 2).double() / (2 * n))  # axial magnitudes of one band
    f = enc.freqs.detach().double()  # (A, H, Dh/2)
    for h in range(H):
        directions = f[:, h].reshape(axes, axes, n) / mag  # [a, g, k]: R_h[a, g], same for every k
        R = directions[..., 0]
        assert_close(directions, R.unsqueeze(-1).expand_as(directions), rtol=1e-6, atol=1e-6)
        assert_close(R.T @ R, torch.eye(axes, dtype=torch.float64), rtol=1e-6, atol=1e-6)
        assert abs(float(torch.linalg.det(R)) - 1) < 1e-6
    # per-head angles differ (random), as in the paper
    assert not torch.allclose(f[:, 0], f[:, 1])


def test_axial_rope_with_linear_scaling_divides_every_axis():
    base = posenc.build("rope", heads=H, head_dim=DH, axes=2)
    scaled = posenc.build("rope", heads=H, head_dim=DH, axes=2, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert torch.equal(scaled.inv_freq, base.inv_freq / 4.0)
    q, k = _qk(1, 6)
    pos = grid(2, 3)
    for a, b in zip(scaled.rotate(q, k, pos * 4, pos * 4), base.rotate(q, k, pos, pos)):
        _rot_close(a, b, 12)


def test_multi_axis_rope_is_shift_invariant_per_axis():
    for enc in (
        posenc.build("rope", heads=H, head_dim=DH, axes=2),
        posenc.build("rope", heads=H, head_dim=DH, axes=2, rope_mixed=True),
        posenc.build("mrope", heads=H, head_dim=DH),
    ):
        A = enc.axes
        pos = grid(*([2, 2, 3][-A:]))
        q, k = _qk(1, pos.shape[0])
        qr, kr = enc.rotate(q, k, pos, pos)
        base = qr @ kr.transpose(-1, -2)
        for a in range(A):
            shifted = pos.clone()
            shifted[:, a] += 37
            qs, ks = enc.rotate(q, k, shifted, shifted)
            assert_close(qs @ ks.transpose(-1, -2), base, n=DH + 2, magnitude=float(base.abs().amax()) * 40)


# --------------------------------------------------------------------------- sinusoidal 2-D / 3-D
@pytest.mark.parametrize("sizes,dim", [((4, 6), 16), ((3, 5), 18), ((2, 3, 4), 16), ((3, 2, 2), 24)], ids=str)
def test_sinusoidal_axes_equal_positional_encodings(sizes, dim):
    from positional_encodings.torch_encodings import PositionalEncoding2D, PositionalEncoding3D

    ref = (PositionalEncoding2D if len(sizes) == 2 else PositionalEncoding3D)(dim)
    want = ref(torch.zeros(1, *sizes, dim)).reshape(-1, dim)  # row-major over (x, y[, z])
    enc = posenc.build("sinusoidal", heads=2, head_dim=dim // 2, axes=len(sizes))
    got = enc.table(grid(*sizes))[0]
    # float32 angles there, float64 here: eps·angle apart, angle <= max position
    assert_close(got, want, n=2, magnitude=max(sizes))


def test_sinusoidal_axes_embed_and_are_absolute():
    enc = posenc.build("sinusoidal", heads=2, head_dim=8, axes=2)
    x = torch.randn(2, 6, 16)
    pos = grid(2, 3)
    assert_close(enc.embed(x, pos), x + enc.table(pos), n=1)
    moved = pos.clone()
    moved[:, 1] += 1
    assert not torch.allclose(enc.table(moved), enc.table(pos))
    swapped = pos.flip(-1)  # (x, y) and (y, x) differ: the tables are concatenated, not summed
    assert not torch.allclose(enc.table(swapped), enc.table(pos))


# --------------------------------------------------------------------------- learned 2-D / 3-D
def test_learned_axes_sum_or_concatenate_per_axis_tables():
    summed = posenc.build("learned", heads=2, head_dim=8, axes=2, axial_shape=(3, 5))
    pos = grid(3, 5)
    t0, t1 = (t.weight for t in summed.tables)
    assert t0.shape == (3, 16) and t1.shape == (5, 16)
    want = t0[pos[:, 0]] + t1[pos[:, 1]]
    assert_close(summed.positions(pos)[0], want, n=2)
    cat = posenc.build("learned", heads=2, head_dim=8, max_len=6, axes=3, axial_dims=(4, 4, 8))
    pos3 = grid(2, 3, 4)
    w = [t.weight for t in cat.tables]
    want3 = torch.cat([w[a][pos3[:, a]] for a in range(3)], -1)
    assert torch.equal(cat.positions(pos3)[0], want3)


def test_learned_axes_refuse_positions_past_their_table():
    enc = posenc.build("learned", heads=2, head_dim=8, axes=2, axial_shape=(3, 5))
    with pytest.raises(ValueError, match=r"0\.\.2 on axis 0.*got position 3"):
        enc.check_length(grid(4, 2))  # checked at the door (the layer or the model), once per call
    with pytest.raises(ValueError, match=r"0\.\.4 on axis 1.*got position 5"):
        posenc.Attention(16, 2, enc)(torch.randn(1, 12, 16), pos=grid(2, 6))


# --------------------------------------------------------------------------- helpers and errors
def test_grid_order_and_start():
    assert grid(2, 3).tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    g = grid(2, 2, 3, start=5)
    assert g.shape == (12, 3) and g[0].tolist() == [5, 5, 5] and g[-1].tolist() == [6, 6, 7]
    assert torch.equal(grid(4), torch.arange(4).unsqueeze(-1))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: grid(), "1 to 3 sizes"),
        (lambda: grid(2, 0), "size 1 must be a positive int, got 0"),
        (lambda: grid(1, 2, 3, 4), "1 to 3 sizes"),
        (lambda: grid(2, start=-1), "start must be an int >= 0"),
        (lambda: mrope_positions(), "at least one segment"),
        (lambda: mrope_positions(3, (2,)), r"segment 1 must be an int \(text\) or \(h, w\)"),
        (lambda: mrope_positions(0), "text segment 0 must be a positive int"),
    ],
)
def test_position_helper_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "name, options, match",
    [
        ("rope", {"axes": 0}, "axes must be a positive int"),
        ("rope", {"axes": 3}, r"multiple of 2\*axes = 6"),
        ("rope", {"rope_mixed": True}, "needs axes >= 2"),
        ("rope", {"axes": 2, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "static type"),
        ("mrope", {"mrope_section": [2, 3, 2]}, "summing to head_dim/2 = 8"),
        ("mrope", {"mrope_section": 8}, "mrope_section must be a list"),
        ("sinusoidal", {"axes": 1.5}, "axes must be a positive int"),
        ("learned", {"axial_dims": (8, 8)}, "need axes >= 2"),
        ("learned", {"axes": 2, "axial_dims": (8, 4)}, "axial_dims must be 2 positive ints summing to D = 32"),
        ("learned", {"axes": 2, "axial_shape": (4,)}, "axial_shape must be 2 positive ints"),
    ],
)
def test_bad_axis_options(name, options, match):
    with pytest.raises(ValueError, match=match):
        posenc.build(name, heads=2, head_dim=DH, max_len=16, **options)


def test_position_shapes_for_encodings_with_axes():
    attn = posenc.Attention(32, 2, "rope", axes=2)
    x = torch.randn(3, 6, 32)
    g = grid(2, 3)
    ref = attn(x, pos=g)
    assert_close(attn(x, pos=g.expand(3, 6, 2)), ref, n=1)
    assert_close(attn(x, pos=g.unsqueeze(0)), ref, n=1)
    # one position per token: the same coordinate on both axes
    diag = torch.arange(6).unsqueeze(-1).expand(6, 2)
    assert_close(attn(x, pos=torch.arange(6)), attn(x, pos=diag), n=1)
    assert_close(attn(x), attn(x, pos=diag), n=1)
    with pytest.raises(ValueError, match=r"\(L, 2\) or \(B, L, 2\).*got shape \(6, 3\)"):
        attn(x, pos=grid(2, 3, 1))
    with pytest.raises(ValueError, match=r"got shape \(3, 6, 3\)"):
        attn(x, pos=grid(1, 2, 3).expand(3, 6, 3))
    with pytest.raises(ValueError, match="length 4 but the sequence has length 6"):
        attn(x, pos=grid(2, 2))
    with pytest.raises(ValueError, match="ambiguous"):
        posenc.Attention(32, 2, "rope", axes=2)(torch.randn(2, 2, 32), pos=grid(1, 2).expand(2, 2).clone())
    with pytest.raises(ValueError, match="non-negative"):
        attn(x, pos=g - 1)
