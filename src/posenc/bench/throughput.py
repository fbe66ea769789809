"""Whole-model training throughput: tokens per second of :class:`~posenc.TransformerLM`
per encoding, against x-transformers' ``TransformerWrapper`` configured the same way
(same width, depth, heads, pre-norm LayerNorm blocks, GELU MLP ×4, tied embeddings,
AdamW, causal LM loss) where x-transformers has the encoding:

=============  ===================================================
posenc         x-transformers
=============  ===================================================
``nope``       ``use_abs_pos_emb=False``
``learned``    ``use_abs_pos_emb=True`` (learned absolute)
``sinusoidal`` ``scaled_sinu_pos_emb=True`` (sinusoid × one learned scalar)
``rope``       ``rotary_pos_emb=True``
``xpos``       ``rotary_xpos=True``
``alibi``      ``alibi_pos_bias=True``
``t5``         ``rel_pos_bias=True``
=============  ===================================================

x-transformers uses ``attn_flash=True`` (SDPA) except with ``rel_pos_bias``, which it
refuses on that path. With ``complex-order`` among the encodings, the paper's
complex-valued model (:class:`~posenc.complex_model.ComplexTransformerLM`,
``dim/2`` complex features, the same real width) is measured too, as ``complex-model``.
With ``packed``, every posenc model is also trained on packed documents (impl
``posenc-packed``: the same windows with ``document_ids``, documents of mean length
``seq_len/4`` at seeded boundaries), the cost of document masking in a training step.
With ``hf``, a stock HF ``LlamaForCausalLM`` (``sdpa``) of the same size and
:func:`posenc.hf.convert` copies of it with each encoding take the same steps (impl
``hf-llama``; encoding ``stock`` for the unconverted model).
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from ..complex_model import ComplexTransformerLM
from ..data import Batch
from ..model import TransformerLM
from ..train import Trainer
from .measure import median, time_runs

__all__ = ["ThroughputConfig", "run_throughput", "packed_documents", "XT_OPTIONS"]

XT_OPTIONS: dict[str, dict] = {
    "nope": {},
    "learned": {"use_abs_pos_emb": True},
    "sinusoidal": {"scaled_sinu_pos_emb": True},
    "rope": {"rotary_pos_emb": True},
    "xpos": {"rotary_xpos": True},
    "alibi": {"alibi_pos_bias": True},
    "t5": {"rel_pos_bias": True},
}


@dataclass
class ThroughputConfig:
    encodings: list[str]
    seq_len: int = 256
    batch: int = 8
    vocab: int = 256
    dim: int = 256
    depth: int = 4
    heads: int = 4
    device: str = "cpu"
    warmup: int = 1
    repeats: int = 3
    packed: bool = False
    hf: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        counts = dict(seq_len=self.seq_len, batch=self.batch, vocab=self.vocab, dim=self.dim, depth=self.depth,
                      heads=self.heads, repeats=self.repeats)  # fmt: skip
        for name, v in counts.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        if self.hf and importlib.util.find_spec("transformers") is None:
            raise ValueError("hf=True times HF Llama: it needs the 'transformers' package, which is not installed")


@dataclass
class ThroughputRow:
    impl: str
    encoding: str
    tokens_per_s: float | None
    step_s: float | None
    params: int | None
    status: str = "ok"


def _xt_model(enc: str, cfg: ThroughputConfig) -> nn.Module:
    from x_transformers import Decoder, TransformerWrapper

    opts = dict(XT_OPTIONS[enc])
    abs_pos = opts.pop("use_abs_pos_emb", False)
    wrapper_opts = {}
    if opts.pop("scaled_sinu_pos_emb", False):
        wrapper_opts["scaled_sinu_pos_emb"] = True
        abs_pos = True
    return TransformerWrapper(
        num_tokens=cfg.vocab,
        max_seq_len=cfg.seq_len,
        use_abs_pos_emb=abs_pos,
        tie_embedding=True,
        attn_layers=Decoder(dim=cfg.dim, depth=cfg.depth, heads=cfg.heads, attn_flash=enc != "t5", ff_mult=4, **opts),
        **wrapper_opts,
    )


def _train_step(model: nn.Module, opt, tokens, documents=None):
    """One training step of posenc's trainer (causal LM loss, AdamW) on fixed ``tokens`` ``(B, L+1)``
    (``documents``: ``(B, L)`` document ids of packed sequences, or None)."""
    trainer, batch = Trainer(model, opt), Batch(tokens[:, :-1], tokens[:, 1:], None, documents=documents)
    return lambda: trainer.step(batch)


def packed_documents(batch: int, seq_len: int, seed: int = 0) -> Tensor:
    """``(B, L)`` int64 document ids: a document starts at each position with probability
    ``4/L`` (mean length ``L/4``), the same layout for a given seed."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq_len, generator=g) < 4 / seq_len
    starts[:, 0] = False
    return starts.long().cumsum(1)


