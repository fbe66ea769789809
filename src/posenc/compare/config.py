"""The configuration of a comparison: one typed, serialisable dataclass plus presets.

Every field is a command-line option (``--train-len 128``, ``--encodings rope,alibi``,
``--randomized-positions``); a preset fills the fields first, the command line
overrides them, and the final config is written to ``config.json`` next to the
results, so ``posenc compare --config run/config.json`` reproduces a table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..data import TASK_NAMES
from ..extend.methods import EXTEND_METHODS
from ..fields import DROPOUT, SEED, Bool, Choice, Float, Int, ListOf, Map, Str, declared
from ..layer.qk_norm import QK_NORM_POSITIONS, QK_NORMS
from .checks import (
    ATTENTION_DEFAULTS,
    COUNT,
    MAX_LEN,
    PAPER_DEFAULTS,
    SCHEDULE_DEFAULTS,
    SCHEDULES,
    check_attention_fields,
    check_encodings,
    check_fields,
    check_models,
    check_paper_fields,
    check_schedule_fields,
    check_task_lengths,
    eval_lens_flag,
    model_names,
    parse_encoding_options,
    parse_named,
    split_encodings,
)

__all__ = [
    "CompareConfig", "PRESETS", "CORE_ENCODINGS", "EXTEND_METHODS", "from_dict", "preset_config", "register_preset",
    "register_task_defaults", "resolve_eval_lens",
]  # fmt: skip

# The seven encodings of the core: what `posenc compare` trains by default.
CORE_ENCODINGS = ["nope", "learned", "sinusoidal", "rope", "alibi", "t5", "shaw"]


@dataclass
class CompareConfig:
    """Everything that decides a comparison's numbers.

    Each field declares its type and range once (:mod:`posenc.fields`): :meth:`validate` checks
    them, and ``posenc compare`` makes each field a flag of that type. Lengths of synthetic tasks
    (``train_len``, ``eval_lens``, ``max_pos``) count problem size ``n`` (items), not tokens;
    see :mod:`posenc.data.tasks`.
    """

    # ---- what to compare
    encodings: list[str] = ListOf(Str(), flag=split_encodings).field(CORE_ENCODINGS)  # or ["all"]
    preset: str = Choice(lambda: sorted(PRESETS), what="preset").field("quick")

    # ---- data: the embedded corpus unless text / dataset / task / data_dir is given
    text: str | None = Str(optional=True).field(None)  # a UTF-8 file
    dataset: str | None = Str(optional=True).field(None)  # a Hugging Face dataset name (optional `datasets` package)
    dataset_config: str | None = Str(optional=True).field(None)
    dataset_split: str = Str().field("train")
    dataset_field: str = Str().field("text")
    # copy | reverse | sort | associative-recall | grid | passkey | count | flip-flop | kaz-*
    task: str | None = Choice(TASK_NAMES, what="task", optional=True).field(None)
    data_dir: str | None = Str(optional=True).field(None)  # WikiText-103 word-level: wiki.{train,valid,test}.tokens
    val_fraction: float = Float(0, 1, lo_open=True, hi_open=True).field(0.1)

    # ---- model: the same for every encoding
    dim: int = Int(1, 65536).field(64)  # D
    depth: int = Int(1, 1024).field(2)  # blocks
    heads: int = Int(1, 65536).field(8)  # H: 8 heads of 8 dims (docs/compare.md, "Converged within the budget")
    kv_heads: int | None = Int(1, 65536, optional=True).field(None)  # grouped-query k/v heads dividing heads
    mlp_ratio: float = Float(0, 64, lo_open=True).field(4.0)  # MLP width / D
    dropout: float = DROPOUT.field(0.0)
    attn_dropout: float = DROPOUT.field(0.0)  # on the attention probabilities (fairseq's attention_dropout)
    activation_dropout: float = DROPOUT.field(0.0)  # after the MLP's activation (fairseq's activation_dropout)
    tie_embeddings: bool = Bool().field(False)
    # Token embeddings N(0, embed_std^2). 1.0 matches unit-amplitude sinusoidal positions
    # (Vaswani et al. scale N(0, 1/D) embeddings by sqrt(D)); GPT-2's 0.02 lets the
    # sinusoids drown the tokens, and the sinusoidal model then stays at unigram loss.
    embed_std: float = Float(0, 100, lo_open=True).field(1.0)
    final_norm: bool = Bool().field(True)  # False: pre-norm without a final norm
    # adaptive input + softmax bands (word-level vocabularies)
    adaptive_cutoffs: list[int] | None = ListOf(Int(1), increasing=True, optional=True).field(None)
    qk_norm: str | None = Choice(QK_NORMS, optional=True).field(None)  # posenc.layer.qk_norm
    qk_norm_position: str = Choice(QK_NORM_POSITIONS).field("before")  # before | after the q/k stage
    score_scale: float | None = Float(0, lo_open=True, optional=True).field(None)  # replaces Dh^-1/2
    softcap: float | None = Float(0, lo_open=True, optional=True).field(None)  # tanh soft-capping c*tanh(s/c)
    # per-encoding options, e.g. {"t5": {"max_distance": 64}, "rope": {"base": 500.0}}
    encoding_options: dict[str, dict[str, Any]] = Map(
        what="a dict of encoding names to dicts of options", flag=parse_encoding_options
    ).field({})

    # ---- training
    train_len: int = Int(1, MAX_LEN).field(64)
    steps: int = Int(1, COUNT).field(1600)
    batch_size: int = Int(1, 65536).field(32)
    tokens_per_update: int | None = Int(1, COUNT, optional=True).field(None)  # = batch_size x train_len, fixed
    micro_batch: int | None = Int(1, COUNT, optional=True).field(None)  # per process per forward; None: batch / W
    lr: float = Float(0, 100, lo_open=True).field(1e-2)
    # linear warmup steps (preset_config cuts a preset's own to `steps`)
    warmup: int = Int(0, COUNT, at_most="steps", note="a longer warmup never reaches the peak lr").field(100)
    min_lr_ratio: float = Float(0, 1).field(0.0)  # the decay ends at lr * min_lr_ratio
    schedule: str = Choice(SCHEDULES).field("cosine")  # warmup-stable-decay: posenc.train.wsd_schedule
    decay_fraction: float = Float(0, 1, lo_open=True).field(0.2)  # wsd: the cooldown's share of the steps
    weight_decay: float = Float(0, 100).field(0.01)
    grad_clip: float = Float(0, 1e9).field(1.0)
    seeds: list[int] = ListOf(SEED, distinct=True).field([0])  # one model per encoding and seed
    randomized_positions: bool = Bool().field(False)  # Ruoss et al. 2023
    max_pos: int | None = Int(1, MAX_LEN, optional=True).field(None)  # L_max of randomized positions
    packed: bool = Bool().field(False)  # packed documents (document_ids; positions restart per document)
    device: str = Choice(("auto", "cpu", "cuda")).field("auto")
    dtype: str = Choice(("float32", "bfloat16")).field("float32")  # bfloat16: autocast
    compile: bool = Bool().field(False)  # torch.compile the training step (docs/compare.md: when it pays)
    fsdp: bool = Bool().field(False)  # under torchrun: shard weights, gradients, optimizer state (FSDP2)

    # ---- evaluation
    eval_lens: list[int] = ListOf(Int(1, MAX_LEN), flag=eval_lens_flag).field([64, 128, 256, 512])
    eval_tokens: int = Int(1, COUNT).field(16384)  # scored tokens per evaluation length (text)
    eval_samples: int = Int(1, COUNT).field(256)  # problems per evaluation length (tasks)
    eval_batch_size: int = Int(1, 65536).field(16)
    sliding: bool = Bool().field(False)  # sliding windows instead of non-overlapping ones
    stride: int | None = Int(1, MAX_LEN, optional=True).field(None)  # sliding stride; None: half the window
    position_buckets: int = Int(1, 65536).field(16)
    # convergence: the validation loss at the training length after every 1/val_points of
    # the steps (the evaluation's own windows or problems; 0: only at the end)
    val_points: int = Int(0, 100_000, at_most="steps", note="one validation point after every step at most").field(5)
    # inference-time context extension of the trained rotary models (posenc.compare.extend)
    extend: list[str] | None = ListOf(Choice(EXTEND_METHODS, what="method"), optional=True).field(None)

    # ---- bookkeeping
    checkpoint_every: int = Int(1, COUNT).field(100)  # steps; a checkpoint is also written after each encoding
    workers: int = Int(0, 4096).field(0)  # CPU processes training models side by side (1 thread each); 0: per core
    shard: str | None = Str(optional=True).field(None)  # "i/n": this job runs encodings i, i+n, ... (1-based)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field and its allowed range (types included:
        a ``--config`` file's ``"steps": true`` is refused, not read as 1)."""
        check_fields(self)  # every field's declaration, then the fields that go together
        # passkey draws its filler from the text or dataset named (the embedded corpus by default)
        task = None if self.task == "passkey" else self.task
        sources = [n for n, v in (("text", self.text), ("dataset", self.dataset), ("task", task)) if v]
        if len(sources) > 1:
            raise ValueError(f"give at most one data source, got {sources}")
        if self.dataset_config is not None and self.dataset is None:
            raise ValueError(
                f"dataset_config applies to a dataset only, and none is given (got {self.dataset_config!r})"
            )
        check_task_lengths(self)
        if self.task == "grid" and self.randomized_positions:
            raise ValueError("randomized_positions draws 1-D positions; the grid task has 2-D ones")
        if self.packed and (self.task is not None or self.randomized_positions):
            raise ValueError(
                "packed needs a text source and positions that restart per document; got "
                + ("task=" + repr(self.task) if self.task is not None else "randomized_positions=True")
            )
        if self.max_pos is not None and self.max_pos < self.train_len:
            raise ValueError(f"max_pos must be >= train_len={self.train_len}, got {self.max_pos}")
        if self.shard is not None:
            parse_shard(self.shard)
        if self.encodings != ["all"]:
            check_models(self.encoding_names(), self.named_patterns())
        check_paper_fields(self)
        check_attention_fields(self)
        check_schedule_fields(self)
        check_encodings(self)  # every model builds: names, patterns and option values

    def named_patterns(self) -> dict[str, str]:
        """``{name: layer pattern}`` of the ``NAME=PATTERN`` entries of :attr:`encodings`."""
        return parse_named(self.encodings)

    def encoding_names(self) -> list[str]:
        """The names of the compared models: encodings, presets, and the names of named patterns."""
        return model_names(self.encodings)

    # fields that do not change any model's numbers: how often to checkpoint, which shard
    # of the encodings this process runs, how many worker processes, and the lists of
    # encodings and seeds themselves (a model's training depends on its own encoding and
    # seed, not on which others share the run); nor does `extend`: it evaluates the
    # trained models once more, with other options
    BOOKKEEPING = ("checkpoint_every", "shard", "encodings", "seeds", "workers", "extend")

    def fingerprint(self) -> str:
        """A short hash of every field that decides the numbers (all but :attr:`BOOKKEEPING`).

        Every checkpoint and ``results.json`` records it; ``--resume`` refuses a run folder
        whose checkpoints carry another.
        """
        d = {k: v for k, v in self.to_dict().items() if k not in self.BOOKKEEPING}
        named = self.named_patterns()
        if named:  # what each NAME stands for decides its numbers (absent: old fingerprints hold)
            d["named_patterns"] = named
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def differing_fields(self, other: dict[str, Any]) -> list[str]:
        """Fields (other than bookkeeping) whose value differs from ``other`` (a saved config dict)."""
        mine = self.to_dict()
        out = {k for k in set(mine) | set(other) if k not in self.BOOKKEEPING and mine.get(k) != other.get(k)}
        try:
            theirs = parse_named(other.get("encodings") or [])
        except (ValueError, TypeError, AttributeError):
            theirs = None
        if theirs != self.named_patterns():  # a NAME now stands for another pattern
            out.add("encodings")
        return sorted(out)

    @property
    def eval_lens_sorted(self) -> list[int]:
        return sorted(set(self.eval_lens))

    def to_dict(self) -> dict[str, Any]:
        """Every field, but the paper preset's and the attention fields at their defaults
        (:data:`PAPER_DEFAULTS`, :data:`ATTENTION_DEFAULTS`) and the schedule's
        (:data:`SCHEDULE_DEFAULTS`): a config without them is written, fingerprinted and
        compared as before they existed."""
        d = asdict(self)
        for k, v in {**PAPER_DEFAULTS, **ATTENTION_DEFAULTS, **SCHEDULE_DEFAULTS}.items():
            if d[k] == v:
                del d[k]
        return {k: d[k] for k in sorted(d, key=lambda k: _WRITTEN.get(k, len(_WRITTEN)))}

    def save(self, path: str | Path) -> None:
        from ..output import write_json

        write_json(path, self.to_dict())


