"""Transformer-XL (``xl``): parity with HF transformers 4.57.6 and segment memory.

The oracle, ``RelPartialLearnableMultiHeadAttn``, was removed from transformers 5.x. The
``xl_oracle`` fixture installs 4.57.6 into the git-ignored ``.oracles/`` (from PyPI, once)
and runs it in a subprocess with that directory first on ``sys.path``, so it never meets
the transformers the rest of the suite imports.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.conftest import assert_close, attention_n, lm_n

import posenc
from posenc import functional as PF

ROOT = Path(__file__).resolve().parents[1]
ORACLE_DIR = ROOT / ".oracles" / "transformers-4.57.6"
PIP_ARGS = [
    "transformers==4.57.6",
    "huggingface-hub<1.0",
    "tokenizers<=0.23.0",
    # huggingface-hub 0.x imports requests at import time; --no-deps leaves its own deps out
    "requests",
    "urllib3",
    "idna",
    "charset-normalizer",
    "certifi",
]

ORACLE_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from transformers.models.deprecated.transfo_xl.modeling_transfo_xl import (
    PositionalEmbedding, RelPartialLearnableMultiHeadAttn)
cases = torch.load(sys.argv[2])
outs = []
for c in cases:
    H, Dh, D = c["heads"], c["head_dim"], c["d_model"]
    att = RelPartialLearnableMultiHeadAttn(H, D, Dh, dropout=0.0, dropatt=0.0, pre_lnorm=False).eval()
    att.load_state_dict(c["state"])
    w = c["w"]                                    # [qlen, B, D]
    mems = c["mems"]                              # [mlen, B, D] or None
    qlen, mlen = w.shape[0], 0 if mems is None else mems.shape[0]
    klen = qlen + mlen
    # TransfoXLModel._forward: positions klen-1 .. 0, clamped, and a [qlen, klen, 1] mask
    pos_seq = torch.arange(klen - 1, -1, -1.0)
    if c["clamp_len"] is not None:
        pos_seq.clamp_(max=c["clamp_len"])
    r = PositionalEmbedding(D)(pos_seq)           # [klen, 1, D]
    mask = torch.triu(torch.ones(qlen, klen, dtype=torch.uint8), diagonal=1 + mlen)[:, :, None]
    with torch.no_grad():
        outs.append(att(w, r, attn_mask=mask, mems=mems)[0])
torch.save(outs, sys.argv[3])
"""


