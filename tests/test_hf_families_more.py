"""``posenc.hf`` beyond the per-family matrix: Qwen2-VL/Qwen3-VL multimodal positions, HF's
per-layer score scales, and loading a converted model in a client that never imports posenc.

Oracles: stock HF models with the same weights (tiny random configs, no download); for the
cached decoding step, the uncached forward over every token.
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close, attention_n
from tests.test_hf import gpt2_config
from tests.test_hf_families import VL, V, family_n, image_positions, logits, stock_model

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, GPT2LMHeadModel  # noqa: E402

import posenc.hf as ph  # noqa: E402


@pytest.mark.parametrize("family", VL)
def test_vl_three_row_position_ids_reach_mrope(family):
    """Qwen2-VL / Qwen3-VL: HF's (t, h, w) rows go to posenc's (interleaved) M-RoPE, not a 1-D rotation."""
    stock = stock_model(family)
    ours = ph.convert(stock).eval()  # the config's own scheme: mrope with its sections
    assert ours.config.posenc_layers[0]["encoding"] == "mrope"
    ids, pos = torch.randint(1, V, (2, 12)), image_positions(2)
    want = logits(stock, ids, position_ids=pos)
    assert_close(logits(ours, ids, position_ids=pos), want, n=family_n(stock.config, 12))
    assert (logits(stock, ids) - want).abs().max() > 1e-3  # the image rows change the logits


@pytest.mark.parametrize("encoding", [None, "alibi"])
@pytest.mark.parametrize("family", VL)
def test_vl_decoding_step_after_an_image_equals_the_full_forward(family, encoding):
    """Cached keys of image tokens keep their (t, h, w) positions (posenc.hf.history): a decoding
    step after an image prompt equals the uncached forward over all tokens (and stock HF's step)."""
    stock = stock_model(family)
    ours = ph.convert(stock, encoding=encoding).eval()
    ids = torch.randint(1, V, (2, 13))
    pos = torch.cat([image_positions(2), torch.full((3, 2, 1), 9)], -1)
    with torch.no_grad():
        full = ours(ids, position_ids=pos).logits[:, -1]
        cache = DynamicCache(config=ours.config)
        ours(ids[:, :12], position_ids=pos[..., :12], cache=cache)
        step = ours(ids[:, 12:], position_ids=pos[..., 12:], cache=cache).logits[:, -1]
    assert_close(step, full, n=family_n(stock.config, 13))
    if encoding is None:
        assert_close(step, logits(stock, ids, position_ids=pos)[:, -1], n=family_n(stock.config, 13))


def test_gpt2_scores_scaled_by_inverse_layer_index_equal_stock_gpt2():
    """HF's per-layer score scale (``scale_attn_by_inverse_layer_idx``) becomes each layer's
    ``score_scale`` (``PositionEncoding.set_scores``)."""
    cfg = gpt2_config(scale_attn_by_inverse_layer_idx=True)
    stock = GPT2LMHeadModel(cfg).eval()
    ours = ph.convert(stock, encoding=["learned", "nope"])
    assert ours.transformer.posenc.encoding(1).score_scale == pytest.approx(8**-0.5 / 2)
    ids = torch.randint(0, V, (2, 20))
    D = cfg.n_embd
    n = cfg.n_layer * (attention_n(dim=D, length=20) + 5 * D + 2 * D) + 2 * D
    assert_close(logits(ours, ids), logits(stock, ids), n=n)


def test_a_client_that_never_imports_posenc_loads_the_model(tmp_path, one_thread):
    """HF's auto_map: ``trust_remote_code=True`` in a fresh process with no ``import posenc``."""
    import json
    import os
    import subprocess
    import sys

    model = ph.convert(stock_model("qwen3"), encoding=["alibi", "rope"]).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"]["AutoModelForCausalLM"] == "posenc_remote.PosencQwen3ForCausalLM"
    ids = torch.randint(1, V, (1, 9))
    torch.save(ids, tmp_path / "ids.pt")
    torch.save(logits(model, ids), tmp_path / "want.pt")
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"d = {str(tmp_path)!r}\n"
        "try:\n"  # without trust_remote_code, a client that does not import posenc is told what is needed
        "    AutoModelForCausalLM.from_pretrained(d)\n"
        "except ValueError as e:\n"
        "    print('RESULT refused', 'trust_remote_code' in str(e), 'posenc' in sys.modules)\n"
        "torch.set_num_threads(1)\n"  # as the parent computed want.pt: sums ordered alike, bit for bit
        "m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()\n"
        "ids = torch.load(d + '/ids.pt', weights_only=True)\n"
        "with torch.no_grad():\n"
        "    got = m(ids).logits\n"
        "print('RESULT', type(m).__name__, bool(torch.equal(got, torch.load(d + '/want.pt', weights_only=True))))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "mods")}
    run = dict(capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    out = subprocess.run([sys.executable, "-c", code], **run)
    assert out.returncode == 0, out.stderr[-2000:]
    results = [line.split() for line in out.stdout.split("RESULT ")[1:]]  # (HF prompts on stdout first)
    assert results == [["refused", "True", "False"], ["PosencQwen3ForCausalLM", "True"]], out.stdout[-2000:]


# ============================================================================ q/k norms after RoPE
NORMS_AFTER = {  # model type -> (LM class, config class): rotate, then query_layernorm / key_layernorm
    "hunyuan_v1_dense": ("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config"),
    "hunyuan_v1_moe": ("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config"),
}


# a tiny decoder of the families below (no special tokens: the tests' ids use the whole vocabulary)
_TINY = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.3,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)


def _norms_after_stock(model_type: str) -> torch.nn.Module:
    lm, cfg = NORMS_AFTER[model_type]
    fields = _TINY | dict(head_dim=8, num_experts=2, moe_topk=1)
    known = set(getattr(transformers, cfg)().to_dict())
    torch.manual_seed(3)
    model = getattr(transformers, lm)(getattr(transformers, cfg)(**{k: v for k, v in fields.items() if k in known}))
    with torch.no_grad():  # the q/k norms' weights off their ones init: where they run shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("model_type", list(NORMS_AFTER))
def test_qk_norms_after_rope_run_after_posencs_rotation(model_type, monkeypatch):
    """HunYuan normalises q and k after its RoPE: the row's ``norms_after`` runs them after posenc's
    rotation (stock logits; cached decoding with rotated, normed keys in HF's cache, and with raw ones
    under dynamic NTK, equals uncached). Without it (norms before the rotation) the logits move."""
    import dataclasses

    from tests.test_hf import greedy

    from posenc.hf import models
    from posenc.hf.families import FAMILIES

    stock = _norms_after_stock(model_type)
    ids = torch.randint(1, V, (2, 16))
    n = family_n(stock.config, 16)
    want = logits(stock, ids)
    ours = ph.convert(stock).eval()
    assert_close(logits(ours, ids), want, n=n)
    prompt = ids[:, :5]
    dynamic = {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}  # (needs raw keys: the exact path)
    for encoding, options in ((None, {}), ("rope", dynamic)):
        model = ph.convert(stock, encoding=encoding, **options).eval()
        assert model.posenc_stack.encoding(0).needs.raw_keys == bool(options)
        cached, cached_logits = greedy(model, prompt, 8, cache=DynamicCache(config=model.config))
        uncached, uncached_logits = greedy(model, prompt, 8, use_cache=False)
        assert torch.equal(cached, uncached), encoding
        assert_close(cached_logits, uncached_logits, n=family_n(stock.config, 13), msg=str(encoding))
        if encoding is None:
            assert torch.equal(cached, greedy(stock, prompt, 8)[0])
    monkeypatch.setitem(FAMILIES, model_type, dataclasses.replace(FAMILIES[model_type], norms_after=()))
    monkeypatch.delitem(models._CLASSES, model_type, raising=False)
    assert (logits(ph.convert(stock), ids) - want).abs().max() > 1e-2


def test_falcon_h1_round_trip_rebuilds_the_mambas_non_persistent_buffer(tmp_path):
    """Falcon-H1's Mamba mixers scale their projections by ``mup_vector``, a non-persistent buffer only
    the stock ``_init_weights`` computes (on the base model, which has no parameters of its own): the
    converted model, loaded back, rebuilds it as the stock one does and gives the same logits."""
    from transformers import AutoModelForCausalLM

    cfg = transformers.FalconH1Config(**_TINY | dict(head_dim=8, ssm_multipliers=[0.5, 2.0, 0.25, 1.5, 3.0]))
    torch.manual_seed(1)
    stock = transformers.FalconH1ForCausalLM(cfg).eval()
    ours = ph.convert(stock).eval()
    ids = torch.randint(1, V, (2, 12))
    assert_close(logits(ours, ids), logits(stock, ids), n=family_n(stock.config, 12))
    ours.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    want = stock.model.layers[0].mamba.mup_vector
    assert not torch.equal(want, torch.ones_like(want))
    assert torch.equal(back.model.layers[1].mamba.mup_vector, stock.model.layers[1].mamba.mup_vector)
    assert torch.equal(logits(back, ids), logits(ours, ids))


def _mirrored_rotate_half(x):  # nanochat's (modeling_nanochat.py): cat(x2, -x1), the angle -iθ
    return torch.cat((x[..., x.shape[-1] // 2 :], -x[..., : x.shape[-1] // 2]), dim=-1)


def test_nanochat_mirrored_rope_and_norms_after():
    """nanochat turns each pair the other way and normalises q/k after: its row (``mirrored``,
    ``norms_after``) gives stock logits and cached = uncached greedy tokens equal to stock's."""
    from tests.test_hf import greedy

    cfg = transformers.NanoChatConfig(**_TINY)
    torch.manual_seed(2)
    stock = transformers.NanoChatForCausalLM(cfg).eval()
    ours = ph.convert(stock).eval()
    ids = torch.randint(1, V, (2, 16))
    assert_close(logits(ours, ids), logits(stock, ids), n=family_n(stock.config, 16))
    prompt = ids[:, :5]
    cached, cached_logits = greedy(ours, prompt, 8, cache=DynamicCache(config=ours.config))
    uncached, _ = greedy(ours, prompt, 8, use_cache=False)
    assert torch.equal(cached, uncached) and torch.equal(cached, greedy(stock, prompt, 8)[0])


def test_mirrored_rope_swaps_back_before_weighted_norms(monkeypatch):
    """A HunYuan model whose ``rotate_half`` is nanochat's (mirrored) and whose q/k norms carry
    weights: a row with ``mirrored`` and ``norms_after`` gives its logits (the halves are swapped
    back before the norms); the row without ``mirrored`` does not."""
    import dataclasses

    from transformers.models.hunyuan_v1_dense import modeling_hunyuan_v1_dense as hy

    from posenc.hf import models
    from posenc.hf.families import FAMILIES

    stock = _norms_after_stock("hunyuan_v1_dense")
    ids = torch.randint(1, V, (2, 16))
    plain = ph.convert(stock).eval()
    monkeypatch.setattr(hy, "rotate_half", _mirrored_rotate_half)
    want = logits(stock, ids)
    assert (logits(plain, ids) - want).abs().max() > 1e-2
    monkeypatch.setitem(FAMILIES, "hunyuan_v1_dense", dataclasses.replace(FAMILIES["hunyuan_v1_dense"], mirrored=True))
    monkeypatch.delitem(models._CLASSES, "hunyuan_v1_dense", raising=False)
    assert_close(logits(ph.convert(stock).eval(), ids), want, n=family_n(stock.config, 16))
