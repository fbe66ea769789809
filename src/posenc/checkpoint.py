"""Saving and loading :class:`~posenc.TransformerLM` checkpoints.

A checkpoint is ``{"model_config": ModelConfig.to_dict(), "model": state_dict, **extra}``.
Checkpoints written before :class:`~posenc.ModelConfig` existed (a flat dict with the
encoding options at the top level, DeBERTa's enhanced-mask-decoder table as the model's
``emd_pos``) load too: :func:`upgrade_state_dict` renames what moved.
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .model import TransformerLM

__all__ = ["save_checkpoint", "load_checkpoint", "upgrade_config", "upgrade_state_dict"]

# state-dict keys that moved: old key -> new key suffix under each block's encoding
_MOVED_TO_ENCODING = {"emd_pos.weight": "absolute.weight"}
# model arguments that became encoding options (xl, deberta), with the value that meant "off"
_MOVED_TO_OPTIONS = {"memory_len": 0, "absolute_from_layer": None}


def upgrade_config(d: dict) -> ModelConfig:
    """A :class:`~posenc.ModelConfig` from a saved config dict of any posenc version."""
    d = {k: v for k, v in d.items() if not (k in _MOVED_TO_OPTIONS and v == _MOVED_TO_OPTIONS[k])}
    return ModelConfig.from_dict(d)  # the others are encoding options now


def upgrade_state_dict(model: TransformerLM, state: dict) -> dict:
    """``state`` with the keys of older posenc versions renamed to ``model``'s."""
    state = dict(state)
    own = model.state_dict()
    for old, suffix in _MOVED_TO_ENCODING.items():
        if old in state and old not in own:
            value = state.pop(old)
            for key in own:
                if key.startswith("blocks.") and key.endswith(f".attn.encoding.{suffix}"):
                    state[key] = value
    return state


def save_checkpoint(path, model: TransformerLM, **extra) -> None:
    """Save ``model`` (config + weights) and any ``extra`` picklable data to ``path``."""
    torch.save({"model_config": model.config.to_dict(), "model": model.state_dict(), **extra}, path)


def load_checkpoint(path, *, map_location="cpu") -> tuple[TransformerLM, dict]:
    """Rebuild a model saved by :func:`save_checkpoint`; returns ``(model, extra)``."""
    ckpt = torch.load(path, map_location=map_location, weights_only=False)
    if not isinstance(ckpt, dict) or "model_config" not in ckpt or "model" not in ckpt:
        keys = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(f"{path} is not a posenc checkpoint (keys: {keys})")
    config = ckpt.pop("model_config")
    model = TransformerLM(config=config if isinstance(config, ModelConfig) else upgrade_config(config))
    model.load_state_dict(upgrade_state_dict(model, ckpt.pop("model")))
    return model, ckpt
