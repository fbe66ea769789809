"""Saving and loading :class:`~posenc.TransformerLM` checkpoints, safely.

A checkpoint is ``{"model_config": ModelConfig.to_dict(), "model": state_dict, **extra}``:
tensors and plain data (dicts, lists, tuples, strings, numbers, booleans, ``None``) only.

Loading never runs code from the file. :func:`load_checkpoint` reads with
``torch.load(..., weights_only=True)``: PyTorch's restricted unpickler, which builds
tensors and plain containers and refuses every other Python object (a pickle "payload"
that would call ``os.system`` on load is rejected before anything is called). Every
checkpoint posenc writes (``posenc.save_checkpoint``, ``posenc compare``'s
``checkpoints/*.pt``, ``posenc analyze --train-dir``) loads that way;
:func:`save_checkpoint` refuses ``extra`` values that would not, so a checkpoint that
saves also loads. What is and is not safe to load is in docs/compare.md ("Loading
checkpoints").

Checkpoints written before :class:`~posenc.ModelConfig` existed (a flat dict with the
encoding options at the top level, DeBERTa's enhanced-mask-decoder table as the model's
``emd_pos``) load too: :func:`upgrade_state_dict` renames what moved. So do configs saved
while :func:`posenc.build` still made a variant from the options (``deberta`` with
``absolute_from_layer``, ``nope`` with ``attn_scale``, ``rope`` with ``rope_extension``,
``inkling`` with ``log_scaling_*``): :func:`upgrade_config` names the variant.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig
from .model import TransformerLM
from .output.files import hold_ctrl_c
from .registry import available, get_class, options_of, related

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "run_checkpoint",
    "upgrade_config",
    "upgrade_state_dict",
    "CheckpointError",
]

# state-dict keys that moved: old key -> new key suffix under each block's encoding
_MOVED_TO_ENCODING = {"emd_pos.weight": "absolute.weight"}
# model arguments that became encoding options (xl, deberta), with the value that meant "off"
_MOVED_TO_OPTIONS = {"memory_len": 0, "absolute_from_layer": None}
# what a checkpoint may hold: what torch.load(weights_only=True) rebuilds without running code
_PLAIN = (str, int, float, bool, type(None), torch.Tensor, torch.Size, torch.dtype, torch.device)


class CheckpointError(ValueError):
    """A file that is not a (safely loadable) posenc checkpoint, or data that cannot be saved as one."""


def upgrade_config(d: dict) -> ModelConfig:
    """A :class:`~posenc.ModelConfig` from a saved config dict of any posenc version."""
    d = {k: v for k, v in d.items() if not (k in _MOVED_TO_OPTIONS and v == _MOVED_TO_OPTIONS[k])}
    names = {f.name for f in fields(ModelConfig)}
    options = {**(d.get("options") or {}), **{k: v for k, v in d.items() if k not in names}}  # options now
    d = {k: v for k, v in d.items() if k in names} | {"options": options}
    if "encoding" in d:
        d["encoding"] = _variant_named(d["encoding"], options)
    if d.get("layers"):
        d["layers"] = [
            {**s, "encoding": _variant_named(s.get("encoding"), s.get("options") or {})} if isinstance(s, dict) else s
            for s in d["layers"]
        ]
    return ModelConfig.from_dict(d)


def _variant_named(name, options: dict):
    """The registered class a config saved by posenc <= 0.x meant by ``name`` with ``options``: the
    one variant of its family that takes the options ``name`` does not (posenc built it then)."""
    if not isinstance(name, str) or name not in available():
        return name
    unknown = set(options) - set(options_of(get_class(name)))
    others = related(get_class(name), unknown) if unknown else []
    return others[0] if len(others) == 1 else name


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


def _check_plain(value: Any, where: str) -> None:
    """Raise :class:`CheckpointError` unless ``value`` is tensors and plain data all the way down."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"checkpoint entry {where}: key {k!r} is a {type(k).__name__}, not a str or int")
            _check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN):
        raise CheckpointError(
            f"checkpoint entry {where} is a {type(value).__name__}: a checkpoint holds tensors and plain data "
            "(dict, list, tuple, str, int, float, bool, None) only, so that loading it never runs code"
        )


