"""Dual Chunk Attention: ``rope-extension`` of type ``dca`` and the extension method ``dca``
(An et al., "Training-Free Long-Context Scaling of Large Language Models", ICML 2024; issue 65
part 5).

Parity is against a float64 transcription, in this file, of the two originals:

* vLLM ``vllm/model_executor/layers/rotary_embedding/dual_chunk_rope.py``,
  ``DualChunkRotaryEmbedding._compute_cos_sin_cache`` (the ``q``, ``qc`` and ``k`` tables:
  ``arange(n)``, ``(arange(n) + n).clamp(max=chunk_size)``, ``arange(max_pos) % n``, with
  ``n = chunk_size - local_size``) and ``forward_native`` (keys read ``k[pos]``, queries
  ``q[pos % n]``, ``qc[pos % n]`` and the inter-chunk query ``qc[n - 1]``); the chunk a key
  falls in picks the map as in ``attention/backends/dual_chunk_flash_attn.py``
  (``_dual_chunk_flash_attn_prefill_func``: intra ``[prev_chunk_end_pos, end)``, succ the
  ``n`` keys before it, inter everything before those);
* HKUNLP/ChunkLlama ``chunkllama_attn_replace.py`` (commit 2add4d7): the tables of
  ``ChunkLlamaRotaryEmbedding._set_cos_sin_cache`` (lines 39-67, the same three; its
  ``mscale`` is 1 up to ``max_position_embeddings``), ``apply_rotary_pos_emb`` (86-93), the
  prefill path of ``forward`` (161-199: one flash-attention call per map and chunk, merged
  by their log-sum-exp in ``merge_attn_outputs``, 96-111) and its one-token decoding path
  (200-234: the three score blocks concatenated, one softmax).
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import assert_close, attention_n
from tests.test_contract import assert_backend_equals_eager
from tests.test_rope_extension import count_fast_maps, make_attn, out_proj, qkv

import posenc

HEADS, HEAD_DIM = 2, 16
DIM = HEADS * HEAD_DIM
L = 24
# (chunk_size, local_size): n = 5 with the inter query at chunk_size (2n - 1 > c); n = 2 with it
# at 2n - 1 = 3 < c (ChunkLlama's and vLLM's qc[n - 1] either way); no local window at all
SETTINGS = [(8, 3), (6, 4), (5, 0)]
N = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L)


def dca(c: int, local: int) -> dict:
    return {"type": "dca", "chunk_size": c, "local_size": local}


def _x(B=2, n=L, seed=1):
    return torch.randn(B, n, DIM, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ the transcription (float64)
def tables(c: int, local: int, max_pos: int, base: float = 10000.0) -> dict[str, torch.Tensor]:
    """Angles of vLLM's ``cos_sin_{q,qc,k}_cache`` (ChunkLlama's ``{q,qc,k}_{cos,sin}_cached``)."""
    n = c - local
    inv = 1.0 / base ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    q_t = torch.arange(n, dtype=torch.float64)
    qc_t = (torch.arange(n, dtype=torch.float64) + n).clamp(max=c)
    k_t = torch.arange(max_pos, dtype=torch.float64) % n
    return {"q": torch.outer(q_t, inv), "qc": torch.outer(qc_t, inv), "k": torch.outer(k_t, inv)}


def rotate(x: torch.Tensor, ang: torch.Tensor) -> torch.Tensor:
    """NeoX / HF ``rotate_half`` style: ``x·cos + rotate_half(x)·sin``, ``ang`` ``(B|1, L, Dh/2)``."""
    cos = torch.cat((ang.cos(), ang.cos()), -1).unsqueeze(1)  # (B|1, 1, L, Dh)
    sin = torch.cat((ang.sin(), ang.sin()), -1).unsqueeze(1)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def vllm_queries_keys(q, k, pos, c, local):
    """``forward_native``: (query, query_succ, query_inter), key, every one rotated, float64."""
    n = c - local
    t = tables(c, local, int(pos.max()) + 1)
    key = rotate(k, t["k"][pos])
    inter = t["qc"][n - 1].expand(*pos.shape, -1)
    return (rotate(q, t["q"][pos % n]), rotate(q, t["qc"][pos % n]), rotate(q, inter)), key


def vllm_scores(q, k, pos, c, local):
    """The score of every causal pair under the map the key's chunk picks (the prefill
    backend's intra / succ / inter ranges, from ``prev_chunk_end_pos = (i // n)·n``)."""
    n = c - local
    (qi, qs, qn), key = vllm_queries_keys(q, k, pos, c, local)
    maps = [a @ key.transpose(-1, -2) for a in (qi, qs, qn)]
    start = (pos // n * n)[:, None, :, None]  # (B, 1, Lq, 1): prev_chunk_end_pos of each query
    j = pos[:, None, None, :]
    return torch.where(j >= start, maps[0], torch.where(j >= start - n, maps[1], maps[2]))


def _attend(q, k, v, causal: bool):
    """flash_attn_func(..., return_attn_probs=True): output and softmax log-sum-exp (float64)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:  # Lq == Lk wherever ChunkLlama asks for it
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def chunkllama_prefill(q, k, v, c, local):
    """``forward``'s prefill path on ``q, k, v`` ``(B, H, L, Dh)`` (unrotated q, k) at positions 0..L-1."""
    n, L_ = c - local, k.shape[-2]
    (qi, qs, qn), k = vllm_queries_keys(q, k, torch.arange(L_)[None], c, local)
    results = [[_attend(qi[:, :, :n], k[:, :, :n], v[:, :, :n], True)]]
    k_prev, v_prev, remain = k[:, :, :n], v[:, :, :n], L_ - n
    while remain > 0:
        begin = L_ - remain
        end = begin + min(n, remain)
        per = [_attend(qi[:, :, begin:end], k[:, :, begin:end], v[:, :, begin:end], True)]
        per.append(_attend(qs[:, :, begin:end], k_prev, v_prev, False))
        if begin - k_prev.shape[-2] > 0:
            prev = k_prev.shape[-2]
            per.append(_attend(qn[:, :, begin:end], k[:, :, : begin - prev], v[:, :, : begin - prev], False))
        results.append(per)
        k_prev, v_prev, remain = k[:, :, begin:end], v[:, :, begin:end], remain - n
    out = [results[0][0][0]]  # merge_attn_outputs: weights softmax(lse) over the maps of a chunk
    for per in results[1:]:
        w = torch.softmax(torch.stack([lse for _, lse in per]), 0)
        out.append((torch.stack([o for o, _ in per]) * w.unsqueeze(-1)).sum(0))
    return torch.cat(out, 2)


def chunkllama_decode(q, k, v, c, local):
    """The ``q_len == 1`` path: ``q`` ``(B, H, 1, Dh)`` the last of ``kv_seq_len`` tokens."""
    n, kv_len = c - local, k.shape[-2]
    t = tables(c, local, kv_len)
    k = rotate(k, t["k"][torch.arange(kv_len)[None]])
    pos = torch.tensor([[kv_len - 1]]) % n
    cur = (kv_len - 1) // n  # chunk_num_curr
    scores = [rotate(q, t["q"][pos]) @ k[:, :, n * cur :].transpose(-1, -2)]
    if cur >= 1:
        scores.insert(0, rotate(q, t["qc"][pos]) @ k[:, :, n * (cur - 1) : n * cur].transpose(-1, -2))
    if cur >= 2:
        scores.insert(0, rotate(q, t["qc"][torch.tensor([[n - 1]])]) @ k[:, :, : n * (cur - 1)].transpose(-1, -2))
    return torch.softmax(torch.cat(scores, -1) / math.sqrt(q.shape[-1]), -1) @ v


# ------------------------------------------------------------------ (a) parity
@pytest.mark.parametrize("c,local", SETTINGS)
def test_scores_are_vllms_position_maps(c, local):
    """``qk_scores`` on every causal pair equals vLLM's three rotated queries against its keys,
    picked by the key's chunk, with other positions per row (an offset of 3: other chunks)."""
    enc = posenc.build("rope-extension", heads=HEADS, head_dim=HEAD_DIM, max_len=8, rope_extension=dca(c, local))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, HEADS, L, HEAD_DIM, generator=g), torch.randn(2, HEADS, L, HEAD_DIM, generator=g)
    pos = torch.stack([torch.arange(L), torch.arange(L) + 3])
    got = enc.qk_scores(q, k, pos, pos)
    want = vllm_scores(q.double(), k.double(), pos, c, local)
    causal = (pos[:, :, None] >= pos[:, None, :]).unsqueeze(1).expand_as(got)
    assert_close(got[causal], want[causal].float(), n=HEAD_DIM, magnitude=float(want.abs().max()))


