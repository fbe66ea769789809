"""Issue 24, the library side: what the API accepts, and numerics that must not depend on
how a call is made (non-finite input on every backend, SinkWindow calls, conv under left
padding, stage methods past their tables, patterns, the corpus in memory)."""

from __future__ import annotations

import contextlib
import signal

import pytest
import torch
from tests.conftest import assert_close, attention_n, lm_n

import posenc
from posenc.data import TextData, embedded_corpus, step_generator

NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------------ 11: non-finite options
@pytest.mark.parametrize(
    "name, options, match",
    [
        ("rope", {"base": NAN}, "base=nan is not a finite number"),
        ("rope", {"base": INF}, "base=inf is not a finite number"),
        (
            "rope",
            {"rope_scaling": {"rope_type": "yarn", "factor": NAN, "original_max_position_embeddings": 8}},
            r"rope_scaling\['factor'\]=nan is not a finite number",
        ),
        ("nope-temperature", {"attn_scale": NAN}, "attn_scale=nan is not a finite number"),
        ("xpos", {"gamma": INF}, "gamma=inf is not a finite number"),
        ("xl", {"base": NAN}, "base=nan is not a finite number"),
        ("multiplicative", {"strength": INF}, "strength=inf is not a finite number"),
        ("fire", {"init_c": INF}, "init_c=inf is not a finite number"),
    ],
)
def test_non_finite_options_are_refused_at_construction(name, options, match):
    with pytest.raises(ValueError, match=f"encoding '{name}': {match}; allowed: finite numbers"):
        posenc.build(name, heads=2, head_dim=8, max_len=16, **options)
    with pytest.raises(ValueError, match=match):  # the class called directly: the same check
        posenc.get_class(name)(heads=2, head_dim=8, max_len=16, **options)
    with pytest.raises(ValueError, match=r"ModelConfig: options\['\w+'\].*=(nan|inf) is not a finite number"):
        posenc.TransformerLM(32, 16, 1, 2, name, max_len=16, **options)


def test_non_finite_options_from_patterns_and_specs():
    with pytest.raises(ValueError, match=r"options\['base'\]=inf is not a finite number"):  # JSON's 1e400 is inf
        posenc.TransformerLM(32, 16, 1, 2, "rope(base=1e400)", max_len=16)
    with pytest.raises(ValueError, match=r"LayerSpec: options\['base'\]=nan is not a finite number"):
        posenc.LayerSpec("rope", {"base": NAN})


# ------------------------------------------------------------------ 11: backends on non-finite input
def _nan_cases():
    for name in posenc.available():
        for causal in (True, False):
            try:
                enc = posenc.build(name, heads=2, head_dim=8, max_len=16, causal=causal)
            except ValueError:
                continue  # causal-only encodings
            for backend in posenc.supported_backends(enc):
                if backend != "eager":
                    yield name, causal, backend


def _qkv(kind: str):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 8, generator=g) for _ in range(3))
    if kind == "q":
        q[0, 0, 3, 1] = NAN  # one query entry
    elif kind == "k":
        k[1, 1, :, 2] = NAN  # a diverged key channel of one head
    else:
        v[0, 1, 5, 0] = INF
    return q, k, v


@pytest.mark.parametrize("name, causal, backend", list(_nan_cases()), ids=str)
def test_every_backend_equals_eager_on_non_finite_input(name, causal, backend):
    """A NaN or inf in q, k or v gives NaN in that (batch row, head) on every backend, never a
    zero where eager says NaN (CPU SDPA's flash kernel returned 0 for a NaN query row)."""
    attn = posenc.Attention(16, 2, name, max_len=16, causal=causal)
    pos = torch.arange(8)[None]
    mask = posenc.AttentionMask(causal=causal)
    with torch.no_grad():  # the call context the layer hands its backend (FoX's gates read the input)
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
        ctx = attn.project(x, attn.make_call(x, pos)).ctx
    for kind in ("q", "k", "v"):
        q, k, v = _qkv(kind)
        with torch.no_grad():
            outs = {
                b: posenc.BACKENDS[b](
                    attn.encoding, q, k, v, pos, pos, mask, qk_proj=(attn.q_proj, attn.k_proj), ctx=ctx
                )
                for b in ("eager", backend)
            }
        ref, out = outs["eager"], outs[backend]
        assert torch.equal(out.isnan(), ref.isnan()), f"{name}/{backend}: NaN where eager has none, or no NaN"
        bad = {"q": (0, 0), "k": (1, 1), "v": (0, 1)}[kind]
        assert ref[bad].isnan().all(), "the head that read a non-finite value is NaN"
        assert_close(out.nan_to_num(), ref.nan_to_num(), n=attention_n(dim=16, head_dim=8, length=8))


