"""The model ``posenc extend`` reads, and the same model under each extension method.

``MODEL`` is one of

* a local Hugging Face checkpoint directory (``config.json`` + weights): a stock model of a
  family :func:`posenc.hf.convert` supports, or one saved after conversion. It is read with
  ``local_files_only=True`` (a path that does not exist is an error, never a hub id) and
  converted with the encodings it has, so that every method runs through posenc's attention;
* a ``posenc compare`` run directory: its checkpoint of ``--encoding`` (seed ``--seed``) is
  read with :func:`posenc.checkpoint.load_checkpoint` (``weights_only=True``).

A method changes only how positions enter attention (:func:`posenc.compare.extend.method_options`):
its options go to every layer whose encoding takes them (:func:`posenc.compare.extend.applies`),
the other layers keep theirs, so a model mixing RoPE and NoPE layers is extended in its RoPE
layers. No per-family code: the layers' specs are read from the converted model's config.
``sink-window`` (StreamingLLM) is a cache policy, not an option: it applies to any model
(:mod:`posenc.extend.evaluate`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..compare.extend import applies, method_options, with_options

__all__ = ["Subject", "load_subject", "ModelError"]


class ModelError(ValueError):
    """``MODEL`` cannot be read as asked (one sentence naming the path)."""


@dataclass
class Subject:
    """The model under study: ``kind`` ``"hf"`` (a converted HF model) or ``"run"`` (a posenc
    ``TransformerLM``); ``train_len`` in tokens; ``tokenizer`` None for bytes as tokens."""

    kind: str
    model: Any
    train_len: int
    vocab_size: int
    label: str
    tokenizer: Any = None
    specs: list[dict] = field(default_factory=list)  # one {"encoding", "options"} per layer
    rope: dict = field(default_factory=dict)  # base, rotary_dim, longrope factors of the first rotary layer

    def variant(self, method: str, longest: int) -> tuple[Any, dict, str | None]:
        """``(model, options, why_not)`` for ``method`` set for lengths up to ``longest``:
        the model to run (None when the method does not apply: ``why_not`` says why)."""
        if method == "sink-window":
            return self.model, method_options(method, train_tokens=self.train_len, longest_tokens=longest), None
        if method != "none" and not any(applies(method, s["encoding"]) for s in self.specs):
            names = sorted({s["encoding"] for s in self.specs})
            return None, {}, f"no layer's encoding ({', '.join(names)}) takes {method}'s options"
        if method == "none":
            return self.model, {}, None
        try:
            opts = method_options(method, train_tokens=self.train_len, longest_tokens=longest, **self.rope)
        except ValueError as e:  # longrope without factors
            return None, {}, str(e)
        try:
            return self._with(method, opts), opts, None
        except ValueError as e:  # e.g. rope_extension on a layer with rope_scaling
            return None, opts, str(e).splitlines()[0]

    def _with(self, method: str, opts: dict):
        if self.kind == "run":
            return with_options(self.model, **opts)
        import posenc.hf as ph

        specs = []
        for s in self.specs:
            own = dict(s["options"])
            if applies(method, s["encoding"]):
                if "rope_extension" in opts:  # defined on plain RoPE: the model's scaling cannot stay
                    if own.get("rope_scaling"):
                        raise ValueError(
                            f"{method} is defined on plain RoPE; this layer has rope_scaling {own['rope_scaling']}"
                        )
                    own.pop("rope_scaling", None)
                own = {**own, **opts}
            specs.append((s["encoding"], own))
        return ph.convert(self.model, encoding=specs).eval()


def _rope_facts(specs: list[dict], head_dim: int, model_rope: dict | None = None) -> dict:
    for s in specs:
        if s["encoding"] in ("rope", "xpos"):
            o = s["options"]
            rd = int(head_dim * o.get("partial_rotary_factor", 1.0)) // 2 * 2
            out = {"base": float(o.get("base", 10000.0)), "rotary_dim": rd}
            sc = o.get("rope_scaling") or {}
            if sc.get("rope_type") == "longrope":
                out["longrope"] = {k: sc[k] for k in ("short_factor", "long_factor") if k in sc}
            return out
    return {}


def _train_len_hf(config) -> int:
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and params.get("original_max_position_embeddings"):
        return int(params["original_max_position_embeddings"])
    for name in ("max_position_embeddings", "n_positions"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    raise ModelError("the model's config names no training length (max_position_embeddings); pass --train-len")


def _load_hf(path: Path, *, device, dtype) -> Subject:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import posenc.hf as ph

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(
            f"MODEL {str(path)!r}: config.json is not a readable Hugging Face config ({_first(e)})"
        ) from None
    # every family posenc.hf converts, stock or saved after conversion (no per-family code here)
    known = {t for c, entry in ph.SUPPORTED.items() for t in (c.config_class.model_type, entry[1].model_type)}
    if config.model_type not in known:
        names = ", ".join(c.__name__ for c in ph.SUPPORTED)
        raise ModelError(
            f"MODEL {str(path)!r}: model_type {config.model_type!r} is not one posenc.hf converts ({names})"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ModelError(f"MODEL {str(path)!r}: the weights cannot be read ({_first(e)})") from None
    model = model.to(device).eval()
    if not config.model_type.startswith("posenc_"):
        try:
            model = ph.convert(model).eval()  # the model's own scheme (its RoPE and rope_parameters, GPT-2's table)
        except (TypeError, ValueError) as e:
            raise ModelError(f"MODEL {str(path)!r}: posenc.hf cannot convert it ({_first(e)})") from None
    tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    specs = [dict(s) for s in model.config.posenc_layers]
    dims = model.posenc_stack.dims
    return Subject("hf", model, _train_len_hf(model.config), model.config.vocab_size, str(path), tokenizer, specs,
                   _rope_facts(specs, dims.head_dim))  # fmt: skip


def _load_run(path: Path, encoding: str | None, seed: int | None, *, device, dtype) -> Subject:
    from ..checkpoint import load_checkpoint
    from ..compare.config import from_dict
    from ..compare.train import checkpoint_path

    try:
        raw = json.loads((path / "config.json").read_text())
        cfg = from_dict(raw)
    except (ValueError, TypeError, KeyError) as e:
        raise ModelError(f"MODEL {str(path)!r}: config.json is not a posenc compare config ({_first(e)})") from None
    if cfg.task:
        raise ModelError(f"MODEL {str(path)!r} trained the task {cfg.task!r}; posenc extend evaluates language models")
    names = [e for e in cfg.encodings if applies("none", e)]
    if encoding is None:
        if len(names) != 1:
            raise ModelError(f"MODEL {str(path)!r} holds the rotary models {names}: choose one with --encoding")
        encoding = names[0]
    if encoding not in cfg.encodings:
        raise ModelError(f"--encoding {encoding!r}: the run trained {list(cfg.encodings)}")
    seed = cfg.seeds[0] if seed is None else seed
    ckpt = checkpoint_path(path / "checkpoints", cfg, encoding, seed)
    if not ckpt.is_file():
        raise ModelError(f"MODEL {str(path)!r}: no checkpoint {ckpt.name} for {encoding!r} seed {seed}")
    model, _ = load_checkpoint(ckpt, map_location=device)
    model = model.to(dtype).eval()
    enc = model.encodings[0]
    rope = {"base": float(enc.base), "rotary_dim": int(enc.rotary_dim)} if hasattr(enc, "rotary_dim") else {}
    specs = [{"encoding": encoding, "options": dict(model.config.options)}]
    return Subject("run", model, cfg.train_len, model.vocab_size, f"{path} ({encoding}, seed {seed})",
                   None, specs, rope)  # fmt: skip


def load_subject(model: str, *, encoding=None, seed=None, train_len=None, device="cpu", dtype=torch.float32) -> Subject:
    """Read ``MODEL`` (see the module docstring).

    Raises:
        ModelError: not a directory, neither an HF checkpoint nor a compare run directory,
            or a model posenc cannot run.
    """
    path = Path(model)
    if not path.exists():
        raise ModelError(f"MODEL {model!r} does not exist (posenc extend reads local directories, never the hub)")
    if not path.is_dir():
        raise ModelError(f"MODEL {model!r} is not a directory (an HF checkpoint directory or a compare run directory)")
    if not (path / "config.json").is_file():
        raise ModelError(f"MODEL {model!r} has no config.json: not an HF checkpoint or a compare run directory")
    if (path / "checkpoints").is_dir() and not _is_hf(path):
        subject = _load_run(path, encoding, seed, device=device, dtype=dtype)
    else:
        subject = _load_hf(path, device=device, dtype=dtype)
    if train_len is not None:
        subject.train_len = train_len
    return subject


def _is_hf(path: Path) -> bool:
    try:
        return "model_type" in json.loads((path / "config.json").read_text())
    except (ValueError, OSError):
        return False


def _first(e: BaseException) -> str:
    s = str(e).strip()
    return (s.splitlines()[0] if s else type(e).__name__)[:200]
