"""Every field of :class:`~posenc.compare.CompareConfig` checked for its type and range, and
the names of the compared models checked before any of them becomes a file name.

A config reaches a comparison from the command line, from a ``--config`` file, from
:func:`~posenc.compare.from_dict` or from Python; each path ends in
:meth:`CompareConfig.validate`, which calls :func:`check_fields` and :func:`check_models`.
Every error is one ``ValueError`` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..qk_norm import QK_NORM_POSITIONS, QK_NORMS

__all__ = [
    "ATTENTION_DEFAULTS",
    "AT_MOST_STEPS",
    "MAX_LEN",
    "MODEL_NAME",
    "MODEL_NAME_RULE",
    "PAPER_DEFAULTS",
    "SCHEDULES",
    "SCHEDULE_DEFAULTS",
    "check_attention_fields",
    "check_fields",
    "check_models",
    "check_paper_fields",
    "check_schedule_fields",
    "check_task_lengths",
    "model_names",
    "parse_named",
]

# The longest sequence or position range a comparison may ask for (train_len, eval_lens,
# max_pos): 2^20 tokens. Position tables are allocated up to it (a learned table of
# max_pos x D floats), so an absurd value is refused here instead of by the allocator.
MAX_LEN = 2**20

# A model name becomes a file name (<out>/checkpoints/<NAME>.pt): one safe path component.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
MODEL_NAME_RULE = "letters, digits and . _ + -, starting with a letter or digit, at most 64 characters"

_COUNT = 2**31 - 1  # steps, tokens, samples: anything larger is a typo, not a budget
# int fields: (lowest, highest) allowed; None in the config allowed for those in _OPTIONAL
_INTS: dict[str, tuple[int, int]] = {
    "dim": (1, 65536), "depth": (1, 1024), "heads": (1, 65536), "train_len": (1, MAX_LEN),
    "steps": (1, _COUNT), "batch_size": (1, 65536), "warmup": (0, _COUNT), "max_pos": (1, MAX_LEN),
    "eval_tokens": (1, _COUNT), "eval_samples": (1, _COUNT), "eval_batch_size": (1, 65536),
    "stride": (1, MAX_LEN), "position_buckets": (1, 65536), "val_points": (0, 100000),
    "checkpoint_every": (1, _COUNT), "workers": (0, 4096),
}  # fmt: skip
# float fields: (low, high, low included, high included)
_FLOATS: dict[str, tuple[float, float, bool, bool]] = {
    "val_fraction": (0.0, 1.0, False, False), "mlp_ratio": (0.0, 64.0, False, True),
    "dropout": (0.0, 1.0, True, False), "attn_dropout": (0.0, 1.0, True, False),
    "activation_dropout": (0.0, 1.0, True, False), "embed_std": (0.0, 100.0, False, True), "lr": (0.0, 100.0, False, True),
    "min_lr_ratio": (0.0, 1.0, True, True), "decay_fraction": (0.0, 1.0, False, True), "weight_decay": (0.0, 100.0, True, True),
    "grad_clip": (0.0, 1e9, True, True),
}  # fmt: skip
_BOOLS = ("tie_embeddings", "compile", "randomized_positions", "packed", "sliding")
_STRS = ("preset", "dataset_split", "dataset_field", "device", "dtype", "schedule")
_OPTIONAL_STRS = ("text", "dataset", "dataset_config", "task", "shard")
_OPTIONAL = ("max_pos", "stride")
_SEED_MAX = 2**31 - 1
# int fields bounded by steps, with why: a preset's value is cut to a shorter run's steps
# (preset_config), a value given is refused
AT_MOST_STEPS: dict[str, str] = {
    "warmup": "a longer warmup never reaches the peak lr",
    "val_points": "one validation point after every step at most",
}


def _interval(lo: float, hi: float, lo_in: bool, hi_in: bool) -> str:
    return f"{'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_fields(cfg: Any) -> None:
    """Raise ``ValueError`` for a field of the wrong type or outside its range."""
    for name, (lo, hi) in _INTS.items():
        v = getattr(cfg, name)
        if v is None and name in _OPTIONAL:
            continue
        if not _is_int(v) or not lo <= v <= hi:
            raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {v!r}")
    for name, why in AT_MOST_STEPS.items():
        if getattr(cfg, name) > cfg.steps:
            raise ValueError(f"{name} must be an int in [0, steps={cfg.steps}] ({why}), got {getattr(cfg, name)!r}")
    for name, (lo, hi, lo_in, hi_in) in _FLOATS.items():
        v = getattr(cfg, name)
        ok = (_is_int(v) or isinstance(v, float)) and math.isfinite(v)
        if not (ok and (lo <= v if lo_in else lo < v) and (v <= hi if hi_in else v < hi)):
            raise ValueError(f"{name} must be a finite number in {_interval(lo, hi, lo_in, hi_in)}, got {v!r}")
    for name in _BOOLS:
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(cfg, name)!r}")
    for name in _STRS + _OPTIONAL_STRS:
        v = getattr(cfg, name)
        if not (isinstance(v, str) and v.strip()) and not (v is None and name in _OPTIONAL_STRS):
            raise ValueError(f"{name} must be a non-empty string, got {v!r}")
    seeds = cfg.seeds
    if not isinstance(seeds, list) or not seeds or any(not _is_int(s) or not 0 <= s <= _SEED_MAX for s in seeds):
        raise ValueError(f"seeds must be a non-empty list of ints >= 0 (at most {_SEED_MAX}), got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct, got {seeds!r}")
    lens = cfg.eval_lens
    if not isinstance(lens, list) or not lens or any(not _is_int(n) or not 1 <= n <= MAX_LEN for n in lens):
        raise ValueError(f"eval_lens must be a non-empty list of ints in [1, {MAX_LEN}], got {lens!r}")
    _check_sliding(cfg)
    v = cfg.encodings  # (extend: CompareConfig.validate checks it against the methods)
    if not isinstance(v, list) or any(not isinstance(x, str) or not x.strip() for x in v):
        raise ValueError(f"encodings must be a list of non-empty strings, got {v!r}")
    opts = cfg.encoding_options
    if not isinstance(opts, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in opts.items()):
        raise ValueError(f"encoding_options must map encoding names to dicts, got {opts!r}")
    if cfg.dim % cfg.heads:
        raise ValueError(
            f"dim must be divisible by heads (each head gets dim / heads dims), got dim={cfg.dim}, heads={cfg.heads}"
        )
    if int(cfg.dim * cfg.mlp_ratio) < 1:
        raise ValueError(f"mlp_ratio x dim must give an MLP at least 1 wide, got {cfg.mlp_ratio!r} x {cfg.dim}")


def _check_sliding(cfg: Any) -> None:
    """``sliding`` evaluates a text's windows, and ``stride`` slides them, each length's by at
    most that length: a larger stride (which the evaluation cuts to the window), a stride
    without ``sliding`` or ``sliding`` on a task's problems would change nothing, and are refused."""
    if cfg.sliding and cfg.task is not None:
        raise ValueError(f"sliding applies to text (windows of a corpus); task {cfg.task} is scored per problem")
    if cfg.stride is None:
        return
    if not cfg.sliding:
        raise ValueError(
            f"stride applies to sliding-window evaluation only, and sliding is off (got stride {cfg.stride})"
        )
    lengths = [(n, "the shortest evaluation length") for n in cfg.eval_lens]
    if cfg.val_points:  # validated at the training length during training
        lengths.append((cfg.train_len, "the training length, validated during training"))
    shortest, what = min(lengths)
    if cfg.stride > shortest:
        raise ValueError(
            f"stride must be an int in [1, {shortest}] ({what}: a longer stride evaluates its windows without "
            f"overlap, as without sliding), got {cfg.stride}"
        )