# ------------------------------------------------------------------ 12: types of the public constructors
@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: posenc.Attention(16, 2, "rope", causal="no"), TypeError, "Attention: causal must be a bool, got 'no'"),
        (lambda: posenc.Attention(16, 2, "rope", qkv_bias="no"), TypeError, "qkv_bias must be a bool, got 'no'"),
        (lambda: posenc.Attention(16, 2, "rope", chunk_size=2.5), TypeError, "chunk_size must be an int, got 2.5"),
        (lambda: posenc.Attention(True, 2, "rope"), TypeError, "dim must be an int, got True"),
        (lambda: posenc.build("rope", heads=2, head_dim=8, causal="no"), TypeError, "causal must be a bool"),
        (lambda: posenc.build("rope", heads=2, head_dim=8, max_len=True), ValueError, "max_len must be a positive"),
        (lambda: posenc.build("shaw", heads=2, head_dim=8, per_head="no"), TypeError, "per_head must be a bool"),
        (lambda: posenc.build("t5", heads=2, head_dim=8, scale_logits=1), TypeError, "scale_logits must be a bool"),
        (lambda: posenc.TransformerLM(32, 16, 1, 2, causal="no"), TypeError, "ModelConfig: causal must be a bool"),
        (lambda: posenc.TransformerLM(32, 16, 1, 2, tie_embeddings="no"), TypeError, "tie_embeddings must be a bool"),
        (lambda: posenc.TransformerLM(32, 16, 1, 2, share_encoding="yes"), TypeError, "must be a bool or None"),
        (lambda: posenc.TransformerLM(32, 16, 1, 2, mlp_ratio=-1), ValueError, "mlp_ratio must be a finite number > 0"),
        (lambda: posenc.TransformerLM(32, 16, 1, 2, mlp_ratio=INF), ValueError, "mlp_ratio must be a finite number"),
        (lambda: posenc.TransformerLM(32, 16, 1, 2, embed_std=NAN), ValueError, "embed_std must be a finite number"),
        (lambda: posenc.TransformerLM(32, 16, 1, 2, dropout=NAN), ValueError, "dropout must be a finite number"),
        (lambda: posenc.ModelConfig(32, 16, 1, 2, head_dim=0), ValueError, "head_dim must be a positive int"),
        (lambda: posenc.Attention(16, 2, "rope").init_cache(2.5, 8), TypeError, "KVCache: batch_size must be an int"),
        (lambda: posenc.TransformerLM(32, 16, 1, 2, "xl").init_memory(True), ValueError, "memory_len must be an int"),
        (lambda: posenc.BlockOptions(chunk_size=True), ValueError, "chunk_size must be an int >= 1, got True"),
    ],
)
def test_public_constructors_check_their_types(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_select_backend_names_the_allowed_devices():
    enc = posenc.build("alibi", heads=2, head_dim=16)  # flex runs heads of 16+ channels on CUDA
    with pytest.raises(ValueError, match="device_type must be a torch device type such as 'cpu', 'cuda'.*got 'tpu'"):
        posenc.select_backend(enc, "tpu")
    with pytest.raises(ValueError, match="got 'cuda:0'"):
        posenc.select_backend(enc, "cuda:0")
    assert posenc.select_backend(enc, "cuda") == "flex"
    assert posenc.select_backend(enc, "cpu", 8, 8) == "dense"


# ------------------------------------------------------------------ 13a: SinkWindow calls of several tokens
def _decode(lm, tokens, prefill, cache, step):
    with torch.no_grad():
        outs = [lm(tokens[:, :prefill], cache=cache)]
        for t in range(prefill, tokens.shape[1], step):
            outs.append(lm(tokens[:, t : t + step], cache=cache))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("enc", ["rope", "alibi"])
@pytest.mark.parametrize("prefill, step", [(1, 3), (1, 5), (20, 4), (29, 1)])
def test_sink_window_calls_of_several_tokens_equal_token_by_token(enc, prefill, step):
    """However the stream is cut into calls, every query sees the sinks and its window at the
    positions token-by-token decoding (StreamingLLM's evaluation) gives it."""
    torch.manual_seed(0)
    lm = posenc.TransformerLM(50, 16, 2, 2, enc, max_len=64).eval()
    tokens = torch.randint(0, 50, (1, 29))
    policy = posenc.SinkWindow(sinks=4, window=9)
    ref = _decode(lm, tokens, 1, lm.init_cache(1, 29, policy=policy), 1)
    cache = lm.init_cache(1, 29, policy=policy)
    out = _decode(lm, tokens, prefill, cache, step)
    assert_close(out, ref, n=lm_n(dim=16, depth=2, length=13))
    assert all(c.k.shape[2] == 4 + 8 and c.pos.shape[1] == 12 for c in cache.layers)
    attn, c = lm.blocks[0].attn, cache.layers[0]
    x = torch.randn(1, 3, 16)
    with torch.no_grad():
        p = attn.project(x[:, :1], attn.make_call(x[:, :1], torch.tensor([[29]]), c), c)
    assert int(p.k_pos.max()) == 4 + 9 - 1  # positions stay below sinks + window


# ------------------------------------------------------------------ 13b: conv under left padding
@pytest.mark.parametrize("causal, padding, k", [(True, "zeros", 3), (True, "none", 4), (False, "zeros", 5)])
def test_conv_left_padding_gives_the_unpadded_logits(causal, padding, k):
    torch.manual_seed(0)
    lm = posenc.TransformerLM(32, 16, 2, 2, "conv", max_len=32, causal=causal, padding=padding, kernel_size=k).eval()
    toks, pad = torch.randint(0, 32, (1, 6)), 3
    padded = torch.cat([torch.randint(0, 32, (1, pad)), toks], 1)
    kpm = torch.cat([torch.zeros(1, pad, dtype=torch.bool), torch.ones(1, 6, dtype=torch.bool)], 1)
    pos = torch.cat([torch.zeros(pad, dtype=torch.long), torch.arange(6)])[None]  # real tokens at 0..5
    with torch.no_grad():
        out, ref = lm(padded, pos=pos, key_padding_mask=kpm), lm(toks)
    assert_close(out[:, pad:], ref, n=lm_n(dim=16, depth=2, length=9) + k + 2)


# ------------------------------------------------------------------ 13c: stage methods past their tables
@pytest.mark.parametrize(
    "name, options, stage, match",
    [
        ("hierarchical", {"table_len": 4}, "embed", r"supports positions 0\.\.15 \(table_len² = 4²"),
        ("learned", {}, "embed", r"supports positions 0\.\.15 \(max_len=16\)"),
        ("learned", {"axes": 2, "axial_shape": (4, 4), "axial_dims": (8, 8)}, "embed", "0..3 on axis 0"),
        ("multiplicative", {"table": "learned"}, "embed", r"supports positions 0\.\.15"),
        ("deberta-emd", {"absolute_from_layer": 0}, "embed", r"supports positions 0\.\.15"),
        ("tupe", {}, "bias", r"supports positions 0\.\.15"),
    ],
)
def test_stage_methods_check_their_positions(name, options, stage, match):
    enc = posenc.build(name, heads=2, head_dim=8, max_len=16, **options)
    past = torch.arange(14, 20)
    pos = past if enc.axes == 1 else torch.stack([past, past], -1)
    x = torch.randn(1, 6, 16)
    call = (lambda p: enc.embed(x, p)) if stage == "embed" else (lambda p: enc.bias(p, p))
    with pytest.raises(ValueError, match=match):
        call(pos)
    if name == "learned" and enc.axes == 1:
        with pytest.raises(ValueError, match="holds position -1; positions must be >= 0"):
            call(torch.arange(-1, 5))
    call(pos.clamp(max=3))  # inside the table: no error


# ------------------------------------------------------------------ 14, 15: patterns
@contextlib.contextmanager
def _time_limit(seconds: float):
    def stop(signum, frame):
        raise TimeoutError(f"took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_repeat_counts_are_checked_before_expanding():
    with _time_limit(2.0):
        with pytest.raises(ValueError, match="the pattern has 99999999999 layers, more than depth=2"):
            posenc.layers("rope*99999999999", depth=2)
        with pytest.raises(ValueError, match="more than depth=2"):
            posenc.TransformerLM(32, 16, 2, 2, "(rope,nope)*99999999999999999999999999", max_len=16)
        with pytest.raises(ValueError, match="more than the 10000 a pattern may describe"):
            posenc.layers("rope*99999999999")
    assert len(posenc.layers("rope*0003", depth=3)) == 3


def test_deep_nesting_is_a_value_error():
    with pytest.raises(ValueError, match="groups nest more than 50 deep"):
        posenc.layers("(" * 3000 + "rope" + ")" * 3000)
    with pytest.raises(ValueError, match="a JSON value nests more than 50 deep"):
        posenc.layers("rope(rope_scaling=" + "[" * 3000 + ")")
    assert posenc.layers("((rope,nope))*2", depth=4)[1].encoding == "nope"


# ------------------------------------------------------------------ 14: the corpus in memory
def test_text_corpus_is_held_as_bytes_and_batches_are_unchanged():
    data = embedded_corpus()[:50_000]
    for starts in (None, [0, 100, 5_000, 40_000], [40_000, 100, 100, 5_000, 49_999]):
        d = TextData(data, seed=3, doc_starts=starts)
        assert d.train.dtype == torch.uint8 and d.val.dtype == torch.uint8  # 1 byte per token, not 8
        # the batches the int64 corpus gave (the code before): same values, int64
        t = torch.tensor(list(data), dtype=torch.long)
        n_val = int(len(t) * 0.1)
        train, val = t[: len(t) - n_val], t[len(t) - n_val :]
        b = d.train_batch(7, 4, 32)
        g = step_generator(3, 7)
        idx = torch.randint(0, len(train) - 32, (4,), generator=g)[:, None] + torch.arange(33)
        assert b.tokens.dtype == torch.long and torch.equal(b.tokens, train[idx][:, :-1])
        assert torch.equal(b.targets, train[idx][:, 1:])
        windows, _ = d.eval_windows(32, 256)
        assert windows.dtype == torch.long and torch.equal(windows[1], val[32:65])
        if starts is not None:
            first = torch.zeros(len(train), dtype=torch.long)
            first[torch.tensor([s for s in starts if 0 < s < len(train)])] = 1
            docs = first.cumsum(0)[idx]
            assert b.documents.dtype == torch.long and torch.equal(b.documents, docs[:, :-1] - docs[:, :1])


# ------------------------------------------------------------------ 16: spec fields in the keyword form
def test_keyword_form_takes_the_layer_fields_for_a_plain_encoding():
    torch.manual_seed(0)
    lm = posenc.TransformerLM(32, 16, 2, 2, encoding="rope", max_len=32, window=4, sinks=True, base=500.0)
    torch.manual_seed(0)
    ref = posenc.TransformerLM(32, 16, 2, 2, encoding="rope(window=4,sinks=true,base=500.0)*2", max_len=32)
    assert [b.attn.window for b in lm.blocks] == [4, 4] and all(b.attn.sinks is not None for b in lm.blocks)
    assert lm.config.layers == ref.config.layers
    tokens = torch.randint(0, 32, (2, 12))
    with torch.no_grad():
        assert torch.equal(lm(tokens), ref(tokens))
    again = posenc.ModelConfig.from_dict(lm.config.to_dict())
    assert again.layers == lm.config.layers


# ------------------------------------------------------------------ issue 61, item 8: sizes before allocating
@pytest.mark.parametrize(
    "name, options, given",
    [
        ("learned", {"max_len": 2**40}, "max_len=1099511627776"),
        ("learned", {"max_len": 16, "axes": 2, "axial_shape": (4, 2**40), "axial_dims": (8, 8)}, "axial_shape"),
        ("hierarchical", {"max_len": 16, "table_len": 2**40}, "table_len=1099511627776"),
        ("multiplicative", {"max_len": 2**40, "table": "learned"}, "max_len=1099511627776"),
        ("tupe", {"max_len": 2**40}, "max_len=1099511627776"),
        ("deberta-emd", {"max_len": 2**40}, "max_len=1099511627776"),
        ("shaw", {"max_len": 16, "max_relative_position": 2**40}, "max_relative_position=1099511627776"),
        ("cope", {"max_len": 16, "npos_max": 2**40}, "npos_max=1099511627776"),
    ],
)
def test_position_tables_are_bounded_before_allocating(name, options, given):
    """``posenc.build('learned', max_len=2**40)`` was the allocator's "can't allocate memory"."""
    with (
        _time_limit(5.0),
        pytest.raises(ValueError, match=rf"encoding '{name}': {given}.*at most 16777216 \(2\*\*24\)"),
    ):
        posenc.build(name, heads=2, head_dim=8, **options)
    fits = {k: tuple(16 if n == 2**40 else n for n in v) if isinstance(v, tuple) else 16 if v == 2**40 else v
            for k, v in options.items()}  # fmt: skip
    posenc.build(name, heads=2, head_dim=8, **fits)


def test_a_cache_larger_than_the_machine_is_refused_naming_the_bytes(monkeypatch):
    """``model.init_cache(1, 10**12)`` was the allocator's error, or the OOM killer."""
    lm = posenc.TransformerLM(32, 16, 2, 2, "rope")
    per_token = 2 * 2 * 8 * 4 + 8  # one layer: k and v (2 heads of 8 float32) and a position
    need = 2 * per_token * 10**12
    with _time_limit(5.0), pytest.raises(ValueError, match=rf"needs {need:,} bytes, more than the [0-9,]+ bytes"):
        lm.init_cache(1, 10**12)
    with pytest.raises(ValueError, match=rf"needs {need // 2:,} bytes"):
        lm.blocks[0].attn.init_cache(1, 10**12)
    with pytest.raises(ValueError, match="KVCache: needs"):
        posenc.layer.cache.KVCache(1, 10**12, 2, 8)
    assert lm.init_cache(1, 10**12, device="meta").layers[0].k.shape[2] == 10**12  # nothing allocated
    monkeypatch.setattr(posenc.validate, "memory_of", lambda device: 10**6)  # a machine of 1 MB
    n = 600_000 // per_token  # each layer fits in it, the two do not
    with pytest.raises(ValueError, match=rf"init_cache\(1, {n}\): needs {2 * n * per_token:,} bytes"):
        lm.init_cache(1, n)
    assert lm.blocks[0].attn.init_cache(1, n).k.shape == (1, 2, n, 8)
    assert lm.init_cache(2, 64).layers[0].k.shape == (2, 2, 64, 8)


# ------------------------------------------------------------------ issue 61, item 9: HF's mrope layout
@pytest.mark.parametrize("shape", [(3, 8), (3, 1, 8), (3, 2, 8)])
def test_hf_axes_first_mrope_positions_are_named(shape):
    attn = posenc.Attention(64, 4, encoding="mrope")
    x = torch.randn(shape[1] if len(shape) == 3 else 1, 8, 64)
    with pytest.raises(
        ValueError, match=r"axes last: \(L, 3\) or \(B, L, 3\).*HF's .*\(3, L\) / \(3, B, L\).*transposed"
    ):
        attn(x, pos=torch.zeros(shape, dtype=torch.long))
    pos = torch.zeros(shape, dtype=torch.long).movedim(0, -1)  # the fix the message names
    assert attn(x, pos=pos).shape == x.shape
    assert attn(torch.randn(3, 8, 64), pos=torch.zeros(3, 8, dtype=torch.long)).shape == (3, 8, 64)  # (B, L)
