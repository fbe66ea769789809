"""What a ``MODEL`` folder holds, read without running any of it.

An HF checkpoint is read with ``trust_remote_code=False`` everywhere, after its own files
were checked: a model type posenc does not convert, or a tokenizer whose ``auto_map`` names
code in the folder, is refused before transformers reads anything (transformers would
otherwise ask whether to run that code); a saved posenc model's ``posenc_remote.py`` must be
the module posenc writes (:func:`posenc.hf.models.check_saved`); every size of its
``config.json`` is bounded (:data:`CONFIG_LIMITS`) and the weights it implies must fit in
memory before anything is built; pickled weights are read ``weights_only``. Errors are
:class:`ModelError`: one line naming the folder and what in it cannot be used.

The fingerprints (:func:`weights_fingerprint`, :func:`file_digest`, :func:`digest`) let a
resumed run check that it reads the same model and text as before.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from ..validate import memory_of

__all__ = [
    "CONFIG_LIMITS",
    "ModelError",
    "digest",
    "file_digest",
    "first",
    "raw_json",
    "read_hf",
    "weights_fingerprint",
]


class ModelError(ValueError):
    """``MODEL`` cannot be read as asked (one sentence naming the path)."""


# Every size a config.json gives, bounded before anything is allocated: a hostile or damaged
# config (num_hidden_layers 1e9, hidden_size -32) is one line, never a traceback or a hang.
# The limits are far above any published checkpoint (DeepSeek-V3: 61 layers, width 7168,
# vocabulary 129 280); the weights' total is then held against the machine's memory.
CONFIG_LIMITS = {"num_hidden_layers": 4096, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
                 "num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 1 << 14,
                 "vocab_size": 1 << 23, "max_position_embeddings": 1 << 26}  # fmt: skip


def _check_sizes(config, path: Path, dtype) -> None:
    """Refuse sizes out of :data:`CONFIG_LIMITS` and weights that cannot fit in memory."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    sizes = {}
    for name, high in CONFIG_LIMITS.items():
        v = getattr(text, name, None)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= high:
            raise ModelError(f"MODEL {str(path)!r}: config.json has {name} {v!r}; allowed: an int in 1..{high}")
        sizes[name] = v
    width, vocab, depth = sizes.get("hidden_size", 1), sizes.get("vocab_size", 1), sizes.get("num_hidden_layers", 1)
    inner = sizes.get("intermediate_size", 4 * width)
    weights = 2 * vocab * width + depth * (4 * width * width + 3 * width * inner)  # an estimate, within ~2x
    need = weights * torch.empty((), dtype=dtype).element_size()
    have = memory_of(torch.device("cpu"))  # from_pretrained builds the model in CPU memory first
    if have and need > have:
        raise ModelError(
            f"MODEL {str(path)!r}: config.json describes ~{weights:.3g} weights ({need / 2**30:.1f} GiB), more than "
            f"this machine's memory ({have / 2**30:.1f} GiB)"
        )


def _check_rope_type(config, path: Path) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(text, "rope_parameters", None) or {}
    per_type = params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]
    allowed = ["default", *ROPE_INIT_FUNCTIONS]
    for p in per_type:
        kind = p.get("rope_type", p.get("type", "default")) if isinstance(p, dict) else None
        if kind not in allowed:
            raise ModelError(f"MODEL {str(path)!r}: config.json has rope_type {kind!r}; allowed: {', '.join(allowed)}")


def raw_json(path: Path, name: str) -> dict | None:
    """``path/name`` as a JSON object; None when there is no such file."""
    f = path / name
    if not f.exists():
        return None
    try:
        if not f.is_file():
            raise ValueError("not a regular file")
        d = json.loads(f.read_text(encoding="utf-8"))
        if not isinstance(d, dict):
            raise ValueError(f"a JSON {type(d).__name__}, not an object")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelError(f"MODEL {str(path)!r}: {name} is not readable JSON ({first(e)})") from None
    return d


