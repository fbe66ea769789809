"""The model ``posenc extend`` reads, and the same model under each extension method.

``MODEL`` is one of

* a local Hugging Face checkpoint directory (``config.json`` + weights): a stock model of a
  family :func:`posenc.hf.convert` supports, or one saved after conversion. It is read with
  ``local_files_only=True`` (a path that does not exist is an error, never a hub id) and
  converted with the encodings it has, so that every method runs through posenc's attention;
* a ``posenc compare`` run directory: its checkpoint of ``--encoding`` (seed ``--seed``) is
  read with :func:`posenc.checkpoint.load_checkpoint` (``weights_only=True``).

A method changes only how positions enter attention (:func:`posenc.extend.methods.method_options`):
its options go to every layer whose encoding takes them (:func:`posenc.extend.methods.applies`),
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

from .folder import ModelError, digest, file_digest, first, read_hf
from .methods import applies, method_classes, method_options, with_options

__all__ = ["Subject", "load_subject", "ModelError", "peek"]


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
    fingerprint: str = ""  # a hash of the model's config, weights and tokenizer: --resume checks it

    @property
    def encodings(self) -> list:
        """The model's position encodings (an HF model's: its posenc stack's)."""
        return list((self.model if self.kind == "run" else self.model.posenc_stack).encodings)

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

    def same_as_none(self, method: str, opts: dict, length: int) -> str | None:
        """Why ``method`` with ``opts`` is the model as trained at ``length`` (its cell would
        repeat ``none``'s at full cost), or None. Only where it is so by construction: a scaling
        factor of 1 or dynamic NTK within its original length on layers with no scaling of their
        own (which the method would replace), NTK's base equal to every rotary layer's."""
        takes = [dict(s["options"]) for s in self.specs if applies(method, s["encoding"])]
        if not takes:
            return None
        if method == "ntk":
            base = opts.get("base")
            same = all(o.get("base") == base for o in takes)
            return f"base {base:g} is every rotary layer's own: the same model as `none`" if same else None
        sc = opts.get("rope_scaling") or {}
        if any(o.get("rope_scaling") for o in takes) or not sc:
            return None
        if sc.get("rope_type") in ("linear", "yarn") and sc.get("factor") == 1:
            return "factor 1 (no length past the training length): the same model as `none`"
        orig = sc.get("original_max_position_embeddings", 0)
        if sc.get("rope_type") == "dynamic" and sc.get("factor") == 1 and length <= orig:
            return f"dynamic NTK scales only past {orig} tokens: the same model as `none` at this length"
        return None

    def _with(self, method: str, opts: dict):
        if self.kind == "run":
            return with_options(self.model, method_classes(method), **opts)
        import posenc.hf as ph

        specs, rename = [], method_classes(method)
        for s in self.specs:
            own, name = dict(s["options"]), s["encoding"]
            if applies(method, name):
                if "rope_extension" in opts:  # defined on plain RoPE: the model's scaling cannot stay
                    if own.get("rope_scaling"):
                        raise ValueError(
                            f"{method} is defined on plain RoPE; this layer has rope_scaling {own['rope_scaling']}"
                        )
                    own.pop("rope_scaling", None)
                own, name = {**own, **opts}, rename.get(name, name)
            specs.append((name, own))
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


# what extend reads of a compare run's config; the checkpoint's own record of the fields that
# decide the model (_TRAINED_AS) must agree (encodings and seeds may grow on a resumed run)
_RUN_FIELDS = ("task", "encodings", "seeds", "train_len")
_TRAINED_AS = ("task", "train_len")


def _run_config(raw: Any, path: Path) -> dict:
    """The fields of a compare run's ``config.json`` that extend reads, checked."""
    if not isinstance(raw, dict):
        raise ModelError(f"MODEL {str(path)!r}: config.json is not a posenc compare config (not a JSON object)")
    d = dict(raw)
    if "seed" in d and "seeds" not in d:  # a config written before seeds existed
        d["seeds"] = [d.pop("seed")]
    d.setdefault("seeds", [0])
    d.setdefault("task", None)
    ok = (isinstance(d.get("encodings"), list) and all(isinstance(e, str) for e in d["encodings"])
          and isinstance(d["seeds"], list) and all(isinstance(x, int) and x >= 0 for x in d["seeds"]) and d["seeds"]
          and isinstance(d.get("train_len"), int) and d["train_len"] >= 2)  # fmt: skip
    if not ok:
        raise ModelError(
            f"MODEL {str(path)!r}: config.json is not a posenc compare config (encodings, seeds, train_len)"
        )
    return {k: d[k] for k in _RUN_FIELDS}