def save_checkpoint(path, model: TransformerLM, **extra) -> None:
    """Save ``model`` (config + weights) and ``extra`` (tensors and plain data) to ``path``.

    A Ctrl-C during the write is raised (``KeyboardInterrupt``) once the file is whole.

    Raises:
        CheckpointError: an ``extra`` value that is not tensors and plain data (it would not
            load with ``weights_only=True``); nothing is written then.
    """
    for key, value in extra.items():
        if key in ("model_config", "model"):
            raise CheckpointError(f"extra entry {key!r} is reserved for the model itself")
        _check_plain(value, key)
    try:
        with hold_ctrl_c():
            torch.save({"model_config": model.config.to_dict(), "model": model.state_dict(), **extra}, path)
    except RuntimeError as e:
        # a Ctrl-C inside one of the zip writer's writes comes out as RuntimeError("unexpected pos
        # ..."), the same words as a full disk: it is the Ctrl-C
        if isinstance(e.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        raise


def load_checkpoint(path, *, map_location="cpu") -> tuple[TransformerLM, dict]:
    """Rebuild a model saved by :func:`save_checkpoint`; returns ``(model, extra)``.

    The file is read with ``torch.load(weights_only=True)``: nothing in it is executed.

    Raises:
        CheckpointError: ``path`` holds Python objects other than tensors and plain data
            (refused unexecuted), is not a posenc checkpoint, is truncated or unreadable, or
            its config or weights do not make a model. The message names ``path``.
        FileNotFoundError: ``path`` does not exist.
    """
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:  # the restricted unpickler stopped: an object, or not a pickle at all
        # PyTorch's own message suggests lifting the restriction: show only what it refused
        refused = re.search(r"GLOBAL [\w.]+", str(e))
        if refused:
            raise CheckpointError(
                f"{path} is not a posenc checkpoint: it holds a Python object ({refused.group(0)}), not only tensors "
                "and plain data; posenc refuses to load it (loading could run code; nothing was executed)"
            ) from None
        other = re.search(r"Unsupported [\w ]+\d*", str(e))
        raise CheckpointError(
            f"{path} is not a readable posenc checkpoint ({other.group(0) if other else 'not a safe pickle'}); "
            "posenc refuses to load it other than as tensors and plain data (nothing was executed)"
        ) from None
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - random bytes reach the unpickler's IndexError, KeyError, ...
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is not a readable posenc checkpoint ({reason})") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model_config"), dict) or "model" not in ckpt:
        keys = sorted(map(str, ckpt)) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"{path} is not a posenc checkpoint (keys: {keys})")
    try:  # a config or weights that do not make a model: one error naming the file, never a traceback
        model = TransformerLM(config=upgrade_config(ckpt.pop("model_config")))
        model.load_state_dict(upgrade_state_dict(model, ckpt.pop("model")))
    except (ValueError, TypeError, KeyError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is not a loadable posenc checkpoint ({type(e).__name__}: {reason})") from None
    return model, ckpt


def run_checkpoint(ckpt_dir: str | Path, encoding: str, seed: int, *, seeds: int) -> Path:
    """The checkpoint of model ``encoding``, seed ``seed``, in a compare run's ``checkpoints/``
    folder ``ckpt_dir``: ``<encoding>.pt`` for a run of one seed (``seeds`` 1), ``<encoding>.seed<k>.pt``
    with several.

    Always a file directly in ``ckpt_dir``: a model name that is not one safe file name (an
    unnamed layer pattern whose options hold a ``/``; a ``NAME`` is checked by
    :meth:`CompareConfig.validate`) is spelt safely, with a hash of the name.

    Raises:
        ValueError: the path would leave ``ckpt_dir``.
    """
    ckpt_dir = Path(ckpt_dir)
    stem = encoding if _file_name(encoding) else _safe_stem(encoding)
    path = ckpt_dir / (f"{stem}.pt" if seeds == 1 else f"{stem}.seed{seed}.pt")
    if path.parent != ckpt_dir or os.path.realpath(path.parent) != os.path.realpath(ckpt_dir):
        raise ValueError(f"checkpoint of model {encoding!r} would leave {str(ckpt_dir)!r}: {str(path)!r}")
    return path


def _file_name(name: str) -> bool:
    bad = ("/", "\\", "\x00", os.sep)
    return bool(name) and not name.startswith(".") and not any(c in name for c in bad) and len(name.encode()) <= 200


def _safe_stem(name: str) -> str:
    keep = re.sub(r"[^A-Za-z0-9._+=(),*@-]", "_", name).lstrip(".")[:80]
    return f"{keep}-{hashlib.sha256(name.encode()).hexdigest()[:10]}"