# config.json's order of the fields, the order they were added in (the source groups them by
# part): to_dict keeps it, so a config is written as before; a new field goes after these.
_WRITTEN = {k: i for i, k in enumerate((
    "encodings", "preset", "text", "dataset", "dataset_config", "dataset_split", "dataset_field", "task",
    "val_fraction", "dim", "depth", "heads", "mlp_ratio", "dropout", "tie_embeddings", "embed_std",
    "encoding_options", "train_len", "steps", "batch_size", "lr", "warmup", "min_lr_ratio", "schedule",
    "decay_fraction", "weight_decay", "grad_clip", "seeds", "device", "dtype", "compile", "randomized_positions",
    "max_pos", "packed", "eval_lens", "eval_tokens", "eval_samples", "eval_batch_size", "sliding", "stride",
    "position_buckets", "val_points", "extend", "checkpoint_every", "workers", "shard", "data_dir",
    "tokens_per_update", "micro_batch", "final_norm", "adaptive_cutoffs", "fsdp", "kv_heads", "qk_norm",
    "qk_norm_position", "score_scale", "softcap", "attn_dropout", "activation_dropout",
))}  # fmt: skip
# int fields bounded by steps (at_most="steps"): a preset's value is cut to a shorter run's
# steps (preset_config), a value given is refused
AT_MOST_STEPS = tuple(k for k, d in declared(CompareConfig).items() if getattr(d, "at_most", None) == "steps")


