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
complex-valued model (:class:`~posenc.encodings.complex_model.ComplexTransformerLM`,
``dim/2`` complex features, the same real width) is measured too, as ``complex-model``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..data import Batch
from ..encodings.complex_model import ComplexTransformerLM
from ..model import TransformerLM
from ..train import Trainer
from .measure import median, time_runs

__all__ = ["ThroughputConfig", "run_throughput", "XT_OPTIONS"]

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
    seed: int = 0


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


def _train_step(model: nn.Module, opt, tokens):
    """One training step of posenc's trainer (causal LM loss, AdamW) on fixed ``tokens`` ``(B, L+1)``."""
    trainer, batch = Trainer(model, opt), Batch(tokens[:, :-1], tokens[:, 1:], None)
    return lambda: trainer.step(batch)


def _measure(model: nn.Module, cfg: ThroughputConfig, device) -> tuple[float, float]:
    g = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1), generator=g).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = time_runs(_train_step(model, opt, tokens), device=device, warmup=cfg.warmup, repeats=cfg.repeats)
    t = median(times)
    return cfg.batch * cfg.seq_len / t, t


def run_throughput(cfg: ThroughputConfig, progress=None) -> list[dict]:
    device = torch.device(cfg.device)
    has_xt = importlib.util.find_spec("x_transformers") is not None
    rows: list[ThroughputRow] = []
    names = list(cfg.encodings) + (["complex-model"] if "complex-order" in cfg.encodings else [])
    for enc in names:
        impls = [("posenc", None)]
        if has_xt and enc in XT_OPTIONS:
            impls.append(("x-transformers", None))
        for impl, _ in impls:
            if progress:
                progress(f"train {impl}:{enc}")
            try:
                torch.manual_seed(cfg.seed)
                if enc == "complex-model":
                    model = ComplexTransformerLM(cfg.vocab, cfg.dim // 2, cfg.depth, cfg.heads).to(device)
                elif impl == "posenc":
                    model = TransformerLM(
                        cfg.vocab, cfg.dim, cfg.depth, cfg.heads, encoding=enc, max_len=cfg.seq_len
                    ).to(device)
                else:
                    model = _xt_model(enc, cfg).to(device)
                tps, t = _measure(model, cfg, device)
                n = sum(p.numel() for p in model.parameters())
                rows.append(ThroughputRow(impl, enc, tps, t, n))
            except Exception as e:
                rows.append(ThroughputRow(impl, enc, None, None, None, status=f"error: {type(e).__name__}: {e}"[:250]))
    return [asdict(r) for r in rows]
