"""The public attention pipeline, the mask object, the model config and the layering (issue 16)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from tests.conftest import DIM, HEAD_DIM, HEADS, MAX_LEN, assert_close, attention_n, encoding_modes, lm_n, mode_id
from torch.overrides import TorchFunctionMode

import posenc
from posenc import AttentionMask, LayerSpec, ModelConfig, Stage

SRC = Path(posenc.__file__).parent
L = 8
N_ATTN = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L)


def _attn(name, causal=True, **kw):
    torch.manual_seed(0)
    attn = posenc.Attention(DIM, HEADS, name, head_dim=HEAD_DIM, causal=causal, max_len=MAX_LEN, **kw)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return attn


# ============================================================================ the mask
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_mask_dense_mask_mod_and_blocks_agree(causal, offset, padded):
    Lq, Lk = 5, 5 + offset
    kpm = torch.rand(2, Lk) > 0.3 if padded else None
    m = AttentionMask(causal=causal, offset=offset, key_padding=kpm)
    dense = m.dense(Lq, Lk)
    full = torch.ones(2, 1, Lq, Lk, dtype=torch.bool) if dense is None else dense.expand(2, 1, Lq, Lk)
    # the rule written out
    i, j = torch.arange(Lq)[:, None], torch.arange(Lk)[None, :]
    want = (j <= i + offset) if causal else torch.ones(Lq, Lk, dtype=torch.bool)
    want = want[None, None] & (kpm[:, None, None, :] if padded else True)
    assert torch.equal(full, want.expand(2, 1, Lq, Lk))
    mod = m.mask_mod()
    if mod is None:
        assert not causal and not padded
    else:
        b, q, k = torch.meshgrid(torch.arange(2), torch.arange(Lq), torch.arange(Lk), indexing="ij")
        assert torch.equal(mod(b, torch.zeros_like(b), q, k), want[:, 0].expand(2, Lq, Lk))
    # a block's narrowed mask is the slice of the whole one, and the skipped keys are all hidden
    for s, e in ((0, 2), (2, 5)):
        ks, ke = m.key_range(s, e, Lk)
        assert not full[..., s:e, :ks].any() and not full[..., s:e, ke:].any()
        sub = m.narrow(s, ks, ke).dense(e - s, ke - ks)
        sub = torch.ones(1, 1, e - s, ke - ks, dtype=torch.bool) if sub is None else sub
        assert torch.equal(sub.expand(2, 1, e - s, ke - ks), full[..., s:e, ks:ke])


def test_mask_errors_name_the_values():
    with pytest.raises(ValueError, match="offset must be an int >= 0, got -1"):
        AttentionMask(offset=-1)
    with pytest.raises(ValueError, match=r"bool tensor of shape \(B, Lk\), got torch.float32"):
        AttentionMask(key_padding=torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"shape \(B, 5\).*\(2, 4\)"):
        AttentionMask(key_padding=torch.ones(2, 4, dtype=torch.bool)).check(2, 5, 5)
    attn = posenc.Attention(DIM, HEADS, "rope")
    with pytest.raises(ValueError, match=r"key_padding_mask must be bool of shape \(B, 8\)"):
        attn(torch.randn(2, L, DIM), key_padding_mask=torch.ones(2, 7, dtype=torch.bool))


# ============================================================================ the pipeline
@pytest.mark.parametrize("mode", encoding_modes(), ids=mode_id)
def test_public_pipeline_reproduces_the_layer(mode):
    """project -> posenc.scores -> mask -> softmax (or the encoding's own weights) -> values -> o_proj equals
    attn(x), for every encoding."""
    name, causal = mode
    attn = _attn(name, causal)
    x = torch.randn(2, L, DIM)
    pos = torch.stack([torch.arange(L), torch.arange(L) + 3])
    enc = attn.encoding
    with torch.no_grad():
        ref = attn(x, pos=pos, backend="eager")
        call = attn.make_call(x, pos)
        h = attn.embed_input(x, call) if attn.runs_input_stage else x
        q, k, v, q_pos, k_pos, ctx = attn.project(h, call)
        parts = posenc.scores(enc, q, k, q_pos, k_pos, parts=True, ctx=ctx)
        s = posenc.scores(enc, q, k, q_pos, k_pos, ctx=ctx)
        assert set(parts) == {"qk"} | ({"terms"} if enc.stages & Stage.TERMS else set()) | (
            {"bias"} if enc.stages & Stage.BIAS else set()
        )
        assert_close(sum(parts.values()), s, n=HEAD_DIM + L)
        keep = call.mask(causal=causal, window=None, chunk=None, k_len=L).dense(L, L)
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        a = enc.weights(s, ctx=ctx) if enc.stages & Stage.NORM else torch.softmax(s, -1)  # (stick-breaking)
        o = a @ v
        if enc.stages & Stage.VALUE:
            o = o + enc.value_term(a, q_pos, k_pos, ctx=ctx)
        out = attn.o_proj(o.transpose(1, 2).reshape(2, L, -1))
    assert_close(out, ref, n=N_ATTN)


@pytest.mark.parametrize("mode", encoding_modes(), ids=mode_id)
def test_registry_functions_equal_the_layer(mode):
    """Every backend of the registry, called directly with a mask object, equals the layer's result."""
    name, causal = mode
    attn = _attn(name, causal)
    x = torch.randn(2, L, DIM)
    pos = torch.arange(L)[None]
    kpm = torch.ones(2, L, dtype=torch.bool)
    kpm[1, :2] = False
    with torch.no_grad():
        call = attn.make_call(x, pos, key_padding_mask=kpm)  # (read_input reads the padding: path's convolution)
        h = attn.embed_input(x, call) if attn.runs_input_stage else x
        p = attn.project(h, call)
        mask = AttentionMask(causal=causal, key_padding=kpm)
        for b in posenc.supported_backends(attn.encoding):
            out = posenc.BACKENDS[b](attn.encoding, *p[:5], mask, ctx=p.ctx)
            out = attn.o_proj(out.transpose(1, 2).reshape(2, L, -1))
            assert_close(out, attn(x, pos=pos, key_padding_mask=kpm, backend=b), n=N_ATTN, msg=b)


def test_relative_is_an_alias_of_chunked():
    attn = _attn("shaw", backend="relative")
    assert attn.backend == "chunked"
    x = torch.randn(2, L, DIM)
    assert torch.equal(attn(x, backend="relative"), attn(x, backend="chunked"))
    assert posenc.select_backend(posenc.build("cope", heads=HEADS, head_dim=HEAD_DIM), "cpu") == "chunked"
    with pytest.raises(ValueError, match="backend must be one of.*'chunked'.*'relative'"):
        posenc.Attention(DIM, HEADS, "rope", backend="fast")


class _CountMax(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.max, torch.max, torch.Tensor.amax, torch.amax):
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["learned", "tupe", "hierarchical", "multiplicative"])
def test_length_check_runs_once_per_call(name):
    """Non-extrapolating encodings are checked at the door: one pos.max() per forward, whatever the depth."""
    opts = {"table": "learned"} if name == "multiplicative" else {}
    lm = posenc.TransformerLM(32, DIM, 4, HEADS, name, max_len=MAX_LEN, **opts).eval()
    tokens = torch.randint(0, 32, (2, L))
    with torch.no_grad(), _CountMax() as counter:
        lm(tokens)
    assert counter.calls == 1
    with pytest.raises(ValueError, match="max_len=16"):
        lm(tokens, pos=torch.arange(L) + MAX_LEN if name != "hierarchical" else torch.arange(L) + MAX_LEN**2)