def _measure(model: nn.Module, cfg: ThroughputConfig, device, packed: bool = False) -> tuple[float, float]:
    g = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1), generator=g).to(device)
    docs = packed_documents(cfg.batch, cfg.seq_len, cfg.seed).to(device) if packed else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = _train_step(model, opt, tokens, docs)
    times = time_runs(step, device=device, warmup=cfg.warmup, repeats=cfg.repeats)
    t = median(times)
    return cfg.batch * cfg.seq_len / t, t


def _hf_step(model: nn.Module, ids: Tensor):
    """One AdamW step of an HF causal LM on ``ids`` ``(B, L)`` (its own shifted loss)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _hf_rows(cfg: ThroughputConfig, device, progress=None) -> list[ThroughputRow]:
    """Stock HF Llama and its posenc conversions, the same steps (see the module docstring)."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from ..hf import convert

    torch.manual_seed(cfg.seed)
    conf = LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.dim,
        intermediate_size=2 * cfg.dim,
        num_hidden_layers=cfg.depth,
        num_attention_heads=cfg.heads,
        max_position_embeddings=cfg.seq_len,
    )
    stock = LlamaForCausalLM(conf)
    g = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len), generator=g).to(device)
    rows = []
    for enc in ["stock", *cfg.encodings]:
        if progress:
            progress(f"train hf-llama:{enc}")
        try:
            model = stock if enc == "stock" else convert(copy.deepcopy(stock), encoding=enc)
        except (ValueError, TypeError) as e:  # an encoding posenc.hf refuses: said, not an error
            rows.append(ThroughputRow("hf-llama", enc, None, None, None, status=f"skipped: {e}"[:250]))
            continue
        try:
            model = model.to(device)
            t = median(time_runs(_hf_step(model, ids), device=device, warmup=cfg.warmup, repeats=cfg.repeats))
            n = sum(p.numel() for p in model.parameters())
            rows.append(ThroughputRow("hf-llama", enc, cfg.batch * cfg.seq_len / t, t, n))
        except Exception as e:
            rows.append(
                ThroughputRow("hf-llama", enc, None, None, None, status=f"error: {type(e).__name__}: {e}"[:250])
            )
    return rows


def run_throughput(cfg: ThroughputConfig, progress=None) -> list[dict]:
    device = torch.device(cfg.device)
    has_xt = importlib.util.find_spec("x_transformers") is not None
    rows: list[ThroughputRow] = []
    names = list(cfg.encodings) + (["complex-model"] if "complex-order" in cfg.encodings else [])
    for enc in names:
        impls = ["posenc"]
        if cfg.packed and enc != "complex-model":
            impls.append("posenc-packed")
        if has_xt and enc in XT_OPTIONS:
            impls.append("x-transformers")
        for impl in impls:
            if progress:
                progress(f"train {impl}:{enc}")
            try:
                torch.manual_seed(cfg.seed)
                if enc == "complex-model":
                    model = ComplexTransformerLM(cfg.vocab, cfg.dim // 2, cfg.depth, cfg.heads).to(device)
                elif impl.startswith("posenc"):
                    model = TransformerLM(
                        cfg.vocab, cfg.dim, cfg.depth, cfg.heads, encoding=enc, max_len=cfg.seq_len
                    ).to(device)
                else:
                    model = _xt_model(enc, cfg).to(device)
                tps, t = _measure(model, cfg, device, packed=impl == "posenc-packed")
                n = sum(p.numel() for p in model.parameters())
                rows.append(ThroughputRow(impl, enc, tps, t, n))
            except Exception as e:
                rows.append(ThroughputRow(impl, enc, None, None, None, status=f"error: {type(e).__name__}: {e}"[:250]))
    if cfg.hf and importlib.util.find_spec("transformers") is not None:
        rows += _hf_rows(cfg, device, progress)
    return [asdict(r) for r in rows]
