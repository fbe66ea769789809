"""Model conversions that keep the trained weights: a model of one encoding becomes another's.

* :func:`learned_to_hierarchical` — a ``learned`` :class:`~posenc.TransformerLM` becomes a
  ``hierarchical`` one that runs up to ``max_len²`` positions (Su, "Transformer upgrade
  road 7", 2020; the encoding itself is :class:`posenc.encodings.absolute.Hierarchical`).

They act on whole models and their :class:`~posenc.ModelConfig`, so they stand above the
encodings (``posenc.encodings`` imports no config or model).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .base import PositionEncoding
from .config import ModelConfig
from .layer.spec import LayerSpec

__all__ = ["learned_to_hierarchical"]


def learned_to_hierarchical(model, *, alpha: float = 0.4):
    """Convert a trained ``learned`` :class:`~posenc.TransformerLM` into a ``hierarchical`` one.

    Every weight is reused (the position table keeps its name ``table``); the new model
    reproduces the old one exactly at positions below ``max_len`` and runs up to
    ``max_len²``. Its ``config`` says ``encoding="hierarchical"``, so
    :func:`posenc.save_checkpoint` / :func:`posenc.load_checkpoint` round-trip it.
    """
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig) or any(s.encoding != "learned" for s in cfg.layer_specs()):
        raise ValueError(
            f"expects a TransformerLM built with encoding='learned', got {type(model).__name__} "
            f"with encoding={getattr(cfg, 'encoding', None)!r}"
        )
    layers = (
        None if cfg.layers is None else [LayerSpec("hierarchical", {**s.options, "alpha": alpha}) for s in cfg.layers]
    )
    new_cfg = replace(cfg, encoding="hierarchical", options={**cfg.options, "alpha": alpha}, layers=layers)
    ref = model.head.weight
    with torch.device("meta"):
        new = type(model)(config=new_cfg)
    new = new.to_empty(device=ref.device).to(ref.dtype)
    new.load_state_dict(model.state_dict())
    for m in new.modules():
        if isinstance(m, PositionEncoding):
            m.init_buffers()
    return new