def check_task_lengths(cfg: Any) -> None:
    """A task's lengths count items (statements, grid sides, digits): each is refused when its
    sequences take more than :data:`MAX_LEN` tokens, the bound a text length has."""
    if cfg.task is None:
        return
    from ..data.lengths import sequence_length

    given = (("train_len", [cfg.train_len]), ("eval_lens", cfg.eval_lens), ("max_pos", [cfg.max_pos]))
    for name, sizes in given:
        for n in sizes:
            if n is not None and (tokens := sequence_length(cfg.task, n)) > MAX_LEN:
                lo, hi = 1, n  # the largest size that fits (sequence lengths grow with the size)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if sequence_length(cfg.task, mid) <= MAX_LEN else (lo, mid - 1)
                raise ValueError(
                    f"{name} {n} of task {cfg.task} makes sequences of {tokens} tokens; allowed: at most {MAX_LEN} "
                    f"tokens (2^20), sizes up to {lo}"
                )


def parse_named(entries: list[str]) -> dict[str, str]:
    """``{NAME: PATTERN}`` of the ``NAME=PATTERN`` entries (a ``=`` before any ``(``)."""
    out: dict[str, str] = {}
    for entry in entries:
        name, sep, pattern = entry.partition("=")
        if sep and "(" not in name:
            if not name.strip() or not pattern.strip():
                raise ValueError(f"encodings entry {entry!r}: expected NAME=PATTERN (e.g. hybrid=rope*3,nope)")
            name = name.strip()
            if name in out:
                raise ValueError(
                    f"encodings name {name!r} twice ({name}={out[name]} and {entry}): each model needs its own name"
                )
            out[name] = pattern.strip()
    return out


