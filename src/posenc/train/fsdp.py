"""Fully sharded data parallel training (``torch.distributed.fsdp.fully_shard``, FSDP2) for a
model whose weights, gradients and optimizer state do not fit one device under DDP.

Every block is one FSDP unit, and the root holds the rest (token embeddings, the head and
whatever they tie: tied tensors must live in one unit). Parameters become sharded
``DTensor``s: build the optimizer *after* :func:`shard_model`. A checkpoint holds the full
(unsharded) weights and optimizer state, gathered on every process (:func:`gather`) and
written by rank 0, so it loads into a plain model, and a sharded run resumes from it
(:func:`load_optimizer`). Works with gloo on the CPU and nccl on GPUs.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["FullModel", "gather", "load_optimizer", "shard_model"]


def shard_model(model: nn.Module) -> nn.Module:
    """Shard ``model`` in place over the default process group: each of ``model.blocks``, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in getattr(model, "blocks", ()):
        fully_shard(block)
    fully_shard(model)
    return model


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def gather(model: nn.Module, optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full weights and optimizer state, on the CPU (a collective: every process calls it;
    rank 0 receives them, the others empty dicts)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizer, options=_options(cpu_offload=True))


def load_optimizer(model: nn.Module, optimizer, state: dict[str, Any]) -> None:
    """Load a full optimizer state (every process holds it) into the sharded ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=_options())


class FullModel:
    """What :func:`posenc.save_checkpoint` reads of a model (``config``, ``state_dict()``),
    from gathered full weights."""

    def __init__(self, config, state: dict[str, Any]) -> None:
        self.config, self._state = config, state

    def state_dict(self) -> dict[str, Any]:
        return self._state
