"""Silent failures of RoPE ports, each checked against HF's own code (issue 66).

* YaRN's attention factor in its three branches: an explicit ``attention_factor`` wins over the
  ``mscale``/``mscale_all_dim`` pair; the pair gives ``get_mscale(f, mscale) / get_mscale(f,
  mscale_all_dim)`` (exactly 1 when the two are equal); ``factor`` alone gives
  ``0.1·ln(f) + 1`` — against ``transformers.modeling_rope_utils._compute_yarn_parameters``.
* Dynamic NTK at a served length below the trained one: the base stays the trained base (HF:
  ``seq_len = max(seq_len, max_position_embeddings)``), never a smaller or negative one; a
  converted model at such a length equals the stock one.
* A converted model whose ``_attn_implementation`` another tool replaced raises at its first
  forward instead of running with its own encoding switched off.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import assert_close

transformers = pytest.importorskip("transformers")
from tests.test_hf import TINY_DECODER  # noqa: E402
from tests.test_hf_families import family_n  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.modeling_rope_utils import (  # noqa: E402
    _compute_dynamic_ntk_parameters,
    _compute_yarn_parameters,
)

import posenc  # noqa: E402
import posenc.hf as ph  # noqa: E402

HEAD_DIM, MAX_POS = 16, 64
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 8}


def _config(params: dict, **kw) -> LlamaConfig:
    return LlamaConfig(
        **(TINY_DECODER | {"head_dim": HEAD_DIM, "max_position_embeddings": MAX_POS} | kw), rope_parameters=dict(params)
    )


def _ours(params: dict):
    return posenc.build(
        "rope",
        heads=4,
        head_dim=HEAD_DIM,
        max_len=MAX_POS,
        base=params["rope_theta"],
        rope_scaling={k: v for k, v in params.items() if k != "rope_theta"},
    )


@pytest.mark.parametrize(
    "extra,expected",
    [
        ({"attention_factor": 1.3, "mscale": 0.707, "mscale_all_dim": 1.0}, 1.3),  # explicit wins over the pair
        ({"attention_factor": 1.0}, 1.0),  # explicit 1 (Mistral Large 4): not replaced by the factor's 1.208
        ({"mscale": 0.707, "mscale_all_dim": 1.0}, (0.1 * 0.707 * math.log(8) + 1) / (0.1 * math.log(8) + 1)),
        ({"mscale": 1.0, "mscale_all_dim": 1.0}, 1.0),  # the pair equal: exactly 1 (DeepSeek-V3's)
        ({}, 0.1 * math.log(8) + 1),  # factor only
    ],
)
def test_yarn_attention_factor_branches_equal_hf(extra, expected):
    params = YARN | extra
    ref_freq, ref_factor = _compute_yarn_parameters(_config(params), "cpu")
    enc = _ours(params)
    assert ref_factor == pytest.approx(expected, rel=1e-12)
    assert enc.attention_factor == ref_factor
    assert torch.equal(enc.inv_freq, ref_freq)


@pytest.mark.parametrize("seq_len", [1, 5, MAX_POS // 2, MAX_POS - 1])
def test_dynamic_ntk_below_trained_length_keeps_the_base(seq_len):
    params = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    ref, _ = _compute_dynamic_ntk_parameters(_config(params), "cpu", seq_len=seq_len)
    got = _ours(params).frequencies(seq_len)
    assert torch.isfinite(got).all() and (got > 0).all()
    assert torch.equal(got, ref)
    trained = posenc.build("rope", heads=4, head_dim=HEAD_DIM, base=10000.0).inv_freq
    assert torch.equal(got, trained)  # below the trained length: the trained frequencies


def test_dynamic_ntk_converted_model_below_trained_length_equals_stock():
    torch.manual_seed(0)
    stock = LlamaForCausalLM(_config({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})).eval()
    ours = ph.convert(stock).eval()
    for length in (3, 12):
        ids = torch.randint(1, TINY_DECODER["vocab_size"], (2, length))
        with torch.no_grad():
            want, got = stock(ids).logits, ours(ids).logits
        assert torch.isfinite(got).all()
        assert_close(got, want, n=family_n(stock.config, length))


@pytest.mark.parametrize("other", ["sdpa", "eager"])
def test_replaced_attn_implementation_raises_at_first_forward(other):
    stock = LlamaForCausalLM(_config({"rope_type": "default", "rope_theta": 10000.0})).eval()
    ours = ph.convert(stock).eval()
    ids = torch.randint(1, TINY_DECODER["vocab_size"], (1, 6))
    ours(ids)  # as converted: runs
    ours.config._attn_implementation = other  # what a training framework may do after conversion
    with pytest.raises(ValueError, match=f"attn_implementation is '{other}'.*set_attn_implementation"):
        ours(ids)
    ours.set_attn_implementation("posenc")
    ours(ids)
    ours.set_attn_implementation(other)  # HF's own setter: refused the same way
    with pytest.raises(ValueError, match=f"attn_implementation is '{other}'"):
        ours.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