@pytest.mark.parametrize("c,local", SETTINGS)
@pytest.mark.parametrize("backend", ["eager", "chunked", "maps"])
def test_prefill_equals_chunkllama(c, local, backend, monkeypatch):
    ran = count_fast_maps(monkeypatch)
    attn = make_attn(dca(c, local), chunk_size=5)
    x = _x()
    with torch.no_grad():
        q, k, v = (t.double() for t in qkv(attn, x))
        want = out_proj(attn, chunkllama_prefill(q, k, v, c, local).float())
        assert_close(attn(x, backend=backend), want, n=N)
    assert ran == ([True] if backend == "maps" else [])  # (maps: the fused maps ran, no fallback)


@pytest.mark.parametrize("c,local", SETTINGS)
def test_cached_decoding_equals_chunkllama_decoding_and_full_forward(c, local):
    attn = make_attn(dca(c, local))
    x = _x()
    prefill = 4
    with torch.no_grad():
        full = attn(x)
        cache = attn.init_cache(2, L)
        outs = [attn(x[:, :prefill], cache=cache)]
        q, k, v = (t.double() for t in qkv(attn, x))
        for t in range(prefill, L):
            step = attn(x[:, t : t + 1], cache=cache)
            o = chunkllama_decode(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], c, local)
            assert_close(step, out_proj(attn, o.float()), n=N, msg=f"step {t}")
            outs.append(step)
    assert_close(torch.cat(outs, 1), full, n=N, msg="cached decoding vs full forward")


