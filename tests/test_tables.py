"""Position tables once per model call (issue #25 item 3): RoPE's cos/sin, xPos's scaled
tables, T5's distance range, buckets and far field go through the call's
:class:`posenc.context.Tables` memo, shared by the layers whose encodings agree on them.

Each test compares the model with the memo against the same model with ``Tables.get``
patched to compute every time (bit-identical outputs and gradients), and counts the
memo's answers: none on the code before the memo.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import posenc
from posenc import LayerSpec
from posenc.context import Tables
from posenc.encodings.bias import T5


@contextlib.contextmanager
def tables_log(memo: bool = True):
    """Every Tables a forward makes (``log["tables"]``) and every ``make()`` run, by
    ``(owner, name)`` (``log["made"]``); ``memo=False``: ``get`` always calls ``make()``."""
    log: dict[str, list] = {"tables": [], "made": []}
    init, get = Tables.__init__, Tables.get

    def tracking_init(self):
        init(self)
        log["tables"].append(self)

    def tracking_get(self, owner, name, inputs, make):
        def counted():
            log["made"].append((owner, name))
            return make()

        return get(self, owner, name, inputs, counted) if memo else counted()

    Tables.__init__, Tables.get = tracking_init, tracking_get
    try:
        yield log
    finally:
        Tables.__init__, Tables.get = init, get


def lm(encoding="rope", depth=3, **kw):
    torch.manual_seed(0)
    return posenc.TransformerLM(64, 32, depth, 2, encoding=encoding, max_len=64, **kw).eval()


def forward(model, tokens, memo, **kw):
    with tables_log(memo) as log, torch.no_grad():
        out = model(tokens, **kw)
    return out, log


TOKENS = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("encoding", ["rope", "xpos", "mrope"])
def test_rotary_tables_once_per_forward(encoding):
    """Per-layer RoPE (xPos) instances with equal options make their cos/sin once per call:
    the other layers read the memo, and the logits are those computed without it."""
    model = lm(encoding)
    encs = [b.attn.encoding for b in model.blocks]
    assert len({id(e) for e in encs}) == 3  # one instance per layer: sharing is by options
    out, log = forward(model, TOKENS, memo=True)
    ref, _ = forward(model, TOKENS, memo=False)
    assert torch.equal(out, ref)
    (tables,) = log["tables"]
    assert len(log["made"]) == 1 and tables.hits == 2  # made in layer 0, read by layers 1 and 2


def test_rope_different_options_never_share():
    """Layers whose RoPE differs in ``base`` keep their own tables; equal ones share."""
    specs = [LayerSpec("rope", {"base": 10000.0}), LayerSpec("rope", {"base": 500.0}), LayerSpec("rope")]
    model = lm(layers=specs)
    out, log = forward(model, TOKENS, memo=True)
    ref, _ = forward(model, TOKENS, memo=False)
    assert torch.equal(out, ref)
    (tables,) = log["tables"]
    assert len(log["made"]) == 2 and tables.hits == 1  # layer 2 (base 10000) reads layer 0's
    owners = {name for _, name in log["made"]}
    assert len(owners) == 2 and any("500.0" in n for n in owners)


def test_rope_replaced_buffer_is_not_shared():
    """An instance whose frequencies were replaced by hand files its tables under itself."""
    model = lm(depth=2)
    enc = model.blocks[1].attn.encoding
    enc.inv_freq = enc.inv_freq * 0.5
    assert enc.table_key()[0] is enc
    out, log = forward(model, TOKENS, memo=True)
    ref, _ = forward(model, TOKENS, memo=False)
    assert torch.equal(out, ref)
    assert len(log["made"]) == 2 and log["tables"][0].hits == 0


def test_rope_tables_once_per_decoding_step():
    """With a KV cache (prefill, then one token at a time) every call shares its tables across
    the layers and decodes exactly as without the memo."""
    model = lm()
    runs = {}
    for memo in (True, False):
        cache = model.init_cache(2, 32)
        outs, hits = [], []
        for s, e in ((0, 20), (20, 21), (21, 22), (22, 24)):
            out, log = forward(model, TOKENS[:, s:e], memo, cache=cache)
            outs.append(out)
            hits.append(log["tables"][0].hits)
        runs[memo] = outs, hits
    for a, b in zip(runs[True][0], runs[False][0]):
        assert torch.equal(a, b)
    assert runs[True][1] == [2, 2, 2, 2]


@pytest.mark.parametrize("backend", ["blockwise", "dense", "chunked"])
def test_t5_tables_once_per_forward(backend):
    """T5's distance range, buckets (and far field, blockwise) are made once per call: the
    logits, and with gradients the gradients, equal those computed without the memo."""
    model = lm("t5", backend=backend)
    out, log = forward(model, TOKENS, memo=True)
    ref, _ = forward(model, TOKENS, memo=False)
    assert torch.equal(out, ref)
    made = log["made"]
    assert log["tables"][0].hits >= 2 * (3 - 1)  # every table of layers 1 and 2 from the memo
    assert len(made) == len(set(made))  # nothing made twice under one key
    grads = {}
    for memo in (True, False):
        model.zero_grad(set_to_none=True)
        with tables_log(memo):
            model(TOKENS).square().mean().backward()
        grads[memo] = [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


def test_t5_bucket_tables_shared_by_options_not_parameters():
    """Per-layer T5 instances (``share_encoding=False``) share the parameter-free buckets but
    each reads its own learned table; different bucket options share nothing."""
    model = lm("t5", share_encoding=False, backend="dense")
    out, log = forward(model, TOKENS, memo=True)
    ref, _ = forward(model, TOKENS, memo=False)
    assert torch.equal(out, ref) and log["tables"][0].hits >= 4
    specs = [LayerSpec("t5", {"num_buckets": 16}), LayerSpec("t5", {"num_buckets": 8})]
    model = lm(layers=specs, depth=2, backend="dense")
    out, log = forward(model, TOKENS, memo=True)
    ref, _ = forward(model, TOKENS, memo=False)
    assert torch.equal(out, ref)
    buckets = [n for _, n in log["made"] if "buckets" in n]
    assert len(buckets) == 2 and buckets[0] != buckets[1]  # one per option set, none read across


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 20), (4, 3), (64, 1000)])
def test_t5_rows_from_the_near_buckets(causal, num_buckets, max_distance):
    """The blockwise rows read from the buckets of ``[lo, hi]`` at ``clamp(d, lo, hi)`` equal
    the buckets of ``d`` itself, far beyond ``max_distance`` too."""
    if not causal and num_buckets < 4:
        pytest.skip("bidirectional T5 needs 4 buckets")
    t5 = T5(heads=2, head_dim=8, causal=causal, num_buckets=num_buckets, max_distance=max_distance)
    terms = t5.distance_terms(None, None)
    d = torch.arange(-5 * max_distance - 50, 5 * max_distance + 50)
    assert torch.equal(terms.rows(d), t5.buckets(d))


def test_hf_adapter_makes_rope_tables_once_per_forward():
    """In a converted HF model every layer of a forward gets the same mask object, which carries
    the call's Tables: cos/sin are made in the first layer and read by the others, prefill and
    decoding alike, with logits equal to those computed without the memo (on 59d1c16 each of
    the layers made its own: no memo in the adapter)."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    import posenc.hf

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = posenc.hf.convert(LlamaForCausalLM(cfg).eval())
    tokens = TOKENS[:, :12]
    out, log = forward(model, tokens, memo=True)
    ref, _ = forward(model, tokens, memo=False)
    assert torch.equal(out.logits, ref.logits)
    assert sum(len(t._memo) for t in log["tables"]) == 1 and sum(t.hits for t in log["tables"]) == 2
    with torch.no_grad():  # one decoding step: one table for the query and the new key (the cache
        first = model(tokens, use_cache=True)  # holds rotated keys: posenc.hf.keys), made once
        with tables_log(True) as step:
            model(TOKENS[:, 12:13], past_key_values=first.past_key_values)
    assert sum(len(t._memo) for t in step["tables"]) == 1 and sum(t.hits for t in step["tables"]) == 2
