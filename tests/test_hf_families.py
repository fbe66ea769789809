"""``posenc.hf.convert`` across the HF families engineers hold: one generic path, a row of data each.

Per family (tiny random configs of the installed transformers, no download): ``encoding="rope"``
reproduces the stock model's logits (its sliding windows, soft-capping, score scale, q/k norms,
fused projections and sinks included), cached generation equals uncached past the window (HF's
own sliding-window cache), ``save_pretrained`` -> ``Auto*.from_pretrained`` round-trips bit for
bit, and a swap to ALiBi trains one ``Trainer`` step on the embedded corpus. The oracle is always
the stock HF model with the same weights. ``scripts/hf_family_table.py`` prints the measured
differences of these checks (the table in docs/hf.md).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from tests.conftest import assert_close, attention_n

transformers = pytest.importorskip("transformers")
from tests.test_hf import TINY_DECODER, greedy  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, DynamicCache  # noqa: E402

import posenc  # noqa: E402
import posenc.hf as ph  # noqa: E402

V = 96
L = 20  # tokens per parity check: past every window below
WINDOW = 6  # HF sliding_window of the windowed families
COMMON = TINY_DECODER | dict(vocab_size=V)  # test_hf.py's tiny decoder at this file's vocabulary
SLIDING_FULL = ["sliding_attention", "full_attention"]


def _text(**kw) -> dict:
    """The text decoder of a vision-language config (no grouped heads beyond COMMON's)."""
    return COMMON | kw


def _configs() -> dict:
    t = transformers
    return {
        "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(**COMMON)),  # q/k/v biases
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(**COMMON, head_dim=16)),  # q/k RMSNorm before RoPE
        "mistral": (t.MistralForCausalLM, t.MistralConfig(**COMMON, sliding_window=WINDOW)),
        "phi3": (  # fused qkv_proj, partial rotary, LongRoPE (short factors up to 16 tokens, long past)
            t.Phi3ForCausalLM,
            t.Phi3Config(
                **COMMON | {"max_position_embeddings": 64},
                original_max_position_embeddings=16,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5,
                    "short_factor": [1.0, 1.5],
                    "long_factor": [2.0, 5.0],
                    "original_max_position_embeddings": 16,
                },
            ),
        ),
        "gemma2": (  # soft-capping, alternating sliding/full layers, query_pre_attn_scalar
            t.Gemma2ForCausalLM,
            t.Gemma2Config(
                **COMMON,
                head_dim=8,
                query_pre_attn_scalar=12,
                sliding_window=WINDOW,
                attn_logit_softcapping=5.0,
                final_logit_softcapping=None,
            ),
        ),
        "gemma3": (  # local/global θ per layer type, q/k norm, query_pre_attn_scalar
            t.Gemma3ForCausalLM,
            t.Gemma3TextConfig(
                **COMMON,
                head_dim=8,
                query_pre_attn_scalar=12,
                sliding_window=WINDOW,
                layer_types=SLIDING_FULL,
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
                },
            ),
        ),
        "gemma4": (  # proportional RoPE on global layers, per-layer head sizes (8 local, 16 global),
            # keys as values on global layers, key/value sharing across layers, per-layer inputs, scaling 1
            t.Gemma4ForCausalLM,
            t.Gemma4TextConfig(
                **COMMON | {"num_hidden_layers": 4},
                head_dim=8,
                global_head_dim=16,
                num_global_key_value_heads=1,
                attention_k_eq_v=True,
                sliding_window=WINDOW,
                layer_types=SLIDING_FULL * 2,
                vocab_size_per_layer_input=V,
                hidden_size_per_layer_input=8,
                num_kv_shared_layers=2,
            ),
        ),
        "gpt_oss": (  # learned sinks, alternating windows, YaRN, biases, MoE
            t.GptOssForCausalLM,
            t.GptOssConfig(
                **COMMON | {"intermediate_size": 32},
                head_dim=8,
                num_local_experts=2,
                num_experts_per_tok=1,
                sliding_window=WINDOW,
                layer_types=SLIDING_FULL,
            ),
        ),
        "qwen2_vl": (  # M-RoPE over HF's 3-row (t, h, w) position ids; the vision tower keeps sdpa
            t.Qwen2VLForConditionalGeneration,
            t.Qwen2VLConfig(
                text_config=_text(
                    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 2]}
                ),
                vision_config=dict(
                    depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=2, temporal_patch_size=1
                ),
            ),
        ),
        "qwen3_vl": (  # interleaved M-RoPE (T, H, W, T, ...)
            t.Qwen3VLForConditionalGeneration,
            t.Qwen3VLConfig(
                text_config=_text(
                    head_dim=8,
                    rope_parameters={
                        "rope_type": "default",
                        "rope_theta": 1e4,
                        "mrope_section": [2, 1, 1],
                        "mrope_interleaved": True,
                    },
                ),
                vision_config=dict(
                    depth=1,
                    hidden_size=16,
                    intermediate_size=32,
                    num_heads=2,
                    out_hidden_size=32,
                    patch_size=2,
                    temporal_patch_size=1,
                    deepstack_visual_indexes=[],
                ),
            ),
        ),
        "modernbert": (  # encoder: bidirectional local (±local_attention/2, inclusive) and global layers
            t.ModernBertForMaskedLM,
            t.ModernBertConfig(
                vocab_size=V,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=64,
                local_attention=8,  # local layers see |i - j| <= 4: 9 keys
                global_attn_every_n_layers=2,
                pad_token_id=0,
                bos_token_id=None,
                eos_token_id=None,
                cls_token_id=None,
                sep_token_id=None,
                initializer_range=0.3,
            ),
        ),
    }