@pytest.fixture(scope="module")
def xl_oracle(tmp_path_factory):
    """Run HF 4.57.6 on a list of cases; install it into .oracles/ when missing."""
    if not all((ORACLE_DIR / p).is_dir() for p in ("transformers/models/deprecated/transfo_xl", "urllib3")):
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", str(ORACLE_DIR), "--no-deps", *PIP_ARGS]
        subprocess.run(cmd, check=True)
    tmp = tmp_path_factory.mktemp("xl")

    def run(cases: list[dict]) -> list[torch.Tensor]:
        src, dst = tmp / "cases.pt", tmp / "out.pt"
        torch.save(cases, src)
        env = {**os.environ, "PYTHONPATH": ""}
        proc = subprocess.run(
            [sys.executable, "-c", ORACLE_SCRIPT, str(ORACLE_DIR), str(src), str(dst)],
            capture_output=True,
            text=True,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return torch.load(dst)

    return run


def _case(heads=4, head_dim=8, B=2, qlen=7, mlen=0, clamp_len=None, seed=0):
    """Random posenc layer, the HF state dict holding its weights, and inputs."""
    torch.manual_seed(seed)
    D = heads * head_dim
    attn = posenc.Attention(D, heads, "xl", causal=True, backend="chunked", clamp_len=clamp_len)
    enc = attn.encoding
    ln = torch.nn.LayerNorm(D)
    torch.nn.init.normal_(ln.weight)
    torch.nn.init.normal_(ln.bias)
    state = {
        "qkv_net.weight": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach().clone(),
        "o_net.weight": attn.o_proj.weight.detach().clone(),
        "r_net.weight": enc.r_net.weight.detach().clone(),
        "r_w_bias": enc.r_w_bias.detach().clone(),
        "r_r_bias": enc.r_r_bias.detach().clone(),
        "layer_norm.weight": ln.weight.detach().clone(),
        "layer_norm.bias": ln.bias.detach().clone(),
    }
    w = torch.randn(B, qlen, D)
    mems = torch.randn(B, mlen, D) if mlen else None
    hf = dict(heads=heads, head_dim=head_dim, d_model=D, clamp_len=clamp_len, state=state)
    hf["w"] = w.transpose(0, 1).contiguous()
    hf["mems"] = None if mems is None else mems.transpose(0, 1).contiguous()
    return attn, ln, w, mems, hf


def _posenc_out(attn, ln, w, mems, backend):
    """HF's post-LN layer output ``LN(w + attn(w))`` computed with posenc attention."""
    B, L, _ = w.shape
    M = 0 if mems is None else mems.shape[1]
    pos = torch.arange(M, M + L)[None]
    mem_pos = torch.arange(M)[None] if M else None
    with torch.no_grad():
        a = attn(w, pos, backend=backend, memory=mems, memory_pos=mem_pos)
        return ln(w + a)


CASES = [
    dict(qlen=7, mlen=0),
    dict(qlen=6, mlen=5),
    dict(qlen=9, mlen=0, clamp_len=4),
    dict(qlen=5, mlen=6, clamp_len=3),
    dict(heads=2, head_dim=16, qlen=1, mlen=9),
]


def test_parity_with_hf_transfo_xl(xl_oracle):
    built = [_case(seed=i, **c) for i, c in enumerate(CASES)]
    expected = xl_oracle([b[-1] for b in built])
    for (attn, ln, w, mems, _), exp, c in zip(built, expected, CASES):
        for backend in ("chunked", "eager"):
            got = _posenc_out(attn, ln, w, mems, backend)
            D, L = attn.dim, attn.dim + c["qlen"] + c.get("mlen", 0)
            n = attention_n(dim=D, head_dim=attn.head_dim, length=L) + 2 * D + attn.head_dim + L
            assert_close(got, exp.transpose(0, 1), n=n, msg=f"{c} {backend}")


def _xl_formula(q, k, enc, q_pos, k_pos):
    """Direct transcription: ((q_i + u)·k_j + (q_i + v)·W_R R_{i-j}) for every (i, j)."""
    B, H, Lq, Dh = q.shape
    Lk = k.shape[2]
    out = torch.empty(B, H, Lq, Lk)
    for i in range(Lq):
        for j in range(Lk):
            d = int(q_pos[i] - k_pos[j])
            if enc.clamp_len is not None:
                d = max(-enc.clamp_len, min(enc.clamp_len, d))
            inv = 1.0 / (10000 ** (torch.arange(0, enc.d_model, 2, dtype=torch.float64) / enc.d_model))
            r = torch.cat([(d * inv).sin(), (d * inv).cos()]).float()
            wr = (enc.r_net.weight @ r).view(H, Dh)
            out[:, :, i, j] = ((q[:, :, i] + enc.r_w_bias) * k[:, :, j]).sum(-1) + (
                (q[:, :, i] + enc.r_r_bias) * wr
            ).sum(-1)
    return out - (q @ k.transpose(-1, -2))  # score_terms excludes q·k


@pytest.mark.parametrize("clamp_len", [None, 3])
def test_score_terms_formula_bidirectional_any_positions(clamp_len):
    torch.manual_seed(1)
    enc = posenc.build("xl", heads=3, head_dim=4, causal=False, clamp_len=clamp_len)
    q, k = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4)
    q_pos, k_pos = torch.tensor([9, 2, 4, 4, 11]), torch.tensor([0, 3, 6, 7, 1, 12, 5])
    with torch.no_grad():
        got = enc.score_terms(q, k, q_pos[None], k_pos[None])
        assert_close(got, _xl_formula(q, k, enc, q_pos, k_pos), n=2 * 4 + enc.d_model + 12)


def test_sinusoids_are_halves_layout():
    enc = posenc.build("xl", heads=2, head_dim=4)
    d = torch.arange(-3, 4)
    r = PF.sinusoidal_table(d, 8, layout="halves")
    ref = torch.stack([torch.sin(d * 10000 ** (-2 * k / 8)) for k in range(4)], -1)
    assert_close(r[:, :4], ref, n=2, magnitude=1 + 3)  # angles |d·ω| <= 3 rounded two ways (tests/test_rotary._close)
    with torch.no_grad():
        assert_close(enc.rel_keys(d), (r @ enc.r_net.weight.t()).view(7, 2, 4).transpose(0, 1), n=8)


