"""The checks of :class:`~posenc.compare.CompareConfig` beyond each field's own declaration,
and the parsers of ``posenc compare``'s list and mapping flags.

A config reaches a comparison from the command line, from a ``--config`` file, from
:func:`~posenc.compare.from_dict` or from Python; each path ends in
:meth:`CompareConfig.validate`, which calls :func:`check_fields` (every field's declared type
and range, :mod:`posenc.fields`, then the fields that go together) and :func:`check_models`
(the names of the compared models, checked before any of them becomes a file name). Every error
is one ``ValueError`` naming the field, the value and what is allowed.

The flag parsers (``--encodings``, ``--encoding-options``, ``--eval-lens``) are the ``flag=`` of
those fields' declarations: ``argparse`` ``type`` functions that follow the one list rule
(:func:`posenc.fields.split_list`) and raise :class:`argparse.ArgumentTypeError` naming the value.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from ..fields import check, split_list

__all__ = [
    "ATTENTION_DEFAULTS",
    "COUNT",
    "MAX_LEN",
    "MODEL_NAME",
    "MODEL_NAME_RULE",
    "PAPER_DEFAULTS",
    "SCHEDULES",
    "SCHEDULE_DEFAULTS",
    "check_attention_fields",
    "check_encodings",
    "check_fields",
    "check_models",
    "check_paper_fields",
    "check_schedule_fields",
    "check_task_lengths",
    "eval_lens_flag",
    "model_names",
    "parse_encoding_options",
    "parse_named",
    "split_encodings",
]

# The longest sequence or position range a comparison may ask for (train_len, eval_lens,
# max_pos): 2^20 tokens. Position tables are allocated up to it (a learned table of
# max_pos x D floats), so an absurd value is refused here instead of by the allocator.
MAX_LEN = 2**20
COUNT = 2**31 - 1  # steps, tokens, samples: anything larger is a typo, not a budget

# A model name becomes a file name (<out>/checkpoints/<NAME>.pt): one safe path component.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
MODEL_NAME_RULE = "letters, digits and . _ + -, starting with a letter or digit, at most 64 characters"


def check_fields(cfg: Any) -> None:
    """Raise ``ValueError`` for a field of the wrong type or outside its declared range, then
    for fields whose values do not go together (``dim`` and ``heads``, ``stride`` and ``sliding``)."""
    check(cfg, none="unset")
    _check_sliding(cfg)
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
    """``ValueError`` unless ``kv_heads`` is at most ``heads`` and divides it."""
    if cfg.kv_heads is not None and (cfg.kv_heads > cfg.heads or cfg.heads % cfg.kv_heads):
        raise ValueError(f"kv_heads must be an int in [1, heads={cfg.heads}] that divides heads, got {cfg.kv_heads!r}")


# The learning-rate schedules of a comparison: cosine (posenc.train.cosine_schedule) or
# warmup-stable-decay with a linear or 1 - sqrt cooldown (posenc.train.wsd_schedule).
SCHEDULES = ("cosine", "wsd", "wsd-sqrt")
# The schedule fields with their defaults: left out of to_dict while they keep them, so
# configs and fingerprints written before they existed stay the same.
SCHEDULE_DEFAULTS: dict[str, Any] = {"schedule": "cosine", "decay_fraction": 0.2}


def check_schedule_fields(cfg) -> None:
    """``ValueError`` naming a cooldown share given to the cosine."""
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
    """``ValueError`` naming paper fields that do not go together (a tokens-per-update mismatch,
    a data source given twice); their types and ranges are declared."""
    if cfg.fsdp and cfg.val_points:
        raise ValueError(
            f"fsdp evaluates once, after training, from the gathered weights: val_points must be 0, got {cfg.val_points}"
        )
    c = cfg.adaptive_cutoffs
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


# ============================================================================ flag parsers
def parse_encoding_options(s: str) -> dict[str, dict[str, Any]]:
    """``"t5.max_distance=64,rope.base=500"`` -> ``{"t5": {"max_distance": 64}, "rope": {"base": 500}}``;
    a JSON value keeps its commas (``rope.rope_scaling={"rope_type":"yarn","factor":4}``)."""
    out: dict[str, dict[str, Any]] = {}
    for item in split_list(s, "comma-separated ENCODING.OPTION=VALUE items", json=True):
        key, sep, raw = item.partition("=")
        name, dot, opt = key.partition(".")
        if not (sep and dot and name and opt):
            raise argparse.ArgumentTypeError(f"expected ENCODING.OPTION=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare string
        out.setdefault(name, {})[opt] = value
    return out


def split_encodings(s: str) -> list[str]:
    """``"rope,irope=rope*3,nope;alibi"`` -> ``["rope", "irope=rope*3,nope", "alibi"]``: a
    ``NAME=PATTERN`` entry runs to the next ``;`` (or the end), other entries end at ``,``;
    an empty entry (``"rope,,alibi"``, ``"rope;"``) is refused, as in every comma list."""
    what = "comma-separated encodings, layer presets or NAME=PATTERN entries (each up to the next ';')"
    out = []
    for part in s.split(";"):
        names = part.split(",")
        for i, item in enumerate(names):
            if "=" in item.split("(")[0]:  # NAME=PATTERN: the rest of this ';' part
                out.append(",".join(names[i:]).strip())
                break
            out.append(item.strip())
    if not all(out):
        raise argparse.ArgumentTypeError(f"expected {what} (none empty), got {s!r}")
    return out


def eval_lens_flag(s: str) -> list[int | str]:
    """``--eval-lens``: ints or multiples of the training length (``4x``: resolved by
    :func:`posenc.compare.config.resolve_eval_lens` once the training length is settled)."""
    what = "comma-separated integers or multiples such as 4x"
    try:
        return [x if re.fullmatch(r"[0-9]+x", x) else int(x) for x in split_list(s, what)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
