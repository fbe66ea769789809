"""``posenc extend MODEL --save DIR --method M --length L``: the extended model as a checkpoint.

Two kinds of folder, chosen by what the method is:

* **stock** — ``none``, ``linear``, ``ntk``, ``dynamic``, ``yarn``, ``longrope`` on a stock
  model whose ``rope_parameters`` is one flat dict: the model's own ``config.json`` with
  HF's ``rope_parameters`` for the method (transformers 5 format: ``rope_type``,
  ``rope_theta`` and the type's keys) and ``max_position_embeddings`` raised to ``L``, the
  weights as they are. transformers, lm-eval, vLLM and every client load it with no posenc.
  NTK-aware scaling is a change of ``rope_theta`` alone, so it is stock too. HF's ``dynamic``
  reads the training length from ``max_position_embeddings``: that one stays the training
  length (give clients the context length yourself: lm-eval's ``max_length``). ``none`` on a
  model without RoPE (GPT-2's learned table) is its config as it is.
* **remote code** — ReRoPE, Leaky ReRoPE, Self-Extend (posenc's ``rope-extension``), and
  every method on a model that is already a posenc model or has ``rope_parameters`` per
  layer type: the converted model saved by :mod:`posenc.hf` (``auto_map`` to its
  ``posenc_remote.py``), loaded with ``trust_remote_code=True`` where posenc is installed.

``sink-window`` is a cache policy of the evaluation, not a model: nothing to save. A compare
run directory holds a posenc ``TransformerLM``, not an HF model: refused; so is a length past
what a learned position table holds.

Nothing is written outside ``DIR``: the files go to a staging folder inside it, each listed
in ``DIR``'s manifest (``.posenc-manifest.json``) before it is moved into place. ``DIR`` must
be new, empty, or a folder an earlier ``--save`` wrote (its manifest lists every file in it):
that one's files are replaced. ``posenc_extend.json`` records what was saved and what the
method ran with (:mod:`posenc.extend.record`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

from ..functional import position_limit_reason
from ..output.files import write_text
from ..output.folder import OutputFolder, OutputFolderError
from ..output.manifest import MANIFEST, Manifest
from .folder import ModelError, raw_json
from .record import versions

__all__ = ["STOCK_METHODS", "TOOL", "save_extended", "stock_parameters", "run_save"]

TOOL = "posenc extend --save"
STOCK_METHODS = ("none", "linear", "ntk", "dynamic", "yarn", "longrope")  # a stock config expresses them
RECORD = "posenc_extend.json"
_STAGING = ".posenc-save-staging"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja")  # fmt: skip


def stock_parameters(own: dict, opts: dict) -> dict:
    """HF ``rope_parameters`` (one flat dict) for a method's posenc ``opts`` on a model whose own
    are ``own``: ``rope_theta`` from ``opts["base"]`` (NTK) or the model's; a method's
    ``rope_scaling`` replaces the model's own scaling (as posenc.extend.model's variant does),
    keeping ``rope_theta`` and ``partial_rotary_factor``."""
    out = dict(own)
    if "base" in opts:
        out["rope_theta"] = float(opts["base"])
    if "rope_scaling" in opts:
        kept = {k: out[k] for k in ("rope_theta", "partial_rotary_factor") if k in out}
        out = {**kept, **opts["rope_scaling"]}
    out.setdefault("rope_type", "default")
    return out


def _flat(params) -> bool:
    return isinstance(params, dict) and "rope_theta" in params and not any(isinstance(v, dict) for v in params.values())


def _kind(subject, method: str, raw: dict) -> str:
    """``"stock"`` where a stock config expresses ``method`` on this model (see the module docstring)."""
    if method not in STOCK_METHODS or str(raw.get("model_type", "")).startswith("posenc_"):
        return "remote"
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(subject.label, local_files_only=True, trust_remote_code=False)
    one = _text_config(config) is config  # (a multimodal config nests its text model's: not written here)
    rope = getattr(config, "rope_parameters", None)
    return "stock" if one and (_flat(rope) or (method == "none" and not rope)) else "remote"


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _check_dir(out: Path, model: str) -> None:
    a, b = os.path.realpath(out), os.path.realpath(model)
    if os.path.commonpath([a, b]) in (a, b):
        where = "is" if a == b else ("is inside" if os.path.commonpath([a, b]) == b else "contains")
        raise ValueError(f"--save {str(out)!r} {where} MODEL {model!r}; save the model elsewhere")


def _claim(root: Path) -> Manifest:
    """The manifest of ``root`` after an earlier ``--save``'s files were removed; refuses any other content."""
    entries = sorted(e.name for e in root.iterdir() if e.name not in (".lock", MANIFEST))
    try:
        old = Manifest.read(root)
    except ValueError as e:
        raise ValueError(f"--save {str(root)!r}: {e}") from None
    if entries:
        ours = old is not None and old.tool == TOOL and set(entries) <= {p.split("/")[0] for p in old.written}
        if not ours:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            raise ValueError(f"--save {str(root)!r} is not empty ({shown}) and is not a model posenc extend --save "
                             "wrote; allowed: a new or empty folder, or an earlier --save's folder")  # fmt: skip
        old.remove_listed()
    elif old is not None and old.tool not in (None, TOOL):
        raise ValueError(f"--save {str(root)!r} holds a {old.tool} manifest; choose another folder")
    return Manifest(root, old.written if old is not None and old.tool == TOOL else [], TOOL)


