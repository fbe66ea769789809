"""``posenc.hf.convert`` on Mistral Large 4 (HF ``models/mistral_large4``): MLA with LeRoPE under YaRN,
NoPE every 4th layer, DeepSeek Sparse Attention (an indexer with its own interleaved RoPE picks each
query's top-k keys, a key cache of its own, ``"shared"`` layers reusing the previous top-k), layers
that reuse an earlier layer's latent keys/values, and a learned query temperature per head.

Oracles: the stock HF model with the same weights (tiny random configs, no download): its logits,
greedy tokens, the mask HF's SDPA mask function builds, its indexer's inputs; for the selection mask,
its definition (a masked softmax) on every backend.
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close, attention_n

transformers = pytest.importorskip("transformers")
from tests.test_hf import greedy  # noqa: E402
from tests.test_hf_families import assert_parity_padded_and_rotation_matters, logits, trainer_step  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

import posenc  # noqa: E402
import posenc.hf as ph  # noqa: E402
from posenc import AttentionMask  # noqa: E402
from posenc.attend.backends import attend  # noqa: E402

V, L = 96, 20
YARN = {  # Mistral Large 4's own form (factor 2048 over 512 tokens, attention_factor 1), scaled down
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "attention_factor": 1.0,
}


def config(**kw):
    """Mistral Large 4, tiny: 4 layers (the 4th NoPE), every kind of layer the config has: layer 0
    stores its latent for later layers, layer 1 reuses it and the previous top-k (``"shared"``),
    layer 2 reuses it with its own indexer (``reuse_but_indexer``), layer 3 owns both. Top-k 6 of up
    to 20 keys: the selection decides. 16 indexer heads: a key's ReLU index score is exactly 0 only
    when every head's is (2^-16), so the top-k meets no ties, which a decoding step's ``(1, T)``
    scores and a full call's ``(S, T)`` would break differently (stock HF's own cached = uncached
    fails with 2 heads)."""
    text = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        index_topk=6,
        index_head_dim=16,
        index_n_heads=16,
        indexer_types=["full", "shared", "full", "full"],
        kv_source_layers=[0, 0, 0, 3],
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        initializer_range=0.3,  # sharp attention: logits that depend on every position term
        rope_parameters=YARN,
    )
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4, image_size=16
    )
    return transformers.MistralLarge4Config(
        text_config=text | kw, vision_config=vision | dict(head_dim=8), image_token_index=V - 1
    )


# the other DeepSeek Sparse Attention rows: (LM class, config class); MLA behind q-LoRA, an indexer
# on every layer reading the q latent, RoPE on the indexer's first qk_rope_head_dim channels (halves)
DSA_ROWS = {
    "deepseek_v32": ("DeepseekV32ForCausalLM", "DeepseekV32Config"),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", "GlmMoeDsaConfig"),
}


def dsa_config(model_type: str):
    """The tiny config of a :data:`DSA_ROWS` type (also scripts/hf_coverage.py's): Mistral Large 4's
    sizes where the class has them, 2 layers, a q-LoRA of 24, one key head per query head (MLA
    expands its latent so; HF's SDPA would repeat fewer)."""
    text = config().text_config.to_dict()
    cls = getattr(transformers, DSA_ROWS[model_type][1])
    fields = set(cls().to_dict())
    keep = {
        k: v for k, v in text.items() if k in fields and k not in ("indexer_types", "layer_types", "mlp_layer_types")
    }
    keep |= dict(num_hidden_layers=2, q_lora_rank=24, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return cls(**{k: v for k, v in keep.items() if k not in ("model_type", "transformers_version", "architectures")})


def stock(**kw) -> torch.nn.Module:
    torch.manual_seed(11)
    model = transformers.MistralLarge4ForConditionalGeneration(config(**kw)).eval()
    with torch.no_grad():  # LeRoPE's alpha, the query temperatures and the norms off their init
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


def dsa_n(cfg, length: int) -> int:
    """Reduction length behind the logits (tests/conftest.py): per layer the kv latent (D), its norm
    and up-projection (rank), q·k over the q/k head, the MoE/MLP (twice: shared + routed), four
    norms; then the final norm and the head. (The indexer's top-k is discrete: it adds no error.)"""
    cfg = cfg.get_text_config()
    D, Dh = cfg.hidden_size, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    layer = attention_n(dim=D, length=length, head_dim=Dh) + 2 * cfg.kv_lora_rank + 2 * (D + cfg.intermediate_size)
    return cfg.num_hidden_layers * (layer + 4 * D) + 3 * D


def _text(model):
    return model.model.language_model


def test_every_kind_of_layer_is_in_the_tiny_config():
    cfg = config().text_config
    assert cfg.kv_sharing_modes == ["store", "reuse", "reuse_but_indexer", None]
    assert cfg.no_rope_layers == [1, 1, 1, 0]


def test_default_conversion_reproduces_stock_logits():
    """LeRoPE (the config's YaRN, the model's α) on the rotary part of the rope layers, NoPE on the
    4th; the indexer's top-k masks posenc's attention: stock logits, left padding included."""
    model = stock()
    ours = ph.convert(model).eval()
    assert [s["encoding"] for s in ours.config.posenc_layers] == ["lerope"] * 3 + ["nope"]
    enc = ours.posenc_stack.encoding(0)
    assert enc.rotary_dim == 8 and enc.rope_scaling["rope_type"] == "yarn"
    assert torch.equal(enc.alpha, _text(model).rotary_emb.alpha)  # the learned frequencies, taken over
    ids = torch.randint(1, V - 1, (2, L))
    n = dsa_n(model.config, L)
    assert_parity_padded_and_rotation_matters(model, ours, ids, n)


def test_without_the_selection_or_alpha_the_logits_move():
    """The parity above needs the top-k (a model whose indexer keeps every key is another model)
    and the taken-over α (plain YaRN RoPE is another model)."""
    model = stock()
    ids = torch.randint(1, V - 1, (2, L))
    want = logits(model, ids)
    every_key = stock(index_topk=64)  # (the same weights: topk sizes no parameter)
    assert (logits(ph.convert(every_key), ids) - want).abs().max() > 1e-2
    ours = ph.convert(model)
    with torch.no_grad():
        for enc in ours.posenc_stack.encodings:
            if hasattr(enc, "alpha"):
                enc.alpha.zero_()
    assert (logits(ours, ids) - want).abs().max() > 1e-2


def test_the_indexer_reads_the_stock_rotation_and_the_layers_the_identity():
    """posenc switches the model's rotation off for the attention; the indexer, a separate scorer,
    keeps it: it receives the stock model's ``(cos, sin)`` (LeRoPE's α included), the layer the identity."""
    model = stock()
    ours = ph.convert(model).eval()
    seen: dict = {}

    def keep(name):
        def hook(module, args, kwargs):
            seen[name] = args[1] if len(args) > 1 else kwargs["position_embeddings"]

        return hook

    handles = [
        _text(model).layers[0].self_attn.indexer.register_forward_pre_hook(keep("stock"), with_kwargs=True),
        _text(ours).layers[0].self_attn.indexer.register_forward_pre_hook(keep("ours"), with_kwargs=True),
        _text(ours).layers[0].self_attn.register_forward_pre_hook(keep("layer"), with_kwargs=True),
    ]
    ids = torch.randint(1, V - 1, (1, L))
    logits(model, ids), logits(ours, ids)
    for h in handles:
        h.remove()
    for a, b in zip(seen["ours"], seen["stock"]):
        assert torch.equal(a, b)
    cos, sin = seen["layer"]
    assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))


def test_mask_rows_the_indexer_reads_equal_hfs_sdpa_mask():
    """``PosencMask[:, 0]`` (the indexer's ``attention_mask[:, 0, :, :]``) is HF's SDPA boolean mask,
    padding and a cache offset included."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    from posenc.hf.masks import mask_interface

    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, :3] = False
    for q_len, q_offset in ((9, 0), (1, 8), (3, 6)):
        kw = dict(batch_size=2, q_length=q_len, kv_length=9, q_offset=q_offset, kv_offset=0)
        want = sdpa_mask(**kw, mask_function=causal_mask_function, attention_mask=pad, allow_is_causal_skip=False)
        got = mask_interface(**kw, mask_function=causal_mask_function, attention_mask=pad)
        assert torch.equal(got[:, 0, :, :], want[:, 0, :, :]) and torch.equal(got[:, 0], want[:, 0])
    with pytest.raises(ValueError, match=r"takes only \[:, :, -n:, :\]"):
        got[0]


@pytest.mark.parametrize("name", ["nope", "alibi"])
def test_selected_keys_on_every_backend_equal_the_masked_softmax(name):
    """``AttentionMask.selected`` on every backend of the encoding: the softmax over the keys that
    are causal and selected, as its definition (and dense, mask_mod and blocks agree)."""
    torch.manual_seed(0)
    B, H, Lq, Dh = 2, 2, 10, 8
    enc = posenc.build(name, heads=H, head_dim=Dh, max_len=32, causal=True)
    q, k, v = (torch.randn(B, H, Lq, Dh) for _ in range(3))
    pos = torch.arange(Lq)[None]
    selected = torch.rand(B, Lq, Lq) < 0.5
    selected |= torch.eye(Lq, dtype=torch.bool)  # (every row sees a key)
    mask = AttentionMask(selected=selected)
    keep = torch.ones(Lq, Lq, dtype=torch.bool).tril() & selected  # (B, Lq, Lk)
    assert torch.equal(mask.dense(Lq, Lq)[:, 0], keep) and mask.batched and not mask.is_causal_square(Lq, Lq)
    b, i, j = torch.meshgrid(torch.arange(B), torch.arange(Lq), torch.arange(Lq), indexing="ij")
    assert torch.equal(mask.mask_mod()(b, None, i, j), keep)
    assert torch.equal(mask.narrow(4, 2, 9).dense(3, 7)[:, 0], keep[:, 4:7, 2:9])
    scores = q @ k.transpose(-1, -2) * Dh**-0.5
    if name == "alibi":
        scores = scores + enc.bias(pos[0], pos[0])
    want = scores.masked_fill(~keep[:, None], float("-inf")).softmax(-1) @ v
    for backend in posenc.supported_backends(enc):
        got = attend(enc, q, k, v, pos, pos, mask, backend=backend)
        assert_close(got, want, n=attention_n(dim=Dh, length=Lq, head_dim=Dh), msg=backend)


def test_selected_errors():
    with pytest.raises(ValueError, match="selected must be a bool tensor of shape"):
        AttentionMask(selected=torch.zeros(2, 3, 3))
    with pytest.raises(ValueError, match=r"selected must have shape \(B, 3, 5\)"):
        AttentionMask(selected=torch.zeros(2, 3, 4, dtype=torch.bool)).check(2, 3, 5)
    from posenc.hf.attention import _selected

    with pytest.raises(ValueError, match=r"outside \[0, 4\]"):
        _selected(torch.tensor([[[0, 5]]]), 1, 1, 5)
    with pytest.raises(ValueError, match=r"must be \(B, Lq, k\) = \(1, 2, k\)"):
        _selected(torch.tensor([[0, 1]]), 1, 2, 5)


@pytest.mark.parametrize("encoding", [None, pytest.param("alibi", marks=pytest.mark.slow)])
def test_cached_generation_equals_uncached(encoding):
    """HF's cache holds the latent, the indexer's keys and the shared layers' latents; posenc rotates
    every cached key part at its position each step: cached = uncached greedy decoding, and with the
    model's own scheme the stock model's tokens."""
    model = stock()
    ours = ph.convert(model, encoding=encoding).eval()
    ids = torch.randint(1, V - 1, (2, 5))
    cached, cached_logits = greedy(ours, ids, 9, cache=DynamicCache(config=ours.config))
    uncached, uncached_logits = greedy(ours, ids, 9, use_cache=False)
    assert torch.equal(cached, uncached)
    assert_close(cached_logits, uncached_logits, n=dsa_n(model.config, 14))
    if encoding is None:  # (past the top-k of 6 from the second step on)
        want, want_logits = greedy(model, ids, 9, cache=DynamicCache(config=model.config))
        assert torch.equal(cached, want)
        assert_close(cached_logits, want_logits, n=dsa_n(model.config, 14))


def test_left_padded_batch_generation_equals_stock():
    """A left-padded batch: the indexer masks the pads through ``PosencMask[:, 0]`` and the attention
    through posenc's mask, at every step: the stock model's tokens and step logits."""
    model = stock()
    ours = ph.convert(model).eval()
    ids = torch.randint(1, V - 1, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    got, got_logits = greedy(ours, ids, 8, attention_mask=mask, cache=DynamicCache(config=ours.config))
    want, want_logits = greedy(model, ids, 8, attention_mask=mask, cache=DynamicCache(config=model.config))
    assert torch.equal(got, want)
    assert_close(got_logits, want_logits, n=dsa_n(model.config, 15))


def test_save_pretrained_round_trips_bit_for_bit(tmp_path):
    model = ph.convert(stock(), encoding=["lerope", "alibi", "lerope", "nope"]).eval()
    with torch.no_grad():
        for p in model.posenc_stack.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded).__name__ == "PosencMistralLarge4ForConditionalGeneration"
    assert loaded.config.posenc_layers == model.config.posenc_layers
    assert torch.equal(_text(loaded).rotary_emb.alpha, _text(model).rotary_emb.alpha)  # (the indexer's α)
    ids = torch.randint(1, V - 1, (2, 11))
    assert torch.equal(logits(loaded, ids), logits(model, ids))


def test_swap_trains_one_trainer_step(tmp_path):
    model = ph.convert(stock(), encoding="alibi")
    before = _text(model).layers[0].self_attn.q_proj.weight.detach().clone()
    loss, change = trainer_step(model, tmp_path)
    assert 0 < loss < 50 and change > 0
    assert not torch.equal(_text(model).layers[0].self_attn.q_proj.weight, before)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_mistral_large4_preset_reproduces_the_stock_model():
    """The ``mistral-large4`` preset (LeRoPE under Mistral Large 4's own YaRN, NoPE every 4th layer)
    as the encoding of a converted model with the config's default ``rope_parameters`` equals the
    stock model: the preset names the model's scheme, and its ``alpha`` is taken from the model."""
    model = stock(rope_parameters=None)
    assert model.config.text_config.rope_parameters["factor"] == 2048.0
    ours = ph.convert(model, encoding="mistral-large4").eval()
    ids = torch.randint(1, V - 1, (2, L))
    assert_close(logits(ours, ids), logits(model, ids), n=dsa_n(model.config, L))


def _dsa_stock(model_type: str) -> torch.nn.Module:
    torch.manual_seed(5)
    model = getattr(transformers, DSA_ROWS[model_type][0])(dsa_config(model_type)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("model_type", list(DSA_ROWS))
def test_deepseek_v32_and_glm5_convert_through_the_same_mechanism(model_type, monkeypatch):
    """DeepSeek-V3.2 and GLM-5 (``glm_moe_dsa``): rope on the decoupled part, the indexer on the
    model's own RoPE, its top-k as ``selected``: stock logits and greedy tokens (cached), and the
    indexer's RoPE matters (without the tap the logits move)."""
    model = _dsa_stock(model_type)
    assert model.config.index_topk < L and model.model.layers[0].self_attn.indexer is not None
    ours = ph.convert(model).eval()
    ids = torch.randint(1, V - 1, (2, L))
    n = dsa_n(model.config, L)
    want = logits(model, ids)
    assert_close(logits(ours, ids), want, n=n)
    prompt = ids[:, :5]
    got, got_logits = greedy(ours, prompt, 9, cache=DynamicCache(config=ours.config))
    stock_tokens, stock_logits = greedy(model, prompt, 9, cache=DynamicCache(config=model.config))
    assert torch.equal(got, stock_tokens)
    assert_close(got_logits, stock_logits, n=dsa_n(model.config, 14))
    from posenc.hf.off import RotaryTap

    monkeypatch.setattr(RotaryTap, "give", lambda self, *a: None)  # the indexers get the identity too
    assert (logits(ph.convert(model), ids) - want).abs().max() > 1e-2


@pytest.mark.parametrize(
    "ext", [{"type": "rerope", "window": 6}, {"type": "self-extend", "window": 6, "group_size": 3}]
)
def test_selected_keys_through_the_maps_backend_equal_eager(ext):
    """The two-map encodings' ``maps`` backend under a top-k selection equals the oracle (``eager``):
    it hands such a call to ``chunked``, which reads the selection."""
    torch.manual_seed(0)
    B, H, L, Dh = 2, 2, 24, 8
    enc = posenc.build("rope-extension", heads=H, head_dim=Dh, rope_extension=ext)
    q, k, v = (torch.randn(B, H, L, Dh) for _ in range(3))
    pos = torch.arange(L)[None]
    selected = (torch.rand(B, L, L) < 0.5) | torch.eye(L, dtype=torch.bool)
    mask = AttentionMask(selected=selected)
    assert "maps" in posenc.supported_backends(enc)
    want = attend(enc, q, k, v, pos, pos, mask, backend="eager")
    got = attend(enc, q, k, v, pos, pos, mask, backend="maps")
    assert_close(got, want, n=attention_n(dim=Dh, length=L, head_dim=Dh))
    assert (got - attend(enc, q, k, v, pos, pos, AttentionMask(), backend="maps")).abs().max() > 1e-3