def test_segment_memory_equals_full_context():
    torch.manual_seed(0)
    lm = posenc.TransformerLM(50, 32, 2, 4, "xl", memory_len=8)
    tokens = torch.randint(0, 50, (2, 16))
    full = lm(tokens)
    mem = lm.init_memory()
    parts = [lm(tokens[:, s : s + 4], memory=mem) for s in range(0, 16, 4)]
    # each segment sees 8 memorised tokens + itself: the full causal context holds up to position 11
    assert_close(torch.cat(parts[:3], 1), full[:, :12], n=lm_n(dim=32, depth=2, length=16) + 2 * (32 + 16))
    assert mem.pos.tolist() == [list(range(8, 16))] and mem.seen == 16
    # each layer's memory is a cache policy holding its attention inputs (LN'd rows), detached
    assert all(m.rows.shape == (2, 8, 32) and not m.rows.requires_grad for m in mem.layers)


def test_segment_memory_truncates_context():
    """With memory, the last segment sees exactly memory_len earlier tokens, at true distances."""
    torch.manual_seed(0)
    lm = posenc.TransformerLM(50, 32, 2, 4, "xl", memory_len=4)
    tokens = torch.randint(0, 50, (1, 12))
    mem = lm.init_memory()
    for s in range(0, 12, 4):
        last = lm(tokens[:, s : s + 4], memory=mem)
    # same as a window over tokens 4..11 whose first 4 queries are dropped: positions 4.. matter only as distances
    window = lm(tokens[:, 4:12], pos=torch.arange(4, 12))
    assert not torch.allclose(
        last, window[:, 4:]
    )  # memory is the *layer input* of the previous segment, not a recompute
    lm2 = posenc.TransformerLM(50, 32, 1, 4, "xl", memory_len=4)
    mem = lm2.init_memory()
    for s in range(0, 12, 4):
        last = lm2(tokens[:, s : s + 4], memory=mem)
    # with one layer the memorised inputs are the embeddings, so a window pass is identical
    assert_close(last, lm2(tokens[:, 4:12], pos=torch.arange(4, 12))[:, 4:], n=lm_n(dim=32, depth=1, length=8) + 32 + 8)


def test_bad_options_and_memory_misuse():
    with pytest.raises(ValueError, match="clamp_len"):
        posenc.build("xl", heads=2, head_dim=4, clamp_len=0)
    with pytest.raises(ValueError, match="d_model"):
        posenc.build("xl", heads=2, head_dim=4, d_model=7)
    lm = posenc.TransformerLM(10, 16, 1, 2, "xl")
    with pytest.raises(ValueError, match="memory_len"):
        lm.init_memory()
    with pytest.raises(ValueError, match="memory_len"):
        posenc.TransformerLM(10, 16, 1, 2, "xl", memory_len=-1)
    lm = posenc.TransformerLM(10, 16, 1, 2, "xl", memory_len=4)
    with pytest.raises(ValueError, match="together"):
        lm(torch.zeros(1, 2, dtype=torch.long), cache=lm.init_cache(1, 4), memory=lm.init_memory())


def test_scale_is_inverse_sqrt_head_dim():
    assert posenc.build("xl", heads=2, head_dim=16).scale == pytest.approx(1 / math.sqrt(16))


def test_memory_misuse_is_refused_by_the_one_call_check():
    """Every refusal of a memory goes through posenc.layer.call.make_call (or the memory itself)."""
    attn = posenc.Attention(16, 2, "xl")
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="memory and cache cannot be used together"):
        attn(x, cache=attn.init_cache(1, 8), memory=torch.randn(1, 2, 16))
    with pytest.raises(ValueError, match="key_padding_mask is not supported together with memory"):
        attn(x, memory=torch.randn(1, 2, 16), key_padding_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="memory must have shape"):
        attn(x, memory=torch.randn(2, 2, 16))
    lm = posenc.TransformerLM(10, 16, 1, 2, "xl", memory_len=4)
    mem = lm.init_memory()
    lm(torch.zeros(2, 3, dtype=torch.long), memory=mem)
    with pytest.raises(ValueError, match="memory holds batch size 2, got a batch of 1"):
        lm(torch.zeros(1, 3, dtype=torch.long), memory=mem)