@contextlib.contextmanager
def _quiet():
    """HF's progress bars off (one line of output per save), as they were after."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _write_stock(subject, method: str, opts: dict, length: int, staging: Path) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(subject.label)
    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    params = None  # (none on a model without RoPE, GPT-2's learned table: its config as it is)
    if getattr(config, "rope_parameters", None):
        params = stock_parameters(dict(config.rope_parameters), opts)
        if params["rope_type"] == "dynamic":  # (HF's dynamic reads its original length from max_position_embeddings)
            params.pop("original_max_position_embeddings", None)
        config.rope_parameters = params
    own = int(config.max_position_embeddings)
    # HF's dynamic NTK reads the training length from max_position_embeddings: it stays that length
    config.max_position_embeddings = subject.train_len if method == "dynamic" else max(own, length)
    with _quiet():
        model = AutoModelForCausalLM.from_pretrained(path, config=config, local_files_only=True,
                                                     trust_remote_code=False, dtype="auto")  # fmt: skip
        model.save_pretrained(staging)
    return {"rope_parameters": params, "max_position_embeddings": config.max_position_embeddings}


def _write_remote(model, length: int, staging: Path) -> dict:
    text = _text_config(model.config)
    if isinstance(getattr(text, "max_position_embeddings", None), int):
        text.max_position_embeddings = max(text.max_position_embeddings, length)
    with _quiet():
        model.save_pretrained(staging)
    return {"posenc_layers": [dict(s) for s in model.config.posenc_layers],
            "max_position_embeddings": getattr(text, "max_position_embeddings", None)}  # fmt: skip


def save_extended(subject, method: str, length: int, out: str | Path, *, record: dict | None = None) -> dict:
    """Write ``subject``'s model under ``method`` set for lengths up to ``length`` tokens into
    ``out`` (see the module docstring). Returns what ``posenc_extend.json`` records.

    Raises:
        ValueError: the method does not apply or cannot be saved, or ``out`` is not a folder
            ``--save`` may write (one line naming it).
    """
    if subject.kind != "hf":
        raise ValueError("--save: MODEL is a compare run directory (a posenc TransformerLM); --save writes Hugging "
                         "Face checkpoints: give an HF checkpoint directory as MODEL")  # fmt: skip
    if method == "sink-window":
        raise ValueError("--save: sink-window is a cache policy of the evaluation (sinks + a window of the cache), "
                         "not a model setting: nothing to save; allowed: any other method")  # fmt: skip
    model, opts, why = subject.variant(method, length)
    if model is None:
        raise ValueError(f"--method {method}: not applicable to this model ({why})")
    limit = position_limit_reason(subject.encodings, length)  # (a learned table ends where it was trained)
    if limit:
        raise ValueError(f"--length {length}: past what the model's positions hold ({limit}); allowed: up to its table")
    raw = raw_json(Path(subject.label), "config.json") or {}
    kind = _kind(subject, method, raw)
    root = Path(out)
    with OutputFolder(root, tool=TOOL, flag="--save"):
        manifest = _claim(root)
        staging = root / _STAGING
        manifest.record(staging)
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            saved = _write_stock(subject, method, opts, length, staging) if kind == "stock" else (
                _write_remote(model, length, staging))  # fmt: skip
            for name in _TOKENIZER_FILES:
                if (Path(subject.label) / name).is_file():
                    shutil.copyfile(Path(subject.label) / name, staging / name)
            info = {"tool": TOOL, "method": method, "length": length, "kind": kind, "options": opts,
                    "loads_with": "transformers alone" if kind == "stock" else "trust_remote_code=True (posenc "
                    "installed)", **saved, **({"ran_with": record} if record else {}),
                    "versions": versions()}  # fmt: skip
            write_text(staging / RECORD, json.dumps(info, indent=1, default=str) + "\n")
            for f in sorted(staging.iterdir()):
                manifest.record(root / f.name)
                os.replace(f, root / f.name)
            staging.rmdir()
            manifest.prune()
        except BaseException:
            manifest.remove_listed()
            (root / MANIFEST).unlink(missing_ok=True)
            raise
    return info


def run_save(args) -> int:
    """The ``--save`` mode of ``posenc extend`` (needs ``--method`` and ``--length``)."""
    import torch

    from ..data import DataError
    from .methods import METHODS
    from .model import load_subject
    from .record import method_record
    from .run import parse_lengths, resolve_lengths

    try:
        missing = [f for f, v in (("--save", args.save), ("--method", args.method), ("--length", args.length))
                   if v is None]  # fmt: skip
        if missing:
            raise ValueError(f"--save, --method and --length go together; missing {', '.join(missing)} (e.g. --save "
                             f"out/yarn-4x --method yarn --length 4x)")  # fmt: skip
        if args.method not in METHODS:
            raise ValueError(f"--method {args.method!r}; allowed: {', '.join(METHODS)}")
        spec = parse_lengths(args.length)
        if len(spec) != 1:
            raise ValueError(f"--length {args.length!r}: one length (N tokens or Nx), not a list")
        if not args.save.strip() or "\x00" in args.save:
            raise ValueError(f"--save must name a folder, got {args.save!r}")
        _check_dir(Path(args.save), args.model)
        subject = load_subject(args.model, train_len=args.train_len, device=torch.device(args.device),
                               dtype=getattr(torch, args.dtype))  # fmt: skip
        (length,) = resolve_lengths(spec, subject.train_len)
        rec = method_record(subject, args.method, length, dtype=args.dtype, device=args.device)
        info = save_extended(subject, args.method, length, args.save, record=rec)
    except (ValueError, DataError, OutputFolderError, ModelError) as e:
        print(f"posenc extend: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    files = sorted(p.name for p in Path(args.save).iterdir() if p.name not in (".lock", MANIFEST))
    print(f"wrote {args.save}/: {', '.join(files)}")
    print(
        f"{args.method} for {length} tokens: {info['kind']} checkpoint, loads with {info['loads_with']}; "
        f"max_position_embeddings {info['max_position_embeddings']}"
    )
    return 0
