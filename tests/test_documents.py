"""Packed sequences: ``AttentionMask.documents`` on every backend, ``document_ids`` in
:class:`posenc.Attention` and :class:`posenc.TransformerLM`, the position helpers.

The oracle is the definition: a packed row gives each document what the document gives
alone (same weights, positions restarting at 0), for every encoding, mode and backend.
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import DIM, HEAD_DIM, MAX_LEN, assert_close, attention_n, encoding_modes, lm_n
from tests.test_contract import ALL_BACKEND_CASES, make_attn, make_lm

import posenc
from posenc import AttentionMask
from posenc.positions import document_positions, documents_from_positions

SPLITS = [[4, 3, 3], [2, 8]]  # document lengths of each packed row (L = 10)
L = 10
N_ATTN = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L)


def _ids(splits=SPLITS) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in splits])  # (B, L)


def _spans(row: list[int]) -> list[tuple[int, int]]:
    ends = torch.tensor(row).cumsum(0).tolist()
    return list(zip([0, *ends[:-1]], ends))


# ============================================================================ position helpers
def test_document_positions_restart_and_documents_recover_them():
    ids = _ids()
    pos = document_positions(ids)
    assert pos.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert torch.equal(documents_from_positions(pos), ids)
    assert document_positions(torch.tensor([7, 7, 2, 2, 2])).tolist() == [0, 1, 0, 1, 2]  # any ids, 1-D
    # HF's rule for DataCollatorWithFlattening output: a document starts where position != previous + 1
    assert documents_from_positions(torch.tensor([0, 1, 2, 0, 1, 0, 5, 6])).tolist() == [0, 0, 0, 1, 1, 2, 3, 3]
    with pytest.raises(TypeError, match="document_ids must be an integer tensor"):
        document_positions(torch.zeros(4))
    with pytest.raises(ValueError, match=r"document_ids must have shape \(L,\) or \(B, L\)"):
        document_positions(torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="pos must be an integer tensor"):
        documents_from_positions(torch.zeros(3, dtype=torch.bool))


# ============================================================================ the mask
def test_mask_documents_dense_mask_mod_and_blocks_agree():
    ids = _ids()
    for causal in (True, False):
        m = AttentionMask(causal=causal, documents=ids)
        want = ids[:, :, None] == ids[:, None, :]  # (B, L, L): same document
        if causal:
            want = want & torch.ones(L, L, dtype=torch.bool).tril()
        dense = m.dense(L, L)
        assert dense.shape == (2, 1, L, L) and torch.equal(dense[:, 0], want)
        assert m.batched and not m.hides_nothing(L, L) and not m.is_causal_square(L, L)
        b, q, k = torch.meshgrid(torch.arange(2), torch.arange(L), torch.arange(L), indexing="ij")
        assert torch.equal(m.mask_mod()(b, None, q, k), want)
        # a block of queries against a range of keys, as the blocked backends cut them
        for qs, ks, ke in ((3, 0, 8), (5, 2, 10), (7, 4, 10)):
            block = m.narrow(qs, ks, ke).dense(3, ke - ks)
            assert torch.equal(block[:, 0], want[:, qs : qs + 3, ks:ke]), (causal, qs, ks, ke)
            # and a block cut again from that block
            inner = m.narrow(qs, ks, ke).narrow(1, 1, ke - ks).dense(2, ke - ks - 1)
            assert torch.equal(inner[:, 0], want[:, qs + 1 : qs + 3, ks + 1 : ke])
    with_cache = AttentionMask(offset=4, documents=torch.tensor([[0, 0, 1, 1, 1, 1, 2, 2]]))  # 4 queries, 8 keys
    assert torch.equal(
        with_cache.dense(4, 8)[0, 0].long(),
        torch.tensor(
            [[0, 0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0, 1, 1]]
        ),
    )


def test_mask_documents_errors():
    with pytest.raises(ValueError, match="documents must be an integer tensor of shape"):
        AttentionMask(documents=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="documents must be an integer tensor of shape"):
        AttentionMask(documents=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"document_ids must have shape \(B, 6\)"):
        AttentionMask(documents=torch.zeros(2, 4, dtype=torch.long)).check(2, 6, 6)


# ============================================================================ every backend
@pytest.mark.parametrize("name,causal,backend", ALL_BACKEND_CASES, ids=lambda v: str(v))
def test_packed_rows_equal_documents_alone_on_every_backend(name, causal, backend):
    """chunk_size 3 cuts query blocks across document boundaries (``narrow``)."""
    attn = make_attn(name, causal, chunk_size=3).eval()
    torch.manual_seed(1)
    x = torch.randn(2, L, DIM)
    ids = _ids()
    with torch.no_grad():
        packed = attn(x, document_positions(ids), document_ids=ids, backend=backend)
        for b, row in enumerate(SPLITS):
            for s, e in _spans(row):
                alone = attn(x[b : b + 1, s:e], backend=backend)
                assert_close(packed[b : b + 1, s:e], alone, n=N_ATTN, msg=f"{name}/{backend} row {b} [{s}:{e})")


def test_packed_gradients_equal_documents_alone():
    """Backward through the mask: the gradients of a packed row are those of its documents."""
    for name in ("t5", "shaw", "cope"):
        attn = make_attn(name, True, chunk_size=3)
        x = torch.randn(1, L, DIM)
        ids = _ids()[:1]
        xp = x.clone().requires_grad_(True)
        attn(xp, document_positions(ids), document_ids=ids).square().sum().backward()
        grads_packed = [p.grad.clone() for p in attn.parameters()]
        attn.zero_grad()
        xs = x.clone().requires_grad_(True)
        sum(attn(xs[:, s:e]).square().sum() for s, e in _spans(SPLITS[0])).backward()
        n = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L, grad=True)
        assert_close(xp.grad, xs.grad, n=n, msg=f"{name} input gradient")
        for gp, p in zip(grads_packed, attn.parameters()):
            assert_close(gp, p.grad, n=n, msg=f"{name} parameter gradient")


# ============================================================================ the model
@pytest.mark.parametrize("name", [n for n, c in encoding_modes() if c])
def test_transformer_lm_packed_documents_equal_documents_alone(name):
    """Default positions restart per document; input stages (a convolution) stay inside one."""
    lm = make_lm(name)
    torch.manual_seed(2)
    tokens = torch.randint(0, 32, (2, L))
    ids = _ids()
    with torch.no_grad():
        packed = lm(tokens, document_ids=ids)
        for b, row in enumerate(SPLITS):
            for s, e in _spans(row):
                alone = lm(tokens[b : b + 1, s:e])
                assert_close(packed[b : b + 1, s:e], alone, n=lm_n(dim=DIM, depth=2, length=L), msg=f"{name} [{s}:{e})")


def test_transformer_lm_document_ids_errors():
    lm = make_lm("rope")
    tokens = torch.randint(0, 32, (2, L))
    with pytest.raises(TypeError, match="document_ids must be an integer tensor"):
        lm(tokens, document_ids=torch.zeros(2, L))
    with pytest.raises(ValueError, match=r"document_ids must have shape \(10,\) or \(2, 10\)"):
        lm(tokens, document_ids=torch.zeros(2, L - 1, dtype=torch.long))
    with pytest.raises(ValueError, match="cannot be used with a cache or memory"):
        lm(tokens, cache=lm.init_cache(2, MAX_LEN), document_ids=_ids())
    attn = make_attn("alibi", True)
    cache = attn.init_cache(2, MAX_LEN)
    attn(torch.randn(2, 2, DIM), cache=cache)  # 2 tokens cached
    with pytest.raises(ValueError, match="cannot be used with a cache or memory"):  # one check, one message
        attn(torch.randn(2, L, DIM), cache=cache, document_ids=_ids())
    # one row of ids for the whole batch, and 1-D ids, are accepted
    with torch.no_grad():
        assert_close(lm(tokens, document_ids=_ids()[0]), lm(tokens, document_ids=_ids()[:1].expand(2, L)), n=1)


def test_positions_given_with_document_ids_are_used_as_given():
    """Explicit positions win over the restarting default (e.g. HF's flattened position_ids)."""
    lm = make_lm("alibi")
    tokens = torch.randint(0, 32, (1, L))
    ids = _ids()[:1]
    with torch.no_grad():
        a = lm(tokens, document_ids=ids)
        b = lm(tokens, pos=document_positions(ids), document_ids=ids)
        c = lm(tokens, pos=torch.arange(L)[None], document_ids=ids)
    assert torch.equal(a, b)
    # alibi is shift invariant: within-document distances are the same, so even arange agrees
    assert_close(c, a, n=lm_n(dim=DIM, depth=2, length=L))
    assert posenc.available()  # the registry is filled
