"""DeBERTa (``deberta``): parity with HF DeBERTa-v2 and DeBERTa v1 ``DisentangledSelfAttention``."""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import assert_close, attention_n, lm_n
from transformers import DebertaConfig, DebertaV2Config
from transformers.models.deberta import modeling_deberta as v1
from transformers.models.deberta_v2 import modeling_deberta_v2 as v2

import posenc
from posenc.encodings.disentangled import make_log_bucket_position

H, DH = 4, 8
D = H * DH

V2_CASES = [
    # DeBERTa-v3 style: log buckets, shared keys, LayerNorm on the table, both terms
    dict(position_buckets=8, max_relative_positions=20, pos_att_type="p2c|c2p", share_att_key=True, norm=True),
    # v2 without buckets, own position projections, distances clamped at the span (L > span)
    dict(position_buckets=0, max_relative_positions=6, pos_att_type="c2p|p2c", share_att_key=False, norm=False),
    dict(position_buckets=16, max_relative_positions=64, pos_att_type="c2p", share_att_key=False, norm=True),
    dict(position_buckets=4, max_relative_positions=10, pos_att_type="p2c", share_att_key=True, norm=False),
]


def _v2_pair(c, causal):
    cfg = DebertaV2Config(
        hidden_size=D,
        num_attention_heads=H,
        intermediate_size=2 * D,
        relative_attention=True,
        position_buckets=c["position_buckets"],
        max_relative_positions=c["max_relative_positions"],
        pos_att_type=c["pos_att_type"],
        share_att_key=c["share_att_key"],
        norm_rel_ebd="layer_norm" if c["norm"] else "none",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    hf = v2.DisentangledSelfAttention(cfg).eval()
    ours = posenc.Attention(
        D,
        H,
        "deberta",
        causal=causal,
        qkv_bias=True,
        chunk_size=8,
        position_buckets=c["position_buckets"],
        max_relative_positions=c["max_relative_positions"],
        pos_att_type=c["pos_att_type"],
        share_att_key=c["share_att_key"],
        norm_rel_ebd=c["norm"],
        clamp_relative_positions=False,  # HF's bucketing (Microsoft's clamp is the default)
    )
    enc = ours.encoding
    with torch.no_grad():
        for a, b in (("q_proj", "query_proj"), ("k_proj", "key_proj"), ("v_proj", "value_proj")):
            getattr(ours, a).load_state_dict(getattr(hf, b).state_dict())
        ours.o_proj.weight.copy_(torch.eye(D))  # HF's context layer is before the output projection
        ours.o_proj.bias.zero_()
        if not c["share_att_key"]:
            if enc.c2p:
                enc.pos_key_proj.load_state_dict(hf.pos_key_proj.state_dict())
            if enc.p2c:
                enc.pos_query_proj.load_state_dict(hf.pos_query_proj.state_dict())
        if enc.rel_norm is not None:
            torch.nn.init.normal_(enc.rel_norm.weight)
            torch.nn.init.normal_(enc.rel_norm.bias)
    return hf, ours, cfg


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", range(len(V2_CASES)))
def test_parity_with_hf_deberta_v2(case, causal):
    torch.manual_seed(case)
    c = V2_CASES[case]
    hf, ours, _ = _v2_pair(c, causal)
    B, L = 2, 19
    x = torch.randn(B, L, D)
    mask = torch.ones(B, 1, L, L, dtype=torch.bool)
    if causal:
        mask = mask & torch.tril(torch.ones(L, L, dtype=torch.bool))
    rel_pos = v2.build_relative_position(
        x, x, bucket_size=c["position_buckets"], max_position=c["max_relative_positions"]
    )
    with torch.no_grad():
        ref = hf(x, mask, relative_pos=rel_pos, rel_embeddings=ours.encoding.rel_table())[0]
        for backend in ("chunked", "eager"):
            # + c2p and p2c: two more Dh-long products per score, the table projections (D)
            assert_close(ours(x, backend=backend), ref, n=attention_n(dim=D, head_dim=DH, length=L) + 2 * DH + 2 * D)


def test_rel_table_layer_norm_matches_hf_encoder():
    c = V2_CASES[0]
    torch.manual_seed(7)
    _, ours, cfg = _v2_pair(c, False)
    cfg.num_hidden_layers = 1
    enc_hf = v2.DebertaV2Encoder(cfg)
    enc = ours.encoding
    with torch.no_grad():
        enc_hf.rel_embeddings.weight.copy_(enc.rel_embeddings.weight)
        enc_hf.LayerNorm.load_state_dict(enc.rel_norm.state_dict())
        assert enc_hf.LayerNorm.eps == enc.rel_norm.eps
        assert_close(enc.rel_table(), enc_hf.get_rel_embedding(), n=2 * D)  # LayerNorm: mean and variance over D


@pytest.mark.parametrize("pos_att_type", ["c2p|p2c", "p2c"])
def test_parity_with_hf_deberta_v1(pos_att_type):
    """v1: fused ``in_proj`` laid out per head as [q|k|v], ``q_bias``/``v_bias``, ``pos_proj`` without bias."""
    torch.manual_seed(3)
    M = 5
    cfg = DebertaConfig(
        hidden_size=D,
        num_attention_heads=H,
        intermediate_size=2 * D,
        relative_attention=True,
        max_relative_positions=M,
        pos_att_type=pos_att_type,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    hf = v1.DisentangledSelfAttention(cfg).eval()
    torch.nn.init.normal_(hf.q_bias)
    torch.nn.init.normal_(hf.v_bias)
    ours = posenc.Attention(
        D,
        H,
        "deberta",
        causal=False,
        qkv_bias=True,
        version=1,
        position_buckets=0,
        max_relative_positions=M,
        pos_att_type=pos_att_type,
        share_att_key=False,
        norm_rel_ebd=False,
    )
    enc = ours.encoding
    w = hf.in_proj.weight.view(H, 3, DH, D)  # per head [q | k | v]
    with torch.no_grad():
        ours.q_proj.weight.copy_(w[:, 0].reshape(D, D))
        ours.k_proj.weight.copy_(w[:, 1].reshape(D, D))
        ours.v_proj.weight.copy_(w[:, 2].reshape(D, D))
        ours.q_proj.bias.copy_(hf.q_bias)
        ours.k_proj.bias.zero_()
        ours.v_proj.bias.copy_(hf.v_bias)
        ours.o_proj.weight.copy_(torch.eye(D))
        ours.o_proj.bias.zero_()
        if enc.c2p:
            assert enc.pos_key_proj.bias is None
            enc.pos_key_proj.weight.copy_(hf.pos_proj.weight)
        enc.pos_query_proj.load_state_dict(hf.pos_q_proj.state_dict())
        for L in (3, 11):  # att_span = min(L, M): both branches of HF's span slicing
            x = torch.randn(2, L, D)
            mask = torch.ones(2, 1, L, L, dtype=torch.bool)
            rel_pos = v1.build_relative_position(x, x)
            ref = hf(x, mask, relative_pos=rel_pos, rel_embeddings=enc.rel_embeddings.weight)[0]
            assert_close(ours(x), ref, n=attention_n(dim=D, head_dim=DH, length=L) + 2 * DH + 2 * D)


def test_log_buckets_match_hf():
    rel = torch.arange(-600, 601)
    for bucket_size, max_position in ((256, 512), (8, 20), (32, 100)):
        ref = v2.make_log_bucket_position(rel, bucket_size, max_position).long()
        assert torch.equal(make_log_bucket_position(rel, bucket_size, max_position), ref)
    enc = posenc.build("deberta", heads=2, head_dim=4, position_buckets=8, max_relative_positions=20)
    idx = enc.rel_index(torch.arange(30), torch.arange(30))
    assert idx.min() >= 0 and idx.max() <= 15 and idx[5, 2] == 8 + 3 and idx[2, 5] == 8 - 3


def _microsoft_bucket_index(q_size, k_size, bucket_size, max_position):
    """Microsoft DeBERTa ``da_utils.make_log_bucket_dict`` / ``make_log_bucket_position`` and
    ``disentangled_attention_bias``'s ``clamp(relative_pos + att_span, 0, 2·att_span - 1)``,
    transcribed: δ = i - j is clamped to ±(max_position - 1), then looked up in a bucket
    table built over [-max_position, max_position)."""
    rel = torch.arange(-max_position, max_position)
    sign = torch.sign(rel)
    mid = bucket_size // 2
    abs_pos = torch.where((rel < mid) & (rel > -mid), torch.tensor(mid - 1), rel.abs())
    log_pos = torch.ceil(torch.log(abs_pos / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid
    bucket_dict = torch.where(abs_pos <= mid, rel, (log_pos * sign).long())
    delta = torch.arange(q_size)[:, None] - torch.arange(k_size)[None, :]
    delta = torch.clamp(delta, -max_position + 1, max_position - 1) + max_position
    bucket = bucket_dict[delta]
    return torch.clamp(bucket + bucket_size, 0, 2 * bucket_size - 1)


@pytest.mark.parametrize("bucket_size,max_position,L", [(256, 512, 700), (256, 512, 1100), (8, 20, 60), (32, 100, 300)])
def test_default_clamps_like_microsoft_and_hf_mode_does_not(bucket_size, max_position, L):
    """Issue: at L = 700 with (256, 512), 17,766 pairs differ between Microsoft and HF."""
    ms = _microsoft_bucket_index(L, L, bucket_size, max_position)
    opts = dict(heads=2, head_dim=4, causal=False, position_buckets=bucket_size, max_relative_positions=max_position)
    default = posenc.build("deberta", **opts).rel_index(torch.arange(L), torch.arange(L))
    assert torch.equal(default, ms)
    hf_mode = posenc.build("deberta", clamp_relative_positions=False, **opts).rel_index(
        torch.arange(L), torch.arange(L)
    )
    hf_rel = v2.build_relative_position(torch.empty(1, L, 1), torch.empty(1, L, 1), bucket_size, max_position)[0]
    assert torch.equal(hf_mode, torch.clamp(hf_rel + bucket_size, 0, 2 * bucket_size - 1))
    differ = hf_mode != default
    far_ahead = (torch.arange(L)[:, None] - torch.arange(L)[None, :]) <= -max_position  # key >= M positions ahead
    assert torch.equal(differ, far_ahead)  # they disagree there and only there
    assert int(differ.sum()) == (L - max_position) * (L - max_position + 1) // 2  # 17,766 at (512, 700)
    if (bucket_size, max_position, L) == (256, 512, 700):
        assert int(differ.sum()) == 17_766
    assert int(hf_mode[far_ahead].unique().numel()) == 1 and int(hf_mode[far_ahead][0]) == 0  # the untrained row


def test_scale_counts_position_terms():
    assert posenc.build("deberta", heads=2, head_dim=16).scale == pytest.approx((16 * 3) ** -0.5)
    assert posenc.build("deberta", heads=2, head_dim=16, pos_att_type="c2p").scale == pytest.approx((16 * 2) ** -0.5)


def test_table_shared_across_layers_projections_per_layer():
    lm = posenc.TransformerLM(
        20, D, 3, H, "deberta", share_att_key=False, position_buckets=8, max_relative_positions=20
    )
    encs = lm.encodings
    assert len(encs) == 3
    assert all(e.rel_embeddings is encs[0].rel_embeddings and e.rel_norm is encs[0].rel_norm for e in encs)
    assert encs[1].pos_key_proj is not encs[0].pos_key_proj
    n_table = encs[0].rel_embeddings.weight.numel()
    assert sum(p.numel() for p in lm.parameters() if p.shape == encs[0].rel_embeddings.weight.shape) == n_table
    lm(torch.randint(0, 20, (2, 12))).sum().backward()
    assert encs[0].rel_embeddings.weight.grad is not None
    state = lm.state_dict()
    lm2 = posenc.TransformerLM(
        20, D, 3, H, "deberta", share_att_key=False, position_buckets=8, max_relative_positions=20
    )
    lm2.load_state_dict(state)
    assert lm2.encodings[2].rel_embeddings is lm2.encodings[0].rel_embeddings
    tok = torch.randint(0, 20, (1, 9))
    assert_close(lm2(tok), lm(tok), n=lm_n(dim=D, depth=3, length=9))


def test_share_att_key_uses_the_layer_projections():
    attn = posenc.Attention(D, H, "deberta", causal=False)
    enc = attn.encoding
    assert enc.share_att_key and not any(n.startswith("pos_") for n, _ in enc.named_parameters())
    q, k, pos = torch.randn(1, H, 3, DH), torch.randn(1, H, 3, DH), torch.arange(3)[None]
    with pytest.raises(ValueError, match="qk_proj"):
        enc.score_terms(q, k, pos, pos)
    # the table goes through exactly the projections given: the layer's own
    got = enc.score_terms(q, k, pos, pos, qk_proj=(attn.q_proj, attn.k_proj))
    # the layer hands them over in the call's context
    assert_close(
        enc.score_terms(q, k, pos, pos, ctx=posenc.Context(pos, pos, qk_proj=(attn.q_proj, attn.k_proj))), got, n=DH
    )
    table = enc.rel_table()
    kr = attn.k_proj(table).view(-1, H, DH).transpose(0, 1)  # (H, 2span, Dh)
    qr = attn.q_proj(table).view(-1, H, DH).transpose(0, 1)
    idx = enc.rel_index(pos, pos)[0]  # (Lq, Lk)
    want = torch.einsum("bhid,hijd->bhij", q, kr[:, idx]) + torch.einsum("bhjd,hijd->bhij", k, qr[:, idx])
    assert_close(got, want.detach(), n=2 * DH)
    # one instance shared by two layers projects with each layer's own weights
    other = posenc.Attention(D, H, enc, causal=False)
    x = torch.randn(1, 3, D)
    assert not torch.allclose(other(x), attn(x))


def test_emd_absolute_positions_only_from_a_layer():
    torch.manual_seed(0)
    lm = posenc.TransformerLM(20, D, 3, H, "deberta-emd", max_len=16, absolute_from_layer=2)
    encs = lm.encodings
    table = encs[0].absolute
    assert table.weight.shape == (16, D) and all(e.absolute is table for e in encs)  # one table
    assert lm.stages_before == {2: [encs[0]]}  # added to the residual stream before block 2 only
    assert sum(p.numel() for p in lm.parameters() if p.shape == (16, D)) == 16 * D
    tok = torch.randint(0, 20, (1, 8))
    base = lm(tok)
    with torch.no_grad():
        table.weight.zero_()
    no_abs = lm(tok)
    assert not torch.allclose(base, no_abs)
    # a relative model without the table is shift invariant; the EMD table breaks that
    with torch.no_grad():
        torch.nn.init.normal_(table.weight)
    assert not torch.allclose(lm(tok, pos=torch.arange(8)), lm(tok, pos=torch.arange(8) + 3), atol=1e-4)
    with pytest.raises(ValueError, match="max_len"):
        lm(tok, pos=torch.arange(8) + 10)
    with pytest.raises(ValueError, match=r"block index in \[0, 2\], got 3"):
        posenc.TransformerLM(20, D, 3, H, "deberta-emd", max_len=16, absolute_from_layer=3)
    with pytest.raises(ValueError, match="max_len"):
        posenc.TransformerLM(20, D, 3, H, "deberta-emd", absolute_from_layer=1)
    # the enhanced mask decoder is a class of its own: plain deberta has no input stage
    assert not posenc.get_class("deberta").stages & posenc.Stage.INPUT
    with pytest.raises(
        ValueError, match=r"\['absolute_from_layer'\] for encoding 'deberta';.*'deberta-emd' takes them"
    ):
        posenc.TransformerLM(20, D, 3, H, "deberta", max_len=16, absolute_from_layer=1)


def test_bad_options():
    with pytest.raises(ValueError, match="pos_att_type"):
        posenc.build("deberta", heads=2, head_dim=4, pos_att_type="c2c")
    with pytest.raises(ValueError, match="position_buckets"):
        posenc.build("deberta", heads=2, head_dim=4, position_buckets=-3)
    with pytest.raises(ValueError, match="max_relative_positions"):
        posenc.build("deberta", heads=2, head_dim=4, position_buckets=256, max_relative_positions=100)
    with pytest.raises(ValueError, match="version"):
        posenc.build("deberta", heads=2, head_dim=4, version=3)