FAMILIES = list(_configs())
VL = ("qwen2_vl", "qwen3_vl")


def stock_model(family: str) -> torch.nn.Module:
    torch.manual_seed(zlib.crc32(family.encode()))  # (str hash() changes per process)
    cls, cfg = _configs()[family]
    model = cls(cfg).eval()
    with torch.no_grad():  # norms, biases and sinks off their ones/zeros init, so a dropped one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


def family_n(cfg, length: int) -> int:
    """Reduction length behind a family's logits (tests/conftest.py): per layer the attention,
    q/k norms (Dh each), the MLP (D, then I) and up to four RMS/LayerNorms (D each); then the final
    norm and the head."""
    cfg = cfg.get_text_config()
    D, I = cfg.hidden_size, cfg.intermediate_size
    per = getattr(cfg, "per_layer_config", None)  # (Gemma 4: head sizes per layer; the widest counts)
    Dh = max(getattr(c, "head_dim", None) or D // cfg.num_attention_heads for c in per or [cfg])
    layer = attention_n(dim=D, length=length, head_dim=Dh) + 2 * Dh + D + I + 4 * D
    return cfg.num_hidden_layers * layer + 3 * D


def logits(model, ids, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **kw).logits


def assert_parity_padded_and_rotation_matters(model, ours, ids, n) -> None:
    """``ours`` (``model`` converted) equals ``model`` on ``ids`` and with the second row left-padded
    by 7 tokens; converted to ``nope`` instead, the logits move (the rotation is what matched)."""
    want = logits(model, ids)
    assert_close(logits(ours, ids), want, n=n)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    kw = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    got, want_padded = logits(ours, ids, **kw), logits(model, ids, **kw)
    assert_close(got[mask.bool()], want_padded[mask.bool()], n=n)
    assert (logits(ph.convert(model, encoding="nope"), ids) - want).abs().max() > 1e-2


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    """(family, stock model, the same model converted with encoding="rope")."""
    stock = stock_model(request.param)
    return request.param, stock, ph.convert(stock, encoding="rope").eval()


def test_rope_reproduces_stock_logits(pair):
    family, stock, ours = pair
    assert type(ours).__name__ == "Posenc" + type(stock).__name__
    assert ours.config.model_type == "posenc_" + stock.config.model_type
    ids = torch.randint(1, V, (2, L))
    assert_close(logits(ours, ids), logits(stock, ids), n=family_n(stock.config, L))
    if family == "phi3":  # LongRoPE's short factors: a call that stays within original_max_position_embeddings
        assert_close(logits(ours, ids[:, :12]), logits(stock, ids[:, :12]), n=family_n(stock.config, 12))
    # left padding: HF's position ids from the attention mask, the padded keys masked
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    kw = dict(attention_mask=mask)
    if family != "modernbert":
        kw["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    got, want = logits(ours, ids, **kw), logits(stock, ids, **kw)
    assert_close(got[mask.bool()], want[mask.bool()], n=family_n(stock.config, L))


def image_positions(batch: int) -> torch.Tensor:
    """HF's ``(3, B, 12)`` M-RoPE position ids of 2 text tokens, a 2 x 3 image at ``t = 2``
    (rows ``h``, columns ``w`` from 2), then 4 text tokens from 5 (as ``get_rope_index`` numbers them)."""
    pos = torch.arange(12).repeat(3, 1)
    pos[0, 2:8] = 2
    pos[1, 2:8] = 2 + torch.tensor([0, 0, 0, 1, 1, 1])
    pos[2, 2:8] = 2 + torch.tensor([0, 1, 2, 0, 1, 2])
    pos[:, 8:] = torch.arange(5, 9)
    return pos[:, None].expand(3, batch, 12)


@pytest.mark.parametrize("encoding", ["rope", "alibi"])
def test_cached_generation_equals_uncached_past_the_window(pair, encoding):
    family, stock, ours = pair
    if family == "modernbert":
        pytest.skip("an encoder: no generation")
    model = ours if encoding == "rope" else ph.convert(stock, encoding=encoding).eval()
    ids = torch.randint(1, V, (2, 5))
    cache = DynamicCache(config=model.config)
    cached, cached_logits = greedy(model, ids, 14, cache=cache)
    uncached, uncached_logits = greedy(model, ids, 14, use_cache=False)
    assert cached.shape == (2, 5 + 14) and torch.equal(cached, uncached)
    assert_close(cached_logits, uncached_logits, n=family_n(model.config, 5 + 14))
    sliding = [type(layer).__name__ == "DynamicSlidingWindowLayer" for layer in cache.layers]
    if family in ("mistral", "gemma2", "gemma3", "gpt_oss"):  # HF's cache kept only what the window sees
        assert any(sliding) and min(layer.keys.shape[2] for layer in cache.layers) == WINDOW - 1
    if encoding == "rope":  # and the stock model generates the same tokens
        want, _ = greedy(stock, ids, 14, cache=DynamicCache(config=stock.config))
        assert torch.equal(cached, want)


def test_save_pretrained_round_trips_bit_for_bit(pair, tmp_path):
    family, stock, _ = pair
    model = ph.convert(stock, encoding="alibi,rope").eval()
    with torch.no_grad():
        for p in model.posenc_stack.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    auto = AutoModelForMaskedLM if family == "modernbert" else AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    assert loaded.config.posenc_layers == model.config.posenc_layers
    ids = torch.randint(1, V, (2, 11))
    assert torch.equal(logits(loaded, ids), logits(model, ids))


def trainer_step(model, tmp_path) -> tuple[float, float]:
    """One HF ``Trainer`` step on the embedded corpus: ``(loss, largest parameter change)``."""
    from transformers import Trainer, TrainingArguments

    from posenc.data import embedded_documents

    docs = [list(d[:24]) for d in embedded_documents()[:8] if len(d) >= 24]
    encoder = not model.config.is_decoder if hasattr(model.config, "is_decoder") else False
    rows = []
    for d in docs:
        ids = [t % V for t in d]
        labels = ids if not encoder else [t if i % 4 == 0 else -100 for i, t in enumerate(ids)]
        rows.append({"input_ids": ids, "labels": labels})
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        logging_steps=1,
    )

    def collate(batch):
        return {k: torch.tensor([r[k] for r in batch]) for k in ("input_ids", "labels")}

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model.train(), args=args, train_dataset=rows, data_collator=collate)
    trainer.train()
    loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    change = max((p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters())
    return loss, change


def test_alibi_swap_trains_one_trainer_step(pair, tmp_path):
    family, stock, _ = pair
    model = ph.convert(stock, encoding="alibi")
    loss, change = trainer_step(model, tmp_path)
    assert 0 < loss < 50 and change > 0  # a finite loss from HF's own loss function, and AdamW moved weights
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("encoding", ["fox", "inkling"])
def test_hidden_state_encodings_in_every_family(pair, encoding):
    """FoX and Inkling read the attention module's hidden states (a pre-hook, posenc.hf.hidden)
    in every family, built for the model's hidden width (Qwen3's and Gemma's heads x head_dim is
    not hidden_size): a forward and backward with left padding that reaches the encoding's
    weights, and (decoders) cached greedy generation equal to uncached. Inkling is causal only:
    refused for ModernBERT in one line; Gemma 4's KV-sharing layers reuse another layer's keys,
    whose hidden states they never see: refused at conversion."""
    family, stock, _ = pair
    if family == "gemma4" and any(getattr(m, "is_kv_shared_layer", False) for m in stock.modules()):
        with pytest.raises(ValueError, match=f"'{encoding}' reads the hidden state of the layer's own keys"):
            ph.convert(stock, encoding=encoding)  # refused when converted, not at the first forward
        return
    if family == "modernbert" and encoding == "inkling":
        with pytest.raises(ValueError, match="'inkling' is causal only, and this layer attends both ways"):
            ph.convert(stock, encoding=encoding)
        return
    model = ph.convert(stock, encoding=encoding)
    ids = torch.randint(1, V, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = model.train()(ids, attention_mask=mask, labels=ids if family != "modernbert" else None)
    loss = out.loss if out.loss is not None else out.logits.square().mean()
    loss.backward()
    encs = [m for m in model.modules() if isinstance(m, posenc.PositionEncoding)]
    assert torch.isfinite(loss) and encs and all(p.grad is not None for e in encs for p in e.parameters())
    if family == "modernbert":
        return  # an encoder: no generation
    model.eval()
    prompt = torch.randint(1, V, (2, 5))
    cached, cached_logits = greedy(model, prompt, 14, cache=DynamicCache(config=model.config))
    uncached, uncached_logits = greedy(model, prompt, 14, use_cache=False)
    assert torch.equal(cached, uncached)
    assert_close(cached_logits, uncached_logits, n=family_n(model.config, 5 + 14))
