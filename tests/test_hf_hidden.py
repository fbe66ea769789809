"""Encodings that read the layer's hidden state (FoX, Inkling: ``read_input``) through ``posenc.hf``.

A forward pre-hook hands the attention function the module's hidden states
(:mod:`posenc.hf.hidden`); cached generation and packed documents are covered with every other
encoding in tests/test_hf.py and tests/test_hf_train.py. Oracle here: posenc's own
``Attention`` with the same weights and encoding instance (the adapter's plumbing; the
encodings themselves are checked against their papers in tests/test_fox.py, tests/test_inkling.py).
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close, attention_n
from tests.test_hf import HIDDEN_STATE, V, _generate, llama_config, perturb

transformers = pytest.importorskip("transformers")
from transformers import LlamaForCausalLM  # noqa: E402

import posenc  # noqa: E402
import posenc.hf as ph  # noqa: E402


@pytest.mark.parametrize("name", HIDDEN_STATE)
def test_hidden_state_encodings_run_as_posenc_attention_runs_them(name):
    """A converted layer with FoX/Inkling (read_input on the module's hidden states, captured by a
    pre-hook) gives what posenc's own Attention gives with the same weights and encoding, with
    left padding too; a static cache is refused (the encoding reads every key's hidden state)."""
    assert {"fox", "inkling"} <= set(HIDDEN_STATE)
    model = ph.convert(LlamaForCausalLM(llama_config()), encoding=name).eval()
    perturb(model)
    attn, enc = model.model.layers[0].self_attn, model.model.posenc.encoding(0)
    ours = posenc.Attention(32, 4, enc, kv_heads=2, head_dim=8, backend="eager").eval()
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(ours, n).load_state_dict(getattr(attn, n).state_dict())
    x, pos = torch.randn(2, 10, 32), torch.arange(10)[None]
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :3] = False
    with torch.no_grad():
        cos_sin = model.model.rotary_emb(x, pos)
        got = attn(x, position_embeddings=cos_sin, attention_mask=ph.PosencMask(2, 10, 10, 0, mask))[0]
        want = ours(x, pos.expand(2, -1), key_padding_mask=mask)
    assert_close(got[mask], want[mask], n=attention_n(dim=32, length=10, head_dim=8))
    with pytest.raises(ValueError, match=f"encoding '{name}' reads the hidden state of every key"):
        _generate(model, torch.randint(1, V, (1, 4)), cache_implementation="static")