def _load_run(path: Path, encoding: str | None, seed: int | None, *, device, dtype) -> Subject:
    from ..checkpoint import CheckpointError, load_checkpoint, run_checkpoint

    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelError(f"MODEL {str(path)!r}: config.json is not readable JSON ({first(e)})") from None
    cfg = _run_config(raw, path)
    if cfg["task"]:
        raise ModelError(
            f"MODEL {str(path)!r} trained the task {cfg['task']!r}; posenc extend evaluates language models"
        )
    names = [e for e in cfg["encodings"] if applies("none", e)]
    if encoding is None:
        if len(names) != 1:
            raise ModelError(f"MODEL {str(path)!r} holds the rotary models {names}: choose one with --encoding")
        encoding = names[0]
    if encoding not in cfg["encodings"]:
        raise ModelError(f"--encoding {encoding!r}: the run trained {list(cfg['encodings'])}")
    if seed is None:
        seed = cfg["seeds"][0]
    elif seed not in cfg["seeds"]:
        raise ModelError(f"--seed {seed}: the run trained seeds {list(cfg['seeds'])}")
    try:
        ckpt = run_checkpoint(path / "checkpoints", encoding, seed, seeds=len(cfg["seeds"]))
    except ValueError as e:
        raise ModelError(str(e)) from None
    if not ckpt.is_file():
        raise ModelError(f"MODEL {str(path)!r}: no checkpoint {ckpt.name} for {encoding!r} seed {seed}")
    try:
        model, extra = load_checkpoint(ckpt, map_location=device)
    except CheckpointError as e:
        raise ModelError(str(e)) from None
    _check_trained_as(extra, cfg, ckpt)
    if extra.get("encoding", encoding) != encoding or extra.get("seed", seed) != seed:
        raise ModelError(f"{str(ckpt)!r} holds {extra.get('encoding')!r} seed {extra.get('seed')}, "
                         f"not {encoding!r} seed {seed}: the run folder was changed after training")  # fmt: skip
    model = model.to(dtype).eval()
    enc = model.encodings[0]
    rope = {"base": float(enc.base), "rotary_dim": int(enc.rotary_dim)} if hasattr(enc, "rotary_dim") else {}
    specs = [{"encoding": encoding, "options": dict(model.config.options)}]
    fingerprint = digest({"checkpoint": file_digest(ckpt)})
    return Subject("run", model, cfg["train_len"], model.vocab_size, f"{path} ({encoding}, seed {seed})",
                   None, specs, rope, fingerprint)  # fmt: skip


def _check_trained_as(extra: dict, cfg: dict, ckpt: Path) -> None:
    """The checkpoint records the config it was trained under: what extend reads of the run
    folder's ``config.json`` (``cfg``) must be the same, or the folder was edited after training.
    A checkpoint of a posenc older than this record is taken with its folder's config."""
    saved = extra.get("compare_config")
    if not isinstance(saved, dict):
        return
    try:
        trained = _run_config(saved, ckpt)
    except ModelError:
        raise ModelError(f"{str(ckpt)!r}: its record of the training config is damaged") from None
    diff = [f"{k} {trained[k]!r} in the checkpoint, {cfg[k]!r} in config.json" for k in _TRAINED_AS
            if trained[k] != cfg[k]]  # fmt: skip
    if diff:
        raise ModelError(
            f"{str(ckpt)!r} was trained under another config than the run folder's config.json ({'; '.join(diff)}); "
            "the folder was edited after training: restore its config.json"
        )


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
        given = [f for f, v in (("--encoding", encoding), ("--seed", seed)) if v is not None]
        if given:
            raise ModelError(f"{' and '.join(given)}: only for a compare run directory; MODEL {model!r} is an HF "
                             "checkpoint (one model, its own encodings)")  # fmt: skip
        model, tokenizer, fingerprint = read_hf(path, device=device, dtype=dtype)
        specs = [dict(s) for s in model.config.posenc_layers]
        rope = _rope_facts(specs, model.posenc_stack.dims.head_dim)
        subject = Subject("hf", model, _train_len_hf(model.config), model.config.vocab_size, str(path), tokenizer,
                          specs, rope, fingerprint)  # fmt: skip
    if train_len is not None:
        subject.train_len = train_len
    return subject


def peek(model: str) -> tuple[int | None, bool]:
    """``(training length or None, has a tokenizer)`` of ``MODEL`` from its ``config.json`` alone,
    no weights read: what ``--text``'s length is checked against before the model loads.
    None where the config does not say (the full load then decides, or refuses)."""
    path = Path(model)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None, False
    if not isinstance(raw, dict):
        return None, False
    if "model_type" not in raw:  # a compare run directory: bytes as tokens
        n = raw.get("train_len")
        return (n if isinstance(n, int) and not isinstance(n, bool) and n >= 2 else None), False
    tok = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    for params in (text.get("rope_parameters"), text.get("rope_scaling")):
        if isinstance(params, dict) and isinstance(params.get("original_max_position_embeddings"), int):
            return params["original_max_position_embeddings"], tok
    for name in ("max_position_embeddings", "n_positions"):
        v = text.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v, tok
    return None, tok


def _is_hf(path: Path) -> bool:
    try:
        return "model_type" in json.loads((path / "config.json").read_text())
    except (ValueError, OSError):
        return False
