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

import hashlib
import json
import os
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
    fingerprint: str = ""  # a hash of the model's config, weights and tokenizer: --resume checks it

    @property
    def positions(self):
        """What holds the model's encodings (``.encodings``): the model, or an HF model's posenc stack."""
        return self.model if self.kind == "run" else self.model.posenc_stack

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
    have = _physical_memory()
    if have and need > have:
        raise ModelError(
            f"MODEL {str(path)!r}: config.json describes ~{weights:.3g} weights ({need / 2**30:.1f} GiB), more than "
            f"this machine's memory ({have / 2**30:.1f} GiB)"
        )


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


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


def _raw_json(path: Path, name: str) -> dict | None:
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
        raise ModelError(f"MODEL {str(path)!r}: {name} is not readable JSON ({_first(e)})") from None
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
        from ..hf.remote import check_remote_code

        try:
            check_remote_code(path, raw)
        except ValueError as e:
            raise ModelError(f"MODEL {str(path)!r}: {e}") from None
    tok = _raw_json(path, "tokenizer_config.json") or {}
    if tok.get("auto_map"):
        raise ModelError(
            f"MODEL {str(path)!r}: tokenizer_config.json's auto_map names tokenizer code in the folder; posenc runs "
            "no code from a model folder (save the tokenizer as a tokenizer.json of a transformers class instead)"
        )


def _load_hf(path: Path, *, device, dtype) -> Subject:
    import pickle

    from transformers import AutoConfig, AutoModelForCausalLM

    import posenc.hf as ph

    raw = _raw_json(path, "config.json")
    # every family posenc.hf converts, stock or saved after conversion (no per-family code here)
    known = {t for c, entry in ph.SUPPORTED.items() for t in (c.config_class.model_type, entry[1].model_type)}
    _check_no_code(path, raw, known)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - whatever a damaged config makes transformers raise: one line
        raise ModelError(
            f"MODEL {str(path)!r}: config.json is not a readable Hugging Face config ({_first(e)})"
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
        raise ModelError(f"MODEL {str(path)!r}: the weights cannot be read ({_first(e)})") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model = model.to(device).eval()
    weights = weights_fingerprint(model)
    if not config.model_type.startswith("posenc_"):
        try:
            model = ph.convert(model).eval()  # the model's own scheme (its RoPE and rope_parameters, GPT-2's table)
        except (TypeError, ValueError) as e:
            raise ModelError(f"MODEL {str(path)!r}: posenc.hf cannot convert it ({_first(e)})") from None
    tokenizer, tok_files = _load_tokenizer(path)
    specs = [dict(s) for s in model.config.posenc_layers]
    dims = model.posenc_stack.dims
    fingerprint = _digest({"config": raw, "weights": weights, "tokenizer": tok_files})
    return Subject("hf", model, _train_len_hf(model.config), model.config.vocab_size, str(path), tokenizer, specs,
                   _rope_facts(specs, dims.head_dim), fingerprint)  # fmt: skip


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json")  # fmt: skip


def _load_tokenizer(path: Path):
    """``(tokenizer or None, {file: sha256})`` of the tokenizer saved in ``path``."""
    from transformers import AutoTokenizer

    files = {f: _file_digest(path / f) for f in _TOKENIZER_FILES if (path / f).is_file()}
    if not any(f in files for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None, files
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - a malformed tokenizer file raises anything from KeyError up
        raise ModelError(
            f"MODEL {str(path)!r}: the tokenizer cannot be read ({type(e).__name__}: {_first(e)})"
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


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _digest(d: Any) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _load_run(path: Path, encoding: str | None, seed: int | None, *, device, dtype) -> Subject:
    from ..checkpoint import CheckpointError, load_checkpoint
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
    if seed is None:
        seed = cfg.seeds[0]
    elif seed not in cfg.seeds:
        raise ModelError(f"--seed {seed}: the run trained seeds {list(cfg.seeds)}")
    ckpt = checkpoint_path(path / "checkpoints", cfg, encoding, seed)
    if not ckpt.is_file():
        raise ModelError(f"MODEL {str(path)!r}: no checkpoint {ckpt.name} for {encoding!r} seed {seed}")
    try:
        model, extra = load_checkpoint(ckpt, map_location=device)
    except CheckpointError as e:
        raise ModelError(str(e)) from None
    trained = _trained_config(extra, cfg, ckpt)
    if extra.get("encoding", encoding) != encoding or extra.get("seed", seed) != seed:
        raise ModelError(f"{str(ckpt)!r} holds {extra.get('encoding')!r} seed {extra.get('seed')}, "
                         f"not {encoding!r} seed {seed}: the run folder was changed after training")  # fmt: skip
    model = model.to(dtype).eval()
    enc = model.encodings[0]
    rope = {"base": float(enc.base), "rotary_dim": int(enc.rotary_dim)} if hasattr(enc, "rotary_dim") else {}
    specs = [{"encoding": encoding, "options": dict(model.config.options)}]
    fingerprint = _digest({"checkpoint": _file_digest(ckpt)})
    return Subject("run", model, trained.train_len, model.vocab_size, f"{path} ({encoding}, seed {seed})",
                   None, specs, rope, fingerprint)  # fmt: skip


def _trained_config(extra: dict, cfg, ckpt: Path):
    """The config the checkpoint was trained under (it records it); ``cfg`` (the folder's
    config.json) must be the same, or the folder was edited after training."""
    from ..compare.config import from_dict

    saved = extra.get("compare_config")
    if not isinstance(saved, dict):  # written by a posenc older than the fingerprints: config.json it is
        return cfg
    try:
        trained = from_dict(saved)
    except (ValueError, TypeError, KeyError) as e:
        raise ModelError(f"{str(ckpt)!r}: its training config is damaged ({_first(e)})") from None
    if trained.fingerprint() != cfg.fingerprint():
        fields = cfg.differing_fields(saved)
        diff = ", ".join(f"{f} {saved.get(f)!r} in the checkpoint, {getattr(cfg, f, None)!r} in config.json"
                         for f in fields[:4])  # fmt: skip
        raise ModelError(
            f"{str(ckpt)!r} was trained under another config than the run folder's config.json ({diff or 'fingerprint'}); "
            "the folder was edited after training: restore its config.json"
        )
    return trained


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
