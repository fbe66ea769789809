"""RoPE checkpoint layouts through ``posenc.hf``: Meta's interleaved pairs vs HF's split halves.

Oracle: a transcription of Meta's complex-number rotary, and stock HF Llama on the converted
weights. Tiny random configs, no download.
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close
from tests.test_hf import V, llama_config, llama_n, logits

transformers = pytest.importorskip("transformers")
from transformers import LlamaForCausalLM  # noqa: E402

import posenc.hf as ph  # noqa: E402


# ============================================================================ layouts
def _meta_rotate(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Meta's Llama rotary, written out: pairs (x_2k, x_2k+1) as complex numbers times e^{i·p·θ_k}."""
    Dh = x.shape[-1]
    theta = 1.0 / base ** (torch.arange(0, Dh, 2).double() / Dh)
    freqs = torch.polar(torch.ones(len(pos), Dh // 2, dtype=torch.float64), pos.double()[:, None] * theta)
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], Dh // 2, 2))
    return torch.view_as_real(xc * freqs).flatten(-2)


def test_rope_layout_converts_meta_checkpoints_to_hf_and_back():
    cfg = llama_config()
    hf_model = LlamaForCausalLM(cfg).eval()
    hf_state = hf_model.state_dict()
    meta_state = ph.rope_layout(hf_state, cfg, to="interleaved")
    back = ph.rope_layout(meta_state, cfg, to="half")
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    assert not torch.equal(
        meta_state["model.layers.0.self_attn.q_proj.weight"], hf_state["model.layers.0.self_attn.q_proj.weight"]
    )
    # Meta's rotation on the interleaved weights gives HF's scores on the half-split ones
    x = torch.randn(10, cfg.hidden_size, dtype=torch.float64)
    pos = torch.arange(10)
    Dh, H, KV = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    wq, wk = (meta_state[f"model.layers.0.self_attn.{n}_proj.weight"].double() for n in "qk")
    q = _meta_rotate((x @ wq.T).view(10, H, Dh).transpose(0, 1), pos)
    k = _meta_rotate((x @ wk.T).view(10, KV, Dh).transpose(0, 1), pos).repeat_interleave(H // KV, 0)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = hf_model.model.rotary_emb(x.float(), pos[None])
    hq = (x.float() @ hf_state["model.layers.0.self_attn.q_proj.weight"].T).view(1, 10, H, Dh).transpose(1, 2)
    hk = (x.float() @ hf_state["model.layers.0.self_attn.k_proj.weight"].T).view(1, 10, KV, Dh).transpose(1, 2)
    hq, hk = apply_rotary_pos_emb(hq, hk, cos, sin)
    hk = hk.repeat_interleave(H // KV, 1)
    assert_close((hq @ hk.transpose(-1, -2))[0], (q @ k.transpose(-1, -2)).float(), n=cfg.hidden_size + Dh)
    # whole models: posenc's interleaved layout on Meta's weights equals stock HF on HF's
    meta_model = LlamaForCausalLM(cfg)
    meta_model.load_state_dict(meta_state)
    ours = ph.convert(meta_model, encoding="rope", layout="interleaved").eval()
    ids = torch.randint(0, V, (2, 24))
    assert_close(logits(ours, ids), logits(hf_model, ids), n=llama_n(cfg, 24))