def model_names(entries: list[str]) -> list[str]:
    """The model name of each ``encodings`` entry: its ``NAME`` for a ``NAME=PATTERN``, else the entry."""
    named = parse_named(entries)
    return [e.partition("=")[0].strip() if e.partition("=")[0].strip() in named else e for e in entries]


def check_models(names: list[str], named: dict[str, str]) -> None:
    """The model names ``names`` (one per compared model) are distinct, and every ``NAME`` of a
    ``NAME=PATTERN`` entry (``named``) is a safe file name that does not pass itself off as a
    registered encoding or layer preset it is not."""
    from ..patterns import PRESETS, layers
    from ..registry import available

    for name, pattern in named.items():
        if not MODEL_NAME.fullmatch(name):
            raise ValueError(f"encodings entry {name}={pattern}: the name {name!r} must be {MODEL_NAME_RULE}")
        kind = "a registered encoding" if name in available() else "a layer preset" if name in PRESETS else None
        if kind is None:
            continue
        # a name may stand for the very thing it names, with other options (irope=irope(chunk=16))
        mine = [s.encoding for s in layers(name)]
        theirs = [s.encoding for s in layers(pattern)]
        same = set(theirs) == set(mine) if kind == "a registered encoding" else theirs == mine
        if not same:
            raise ValueError(
                f"encodings entry {name}={pattern}: {name!r} is {kind}, and this pattern is not {name}; "
                f"its rows would read as {name}'s: choose another name (e.g. my-{name})"
            )
    seen: dict[str, str] = {}
    for name in names:
        key = name.lower()  # one file on a case-insensitive disk
        if key in seen:
            same = "twice" if seen[key] == name else f"and {seen[key]!r} (names differing only in case)"
            raise ValueError(f"encodings name {name!r} {same}: each compared model needs its own name")
        seen[key] = name


def check_encodings(cfg) -> None:
    """Every compared model can be built as configured, before anything is trained: each name
    is a registered encoding, a layer preset or a ``NAME=PATTERN`` whose pattern fits
    ``cfg.depth``; ``encoding_options`` name compared plain encodings and options they take;
    and every encoding, with its options (a pattern's own included), builds at the run's
    head size, so a bad option *value* (``rope.base=-1``, a NaN) is refused here too.

    Errors start with the field (``encodings`` / ``encoding_options``) so the command line
    names the flag."""
    from ..patterns import is_pattern, layers
    from ..registry import available, build, get_class

    names = available() if cfg.encodings == ["all"] else cfg.encoding_names()
    named = cfg.named_patterns()
    for name in cfg.encoding_options:
        if name not in names:
            raise ValueError(
                f"encoding_options name {name!r}, which is not compared (encodings: {', '.join(sorted(names))})"
            )
        if name in named or is_pattern(name):
            raise ValueError(f"encoding_options for {name!r}, a layer pattern: give its options inside the pattern")
    # unknown options and bad values: the build below refuses them with the valid options named
    size = {"heads": cfg.heads, "head_dim": cfg.dim // cfg.heads, "max_len": cfg.train_len, "causal": True}
    for name in names:
        try:
            if name in named or is_pattern(name):
                specs = layers(named.get(name, name), cfg.depth)  # a bad pattern, or longer than the depth
                built = {(s.encoding, repr(sorted(s.options.items()))): s.options for s in specs}
                for (encoding, _), options in built.items():
                    build(encoding, **size, **options)
            else:
                get_class(name)  # unknown: the message lists the registered names
                build(name, **size, **cfg.encoding_options.get(name, {}))
        except (ValueError, TypeError) as e:
            field = "encoding_options" if name in cfg.encoding_options else "encodings"
            raise ValueError(f"{field} entry {name!r}: {str(e).splitlines()[0]}") from None


# The attention fields of CompareConfig with their defaults: left out of to_dict while they
# keep them, so configs and fingerprints written before they existed stay the same.
ATTENTION_DEFAULTS: dict[str, Any] = {
    "kv_heads": None,
    "qk_norm": None,
    "qk_norm_position": "before",
    "score_scale": None,
    "softcap": None,
    "attn_dropout": 0.0,
    "activation_dropout": 0.0,
}


def check_attention_fields(cfg) -> None:
    """``ValueError`` naming a bad attention field and its allowed values."""
    kv = cfg.kv_heads
    if kv is not None:
        if not isinstance(kv, int) or isinstance(kv, bool) or not 1 <= kv <= cfg.heads or cfg.heads % kv:
            raise ValueError(f"kv_heads must be an int in [1, heads={cfg.heads}] that divides heads, got {kv!r}")
    if cfg.qk_norm is not None and cfg.qk_norm not in QK_NORMS:
        raise ValueError(f"qk_norm must be one of {', '.join(QK_NORMS)} or unset, got {cfg.qk_norm!r}")
    if cfg.qk_norm_position not in QK_NORM_POSITIONS:
        raise ValueError(
            f"qk_norm_position must be one of {', '.join(QK_NORM_POSITIONS)}, got {cfg.qk_norm_position!r}"
        )
    for name in ("score_scale", "softcap"):
        v = getattr(cfg, name)
        ok = v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0)
        if not ok:
            raise ValueError(f"{name} must be a finite number > 0 or unset, got {v!r}")