def _check_no_code(path: Path, raw: dict, known: set[str]) -> None:
    """Nothing in the folder is imported: a model or tokenizer that needs its own code (``auto_map``
    to a module of the folder) is refused before transformers reads anything."""
    model_type = raw.get("model_type")
    if model_type not in known:
        needs = " (its auto_map names code in the folder; posenc runs no code from a model folder)" if (
            raw.get("auto_map")) else ""  # fmt: skip
        names = ", ".join(sorted({t for t in known if not t.startswith("posenc_")}))
        raise ModelError(f"MODEL {str(path)!r}: model_type {model_type!r} is not one posenc.hf converts{needs}; "
                         f"allowed: {names}")  # fmt: skip
    if model_type.startswith("posenc_"):
        from ..hf.models import check_saved

        try:
            check_saved(path, raw)
        except ValueError as e:
            raise ModelError(f"MODEL {str(path)!r}: {e}") from None
    tok = raw_json(path, "tokenizer_config.json") or {}
    if tok.get("auto_map"):
        raise ModelError(
            f"MODEL {str(path)!r}: tokenizer_config.json's auto_map names tokenizer code in the folder; posenc runs "
            "no code from a model folder (save the tokenizer as a tokenizer.json of a transformers class instead)"
        )


def read_hf(path: Path, *, device, dtype):
    """``(model, tokenizer or None, fingerprint)`` of the HF checkpoint in ``path``: the model
    converted with its own scheme (a saved posenc model as it is), nothing of the folder run.

    Raises:
        ModelError: one line naming what in the folder cannot be used.
    """
    import pickle

    from transformers import AutoConfig, AutoModelForCausalLM

    import posenc.hf as ph

    raw = raw_json(path, "config.json")
    # every family posenc.hf converts, stock or saved after conversion (no per-family code here)
    known = {t for c, entry in ph.SUPPORTED.items() for t in (c.config_class.model_type, entry[1].model_type)}
    _check_no_code(path, raw, known)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - whatever a damaged config makes transformers raise: one line
        raise ModelError(
            f"MODEL {str(path)!r}: config.json is not a readable Hugging Face config ({first(e)})"
        ) from None
    _check_sizes(config, path, dtype)
    _check_rope_type(config, path)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # (a bar per load; extend logs its own progress, and errors stay one line)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, trust_remote_code=False)
    except pickle.UnpicklingError:  # transformers reads .bin files with weights_only=True
        raise ModelError(
            f"MODEL {str(path)!r}: its weights file holds Python objects, not only tensors; posenc refuses to load it "
            "(loading could run code; nothing was executed): save the model as safetensors"
        ) from None
    except Exception as e:  # noqa: BLE001 - missing or damaged weights, sizes the config gets wrong: one line
        raise ModelError(f"MODEL {str(path)!r}: the weights cannot be read ({first(e)})") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model = model.to(device).eval()
    weights = weights_fingerprint(model)
    if not config.model_type.startswith("posenc_"):
        try:
            model = ph.convert(model).eval()  # the model's own scheme (its RoPE and rope_parameters, GPT-2's table)
        except (TypeError, ValueError) as e:
            raise ModelError(f"MODEL {str(path)!r}: posenc.hf cannot convert it ({first(e)})") from None
    tokenizer, tok_files = _load_tokenizer(path)
    return model, tokenizer, digest({"config": raw, "weights": weights, "tokenizer": tok_files})


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json")  # fmt: skip


def _load_tokenizer(path: Path):
    """``(tokenizer or None, {file: sha256})`` of the tokenizer saved in ``path``."""
    from transformers import AutoTokenizer

    files = {f: file_digest(path / f) for f in _TOKENIZER_FILES if (path / f).is_file()}
    if not any(f in files for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None, files
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - a malformed tokenizer file raises anything from KeyError up
        raise ModelError(
            f"MODEL {str(path)!r}: the tokenizer cannot be read ({type(e).__name__}: {first(e)})"
        ) from None
    return tok, files


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of every tensor of ``model``'s state dict (names, dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def digest(d: Any) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def first(e: BaseException) -> str:
    s = str(e).strip()
    return (s.splitlines()[0] if s else type(e).__name__)[:200]