def test_within_one_chunk_size_it_is_rope_and_past_it_no_distance_exceeds_chunk_size():
    """Up to ``chunk_size`` tokens every pair keeps its distance (intra, or succ within the
    local window): plain RoPE. Past it, the scores of the same query/key vectors at growing
    distance stop at ``chunk_size`` (distances from the paper's rule, not the implementation)."""
    c, local = 8, 3
    x = _x(n=c)
    with torch.no_grad():
        assert_close(make_attn(dca(c, local))(x), make_attn(None)(x), n=N)
        assert not torch.allclose(make_attn(dca(c, local))(_x()), make_attn(None)(_x()), atol=1e-3)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, HEADS, 1, HEAD_DIM, generator=g).expand(1, HEADS, L, HEAD_DIM).contiguous()
    pos = torch.arange(L)[None]
    rope = posenc.build("rope", heads=HEADS, head_dim=HEAD_DIM)
    qr, kr = rope.rotate(q, q, pos, pos)
    at = (qr[:, :, L - 1 :] @ kr.transpose(-1, -2))[0, :, 0].flip(-1)  # (H, L): RoPE score at distance d
    enc = posenc.build("rope-extension", heads=HEADS, head_dim=HEAD_DIM, rope_extension=dca(c, local))
    s = enc.qk_scores(q, q, pos, pos)[0, :, L - 1]  # query i = 23 (chunk 4, i mod 5 = 3), keys j
    n, i = c - local, L - 1
    d = [i % n - j % n if j // n == i // n else min(i % n + n, c) - j % n if j // n == i // n - 1 else c - j % n
         for j in range(L)]  # fmt: skip
    assert max(d) <= c
    assert_close(s, torch.stack([at[:, e] for e in d], -1), n=HEAD_DIM)


# ------------------------------------------------------------------ (b) backends
@pytest.mark.parametrize("c,local", SETTINGS)
def test_every_backend_that_runs_it_equals_eager(c, local):
    attn = make_attn(dca(c, local), chunk_size=3)
    enc = attn.encoding
    assert posenc.supported_backends(enc) == ["maps", "chunked", "eager"] and not enc.relative
    pos = torch.stack([torch.arange(L), torch.arange(L) + 3])
    n_grad = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L, grad=True)
    for b in posenc.supported_backends(enc):
        assert_backend_equals_eager(attn, _x(), pos, b, n=N, n_grad=n_grad, msg=str(enc.rope_extension))
    for b in ("sdpa", "dense", "flex"):
        with pytest.raises(ValueError, match="cannot run encoding 'rope-extension'"):
            attn(_x(), backend=b)