def from_dict(d: dict[str, Any]) -> CompareConfig:
    """A config from :meth:`CompareConfig.to_dict` output; unknown keys are a ``ValueError``.

    A config written before ``seeds`` existed (``"seed": k``) reads as ``seeds=[k]``.
    """
    d = dict(d)
    if "seed" in d and "seeds" not in d:
        d["seeds"] = [d.pop("seed")]
    names = {f.name for f in fields(CompareConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown}; valid: {sorted(names)}")
    return CompareConfig(**d)


def resolve_eval_lens(lens: list[int | str], train_len: int) -> list[int]:
    """Evaluation lengths with multiples of the training length resolved: ``"4x"`` is
    ``4 * train_len`` (Press et al. 2022's Table 5 evaluates at 1x .. 48x the training length).

    Raises:
        ValueError: an item is neither an int nor ``"<N>x"`` with ``N >= 1``.
    """
    out = []
    for x in lens:
        if isinstance(x, str) and x.endswith("x") and x[:-1].isdigit() and int(x[:-1]) >= 1:
            out.append(int(x[:-1]) * train_len)
        elif isinstance(x, int) and not isinstance(x, bool):
            out.append(x)
        else:
            raise ValueError(f"eval_lens items must be ints or multiples of train_len such as '4x' (N >= 1), got {x!r}")
    return out


def parse_shard(shard: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)`` with ``1 <= i <= n``."""
    try:
        i, n = (int(p) for p in shard.split("/"))
    except ValueError:
        raise ValueError(f"shard must look like i/n (e.g. 1/4), got {shard!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"shard i/n needs 1 <= i <= n, got {shard!r}")
    return i, n


# Presets: field overrides on top of the dataclass defaults (which are the quick preset's).
# `quick` is the default command's budget (<= 5 min on 2 CPU cores for the core seven,
# trained close to convergence: docs/compare.md has the study behind its numbers);
# `standard` is a real run for a GPU or a patient CPU. "tasks" holds a preset's settings
# for the synthetic tasks, passkey and each paper task that has its own entry, applied when
# --task is given (before the command line's own values). The paper studies add theirs
# (posenc.studies: `paper`, and the quick preset's entries for count, flip-flop and kaz-*)
# through register_preset and register_task_defaults.
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        # T5's log buckets reach max_distance=128 by default; trained at 64, the buckets of
        # distances 64..127 would never be trained. Press et al. trained at 512 >= 128, so
        # every bucket was; max_distance = the training length keeps that regime.
        "encoding_options": {"t5": {"max_distance": 64}},
        "tasks": {
            # Kazemnejad et al.'s regime scaled down: sizes up to 16 items (32 tokens), tested to 4x
            "synthetic": {
                "train_len": 16,
                "eval_lens": [8, 16, 32, 64],
                "steps": 3000,
                "encoding_options": {"t5": {"max_distance": 32}},
            },
            # the text budget (1 600 steps at 64 tokens) at half the text lr: at 1e-2 ALiBi's
            # seed-0 model stopped on a 68 % plateau; at 5e-3 all 21 models of the core seven
            # x seeds 0-2 reach >= 99.7 % at the training length (docs/compare.md)
            "passkey": {"eval_samples": 64, "lr": 5e-3},
        },  # fmt: skip
    },
    "standard": dict(
        dim=256,
        depth=4,
        heads=8,  # model
        train_len=256,
        steps=3000,
        batch_size=32,
        lr=1e-3,
        warmup=200,
        checkpoint_every=500,  # training
        eval_lens=[256, 512, 1024, 2048, 4096],
        eval_tokens=131072,  # evaluation
    ),  # fmt: skip
}


def register_preset(name: str, settings: dict[str, Any]) -> None:
    """Add preset ``name``: field overrides on the dataclass defaults, and under ``"tasks"``
    its settings per task (as :data:`PRESETS`' entries). A study of :mod:`posenc.studies`
    calls it when imported (``posenc.compare`` imports them all).

    Raises:
        ValueError: ``name`` is already a preset with other settings.
    """
    if PRESETS.setdefault(name, settings) != settings:
        raise ValueError(f"preset {name!r} is already registered with other settings")


def register_task_defaults(preset: str, tasks: dict[str, dict[str, Any]]) -> None:
    """Add ``preset``'s settings for each task of ``tasks`` (``{task: field overrides}``,
    applied when ``--task`` names it): a study's own budgets for its tasks.

    Raises:
        ValueError: a task already has other settings in ``preset``.
    """
    known = PRESETS[preset].setdefault("tasks", {})
    for task, settings in tasks.items():
        if known.setdefault(task, settings) != settings:
            raise ValueError(f"preset {preset!r} already has other settings for task {task!r}")


def preset_config(preset: str, **overrides: Any) -> CompareConfig:
    """The preset's config (with its settings for ``overrides["task"]``, if a task is
    given) with ``overrides`` applied on top."""
    declared(CompareConfig)["preset"].check("preset", preset)
    base = {
        f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
        for f in fields(CompareConfig)
    }
    preset_fields = dict(PRESETS[preset])
    by_task = preset_fields.pop("tasks", {})
    task = overrides.get("task")
    if task is not None:  # the preset's settings for this task (its lengths and budget)
        preset_fields.update(by_task.get(task, by_task.get("synthetic", {})))
    preset_options = preset_fields.pop("encoding_options", {})
    base.update(preset_fields)
    user_options = overrides.pop("encoding_options", None) or {}
    base.update(overrides)
    for name in AT_MOST_STEPS:  # the preset's warmup and validation points, cut to a shorter run
        if name not in overrides and all(isinstance(base[k], int) for k in (name, "steps")):
            base[name] = min(base[name], base["steps"])
    base["preset"] = preset
    # per-encoding options merge per key: the preset's first, the user's on top; the
    # preset's options for encodings that are not compared are dropped
    compared = None if base["encodings"] == ["all"] else set(base["encodings"])
    merged = {k: dict(v) for k, v in preset_options.items() if compared is None or k in compared}
    for name, opts in user_options.items():
        merged.setdefault(name, {}).update(opts)
    base["encoding_options"] = merged
    return CompareConfig(**base)