# The learning-rate schedules of a comparison: cosine (posenc.train.cosine_schedule) or
# warmup-stable-decay with a linear or 1 - sqrt cooldown (posenc.train.wsd_schedule).
SCHEDULES = ("cosine", "wsd", "wsd-sqrt")
# The schedule fields with their defaults: left out of to_dict while they keep them, so
# configs and fingerprints written before they existed stay the same.
SCHEDULE_DEFAULTS: dict[str, Any] = {"schedule": "cosine", "decay_fraction": 0.2}


def check_schedule_fields(cfg) -> None:
    """``ValueError`` naming an unknown schedule, or a cooldown share given to the cosine."""
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}")
    if cfg.schedule == "cosine" and cfg.decay_fraction != SCHEDULE_DEFAULTS["decay_fraction"]:
        raise ValueError(
            f"decay_fraction applies to schedule wsd or wsd-sqrt only, and schedule is cosine "
            f"(got decay_fraction {cfg.decay_fraction!r})"
        )


# The fields of a word-level, multi-process run (the paper preset's: posenc.studies.press2022)
# with their defaults: left out of to_dict while they keep them, so configs and fingerprints
# written before they existed stay the same.
PAPER_DEFAULTS: dict[str, Any] = {
    "data_dir": None,
    "tokens_per_update": None,
    "micro_batch": None,
    "final_norm": True,
    "adaptive_cutoffs": None,
    "fsdp": False,
}


def check_paper_fields(cfg) -> None:
    """``ValueError`` naming a bad paper field (type, range, or a tokens-per-update mismatch)."""
    for name in ("tokens_per_update", "micro_batch"):
        v = getattr(cfg, name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 2**31 - 1):
            raise ValueError(f"{name} must be an int in [1, {2**31 - 1}] or unset, got {v!r}")
    if cfg.data_dir is not None and not (isinstance(cfg.data_dir, str) and cfg.data_dir.strip()):
        raise ValueError(f"data_dir must name a directory, got {cfg.data_dir!r}")
    for name in ("final_norm", "fsdp"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(cfg, name)!r}")
    if cfg.fsdp and cfg.val_points:
        raise ValueError(
            f"fsdp evaluates once, after training, from the gathered weights: val_points must be 0, got {cfg.val_points}"
        )
    c = cfg.adaptive_cutoffs
    if c is not None and not (
        isinstance(c, list) and c and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in c)
        and all(a < b for a, b in zip(c, c[1:]))
    ):  # fmt: skip
        raise ValueError(f"adaptive_cutoffs must be a non-empty list of strictly increasing ints >= 1, got {c!r}")
    if c is not None and cfg.data_dir is None and cfg.task is None and c[-1] >= 256:
        raise ValueError(
            f"adaptive_cutoffs {c} need a word-level vocabulary: give --data-dir DIR (WikiText-103's "
            "wiki.{train,valid,test}.tokens); the byte-level sources have 256 tokens"
        )
    if c is not None and cfg.task is not None:
        raise ValueError(f"adaptive_cutoffs is for a word-level corpus (--data-dir), not --task {cfg.task}")
    if cfg.data_dir is not None:
        other = [n for n in ("text", "dataset", "task") if getattr(cfg, n) is not None]
        if other:
            raise ValueError(f"data_dir is a data source: give it alone, not with {other}")
        if cfg.packed:
            raise ValueError("data_dir reads a word stream without documents: packed does not apply")
    t = cfg.tokens_per_update
    if t is not None and cfg.batch_size * cfg.train_len != t:
        fix = f"--batch-size {t // cfg.train_len}" if t % cfg.train_len == 0 else f"a multiple of {cfg.train_len}"
        raise ValueError(
            f"tokens_per_update must equal batch_size x train_len ({cfg.batch_size} x {cfg.train_len} = "
            f"{cfg.batch_size * cfg.train_len}), got {t}: give {fix}"
        )
    if cfg.micro_batch is not None and cfg.batch_size % cfg.micro_batch:
        raise ValueError(f"micro_batch must divide batch_size={cfg.batch_size}, got {cfg.micro_batch}")
