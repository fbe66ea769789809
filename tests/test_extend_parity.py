"""``posenc extend``'s methods on an HF model are exact (issue 27 item 3).

* posenc's linear / ntk / dynamic / yarn, set by :func:`posenc.extend.methods.method_options`
  on a converted stock Llama, equal stock ``LlamaForCausalLM`` with HF's own
  ``rope_parameters`` set to that method (HF computes its frequencies itself);
* within the window, the methods that should not change the model do not;
* ReRoPE / Leaky ReRoPE / Self-Extend / DCA with chunked prefill on HF's cache equal their
  full forward, past the training length;
* sink-window (HF, block eviction) equals the full forward while nothing is evicted, and
  differs once something is.
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close, attention_n

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import posenc.hf as ph  # noqa: E402
from posenc.extend.evaluate import token_scores  # noqa: E402
from posenc.extend.methods import method_options  # noqa: E402
from posenc.extend.model import Subject, _rope_facts  # noqa: E402

V, L = 64, 32  # vocabulary; training length (max_position_embeddings)


def config(**kw) -> LlamaConfig:
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=L, bos_token_id=None, eos_token_id=None,
                pad_token_id=None, initializer_range=0.3,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    return LlamaConfig(**(base | kw))


def n_of(cfg, length: int) -> int:
    """Reduction length behind a Llama's logits (as tests/test_hf.py's llama_n)."""
    D, I = cfg.hidden_size, cfg.intermediate_size
    layer = attention_n(dim=D, length=length, head_dim=cfg.head_dim) + D + I + 2 * D
    return cfg.num_hidden_layers * layer + 2 * D


def subject(stock) -> Subject:
    model = ph.convert(stock, encoding="rope").eval()
    specs = [dict(s) for s in model.config.posenc_layers]
    return Subject("hf", model, L, V, "test", None, specs, _rope_facts(specs, model.posenc_stack.dims.head_dim))


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def hf_parameters(method: str, longest: int) -> dict:
    """The same method as HF's own ``rope_parameters`` (written from HF's documentation of
    each ``rope_type``, not from posenc's options)."""
    s = longest / L
    dim = 32 // 4
    return {
        "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": s},
        "ntk": {"rope_type": "default", "rope_theta": 10000.0 * s ** (dim / (dim - 2))},  # bloc97's base change
        "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 1.0},
        "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": s, "original_max_position_embeddings": L},
    }[method]


@pytest.mark.parametrize("method", ["linear", "ntk", "dynamic", "yarn"])
def test_method_equals_stock_llama_with_hf_rope_parameters(method):
    torch.manual_seed(0)
    longest = 4 * L
    stock = LlamaForCausalLM(config()).eval()
    model, opts, why = subject(stock).variant(method, longest)
    assert why is None and opts == method_options(method, train_tokens=L, longest_tokens=longest,
                                                  base=10000.0, rotary_dim=8)  # fmt: skip
    cfg = config(rope_parameters=hf_parameters(method, longest))
    if method == "yarn":  # HF's yarn reads the training length from max_position_embeddings too
        cfg.max_position_embeddings = longest
    reference = LlamaForCausalLM(cfg).eval()
    reference.load_state_dict(stock.state_dict())
    ids = torch.randint(0, V, (1, 3 * L))  # past the training length: the methods differ from plain RoPE
    want = logits(reference, ids)
    assert_close(logits(model, ids), want, n=n_of(cfg, 3 * L))
    assert not torch.allclose(logits(subject(stock).model, ids), want, atol=1e-3)  # the method matters here


@pytest.mark.parametrize("method", ["dynamic", "rerope", "leaky-rerope", "self-extend"])
def test_methods_leave_the_model_unchanged_within_their_window(method):
    torch.manual_seed(1)
    stock = LlamaForCausalLM(config()).eval()
    sub = subject(stock)
    model, opts, _ = sub.variant(method, 8 * L)
    window = opts["rope_extension"]["window"] if "rope_extension" in opts else L
    ids = torch.randint(0, V, (2, window))  # ReRoPE / Self-Extend: window >= length
    assert_close(logits(model, ids), logits(sub.model, ids), n=n_of(stock.config, window))
    longer = torch.randint(0, V, (1, 4 * L))
    assert not torch.allclose(logits(model, longer), logits(sub.model, longer), atol=1e-3)


@pytest.mark.parametrize("method", ["rerope", "leaky-rerope", "self-extend", "dca", "none", "yarn"])
def test_chunked_prefill_equals_full_forward(method):
    torch.manual_seed(2)
    stock = LlamaForCausalLM(config()).eval()
    model, _, _ = subject(stock).variant(method, 4 * L)
    ids = torch.randint(0, V, (4 * L,))
    full = torch.log_softmax(logits(model, ids[None])[0, :-1].double(), -1)
    want = -full.gather(-1, ids[1:, None])[:, 0]
    for chunk in (1, 7, 40):  # one token at a time (decoding), and uneven prefill chunks
        nll, pred, kv = token_scores("hf", model, ids, chunk=chunk)
        assert_close(nll, want, n=n_of(stock.config, 4 * L), magnitude=float(want.abs().max()), dtype=torch.float32)
        assert torch.equal(pred, full.argmax(-1)) or chunk == 1  # argmax ties aside
        # layers · (k, v) · kv heads · tokens · head_dim · 4 bytes (a cache holding rotated keys keeps
        # no flag tensor while its rows are known finite: posenc.hf.keys)
        assert kv == 2 * 2 * 2 * (4 * L) * 8 * 4


def test_sink_window_equals_full_forward_until_it_evicts():
    torch.manual_seed(3)
    stock = LlamaForCausalLM(config()).eval()
    sub = subject(stock)
    model, opts, _ = sub.variant("sink-window", 4 * L)
    assert opts == {"sinks": 4, "window": L - 4}
    ids = torch.randint(0, V, (4 * L,))
    full, _, _ = token_scores("hf", sub.model, ids, chunk=4 * L)
    sink, _, kv = token_scores("hf", model, ids, chunk=4 * L, sink=opts)
    inside = L - 1  # targets predicted from at most sinks + window = L tokens
    assert_close(
        sink[:inside], full[:inside], n=n_of(stock.config, L), magnitude=float(full.abs().max()), dtype=torch.float32
    )
    assert not torch.allclose(sink[L:], full[L:], atol=1e-3)
    assert kv <= 2 * 2 * 2 * L * 8 * 4  # the cache never holds more than sinks + window tokens


def test_extension_of_a_model_that_already_scales_its_rope():
    # a checkpoint with linear scaling of its own: the scalings replace it, ReRoPE (defined on plain RoPE) is n/a
    stock = LlamaForCausalLM(config(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}))
    sub = subject(stock.eval())
    model, opts, why = sub.variant("rerope", 4 * L)
    assert model is None and "rope_scaling" in why
    model, opts, why = sub.variant("yarn", 4 * L)
    assert why is None and model.posenc_stack.encoding(0).rope_type == "yarn"