# ============================================================================ config
def test_keyword_form_builds_the_config():
    lm = posenc.TransformerLM(32, DIM, 2, HEADS, "t5", MAX_LEN, dropout=0.1, num_buckets=8, max_distance=12)
    cfg = lm.config
    assert isinstance(cfg, ModelConfig) and cfg.dropout == 0.1 and cfg.head_dim == DIM // HEADS
    assert cfg.options == {"num_buckets": 8, "max_distance": 12}
    assert cfg.layer_specs() == [LayerSpec("t5", {"num_buckets": 8, "max_distance": 12})] * 2
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    torch.manual_seed(0)
    a = posenc.TransformerLM.from_config(cfg)
    torch.manual_seed(0)
    b = posenc.TransformerLM(config=cfg)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(TypeError, match="either config= or the keyword form"):
        posenc.TransformerLM(32, config=cfg)
    with pytest.raises(ValueError, match="layers has 1 specs for depth=2"):
        ModelConfig(32, DIM, 2, HEADS, layers=[LayerSpec("rope")])
    with pytest.raises(ValueError, match="unknown option.*bogus"):
        posenc.TransformerLM(32, DIM, 2, HEADS, "rope", bogus=1)


def test_per_layer_specs_and_cached_decoding():
    cfg = ModelConfig(
        32,
        DIM,
        3,
        HEADS,
        max_len=MAX_LEN,
        layers=[LayerSpec("rope"), LayerSpec("alibi"), LayerSpec("rope", {"base": 500.0})],
    )
    lm = posenc.TransformerLM.from_config(cfg).eval()
    names = [b.attn.encoding.name for b in lm.blocks]
    assert names == ["rope", "alibi", "rope"] and lm.blocks[2].attn.encoding.base == 500.0
    t = torch.randint(0, 32, (2, 10))
    with torch.no_grad():
        full = lm(t)
        cache = lm.init_cache(2, 10)
        steps = torch.cat([lm(t[:, i : i + 1], cache=cache) for i in range(10)], 1)
    assert_close(steps, full, n=lm_n(dim=DIM, depth=3, length=10))