@pytest.mark.parametrize(
    "ext,match",
    [
        ({"type": "dca", "chunk_size": 8}, r"needs \['local_size'\]"),
        ({"type": "dca", "chunk_size": 0, "local_size": 0}, "chunk_size must be a positive int, got 0"),
        (dca(8, 8), r"local_size must be an int in \[0, chunk_size - 1 = 7\], got 8"),
        (dca(8, -1), r"local_size must be an int in \[0, chunk_size - 1 = 7\], got -1"),
        ({**dca(8, 2), "scale_base": 8}, r"unknown rope_extension key\(s\) \['scale_base'\]"),
        ({**dca(8, 2), "window": 4}, r"unknown rope_extension key\(s\) \['window'\]"),
    ],
)
def test_bad_settings_raise(ext, match):
    with pytest.raises(ValueError, match=match):
        posenc.build("rope-extension", heads=HEADS, head_dim=HEAD_DIM, max_len=8, rope_extension=ext)


# ------------------------------------------------------------------ (c) HF: the method as extend applies it
def test_hf_llama_within_chunk_size_is_the_model_and_hf_cache_decoding_is_the_full_forward():
    """A tiny random ``LlamaConfig`` converted with ``posenc.hf.convert``, DCA applied as
    ``posenc extend`` applies it (``Subject.variant``): the model as trained up to
    ``chunk_size`` tokens, not past it; one token at a time through HF's cache (and uneven
    prefill chunks) equals the full forward at 4× the training length."""
    pytest.importorskip("transformers")
    from tests.test_extend_parity import L as TRAIN_LEN
    from tests.test_extend_parity import V, config, logits, n_of, subject
    from transformers import LlamaForCausalLM

    from posenc.extend.evaluate import token_scores

    torch.manual_seed(4)
    stock = LlamaForCausalLM(config()).eval()
    sub = subject(stock)
    model, opts, why = sub.variant("dca", 4 * TRAIN_LEN)
    assert why is None and opts == {"rope_extension": dca(TRAIN_LEN * 3 // 4, TRAIN_LEN // 16)}
    assert model.posenc_stack.encoding(0).name == "rope-extension"
    c = opts["rope_extension"]["chunk_size"]
    ids = torch.randint(0, V, (2, c))
    assert_close(logits(model, ids), logits(sub.model, ids), n=n_of(stock.config, c))
    longer = torch.randint(0, V, (1, 4 * TRAIN_LEN))
    assert not torch.allclose(logits(model, longer), logits(sub.model, longer), atol=1e-3)
    ids = longer[0]
    full = torch.log_softmax(logits(model, longer)[0, :-1].double(), -1)
    want = -full.gather(-1, ids[1:, None])[:, 0]
    for chunk in (1, 9):
        nll, _, _ = token_scores("hf", model, ids, chunk=chunk)
        n = n_of(stock.config, 4 * TRAIN_LEN)
        assert_close(nll, want, n=n, magnitude=float(want.abs().max()), dtype=torch.float32, msg=f"chunk {chunk}")


# ------------------------------------------------------------------ (d) posenc extend
def test_extend_runs_dca_on_the_tiny_checkpoint(tmp_path, capsys):
    """``posenc extend`` with ``--methods none,dca`` on test_extend's tiny Llama checkpoint."""
    import json

    pytest.importorskip("transformers")
    from tests.test_extend import FAST, llama, run
    from tests.test_extend import L as TRAIN_LEN

    llama().save_pretrained(tmp_path / "tiny-llama")
    out = tmp_path / "run"
    assert run(tmp_path / "tiny-llama", "--lengths", "1x,4x", "--methods", "none,dca", "--out", out, *FAST) == 0
    res = json.loads((out / "results.json").read_text())
    cells = {(c["method"], c["length"]): c for c in res["cells"]}
    assert all(c["applicable"] for c in cells.values()) and len(cells) == 4
    for length in (TRAIN_LEN, 4 * TRAIN_LEN):  # chunk_size 24 < 32: DCA changes the model at both
        d, n = cells[("dca", length)]["ppl"], cells[("none", length)]["ppl"]
        assert math.isfinite(d) and d > 1 and d != n
    assert "chunk_size 24, local_size 2" in (out / "table.md").read_text()
    assert "dca" in capsys.readouterr().out