def test_old_checkpoints_still_load(tmp_path):
    """A checkpoint written before ModelConfig (flat dict; EMD table as the model's emd_pos) loads."""
    torch.manual_seed(0)
    lm = posenc.TransformerLM(
        20, DIM, 3, HEADS, "deberta-emd", max_len=MAX_LEN, absolute_from_layer=1, position_buckets=8
    )
    state = lm.state_dict()
    table = state["blocks.0.attn.encoding.absolute.weight"]
    old_state = {k: v for k, v in state.items() if not k.endswith("encoding.absolute.weight")}
    old_state["emd_pos.weight"] = table
    old_config = dict(
        vocab_size=20, dim=DIM, depth=3, heads=HEADS, encoding="deberta", max_len=MAX_LEN, head_dim=DIM // HEADS,
        causal=True, mlp_ratio=4.0, dropout=0.0, backend="auto", share_encoding=None, tie_embeddings=True,
        embed_std=0.02, memory_len=0, absolute_from_layer=1, position_buckets=8,
    )  # fmt: skip
    torch.save({"model_config": old_config, "model": old_state, "step": 3}, tmp_path / "old.pt")
    loaded, extra = posenc.load_checkpoint(tmp_path / "old.pt")
    assert extra == {"step": 3} and loaded.config.options == {"absolute_from_layer": 1, "position_buckets": 8}
    assert loaded.config.encoding == "deberta-emd"  # what posenc built then from "deberta" with absolute_from_layer
    tok = torch.randint(0, 20, (1, 6))
    assert torch.equal(loaded(tok), lm(tok))
    posenc.save_checkpoint(tmp_path / "new.pt", loaded)
    again, _ = posenc.load_checkpoint(tmp_path / "new.pt")
    assert again.config == loaded.config and torch.equal(again(tok), lm(tok))


def test_memory_is_an_option_of_xl_or_of_the_cache():
    lm = posenc.TransformerLM(20, DIM, 2, HEADS, "xl", memory_len=5)
    assert lm.config.options == {"memory_len": 5} and lm.init_memory().memory_len == 5
    rope = posenc.TransformerLM(20, DIM, 2, HEADS, "rope")
    mem = rope.init_memory(memory_len=4)  # any encoding: positions continue across segments
    t = torch.randint(0, 20, (1, 6))
    rope(t[:, :3], memory=mem)
    with torch.no_grad():
        out = rope(t[:, 3:], memory=mem)
        ref = rope(t)[:, 3:]
    assert_close(out, ref, n=lm_n(dim=DIM, depth=2, length=6))  # the memory covers the whole past here


# ============================================================================ layering
def _quoted_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


@pytest.mark.parametrize(
    "module",
    ["model.py", "layer/attention.py", "layer/call.py", "attend/backends.py", "mask.py", "layer/cache.py", "config.py"],
)
def test_core_modules_name_no_encoding(module):
    """The layer, the model and the backends learn everything from the encodings' declarations."""
    names = set(posenc.available())
    allowed = {"nope"} if module == "layer/attention.py" else {"rope"} if module in ("config.py", "model.py") else set()
    assert not (_quoted_names(SRC / module) & (names - allowed)), module  # only defaults of signatures
    text = (SRC / module).read_text()
    for flag in ("emd", "absolute_from_layer", "builds_embedding", "input_every_layer", "init_state", "tie_to"):
        assert not re.search(rf"\b{flag}\b", text), (module, flag)


def test_base_imports_nothing_above_it():
    imports = [n for n in ast.walk(ast.parse((SRC / "base.py").read_text())) if isinstance(n, ast.ImportFrom)]
    below = {(n.module, a.name) for n in imports if n.level for a in n.names}
    assert {m or name for m, name in below} == {"functional", "validate", "context", "contract"}  # ground floor only
    contract = [n for n in ast.walk(ast.parse((SRC / "contract.py").read_text())) if isinstance(n, ast.ImportFrom)]
    assert not [n.module for n in contract if n.level]  # the contract itself imports nothing of posenc
    for path in (SRC / "encodings").glob("*.py"):  # the encodings sit below the model
        imported = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)]
        assert not any(n.module in ("model", "attention", "checkpoint") for n in imported if n.level == 2), path.name
