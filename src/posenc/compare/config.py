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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..data import TASK_NAMES
from ..extend.methods import EXTEND_METHODS
from .checks import (
    AT_MOST_STEPS,
    ATTENTION_DEFAULTS,
    PAPER_DEFAULTS,
    SCHEDULE_DEFAULTS,
    check_attention_fields,
    check_encodings,
    check_fields,
    check_models,
    check_paper_fields,
    check_schedule_fields,
    check_task_lengths,
    model_names,
    parse_named,
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

    Lengths of synthetic tasks (``train_len``, ``eval_lens``, ``max_pos``) count
    problem size ``n`` (items), not tokens; see :mod:`posenc.data.tasks`.
    """

    # what to compare
    encodings: list[str] = field(default_factory=lambda: list(CORE_ENCODINGS))  # or ["all"]
    preset: str = "quick"
    # data: the embedded corpus unless text / dataset / task is given
    text: str | None = None  # a UTF-8 file
    dataset: str | None = None  # a Hugging Face dataset name (optional `datasets` package)
    dataset_config: str | None = None
    dataset_split: str = "train"
    dataset_field: str = "text"
    task: str | None = None  # copy | reverse | sort | associative-recall | grid | passkey | count | flip-flop | kaz-*
    val_fraction: float = 0.1
    # model: the same for every encoding
    dim: int = 64  # D
    depth: int = 2  # blocks
    heads: int = 8  # H: 8 heads of 8 dims (docs/compare.md, "Converged within the budget": why not 4 of 16)
    mlp_ratio: float = 4.0  # MLP width / D
    dropout: float = 0.0
    tie_embeddings: bool = False
    # Token embeddings N(0, embed_std^2). 1.0 matches unit-amplitude sinusoidal positions
    # (Vaswani et al. scale N(0, 1/D) embeddings by sqrt(D)); GPT-2's 0.02 lets the
    # sinusoids drown the tokens, and the sinusoidal model then stays at unigram loss.
    embed_std: float = 1.0
    # per-encoding options, e.g. {"t5": {"max_distance": 64}, "rope": {"base": 500.0}}
    encoding_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    # training
    train_len: int = 64
    steps: int = 1600
    batch_size: int = 32
    lr: float = 1e-2
    warmup: int = 100  # linear warmup steps (at most `steps`; preset_config cuts its own to `steps`)
    min_lr_ratio: float = 0.0  # the decay ends at lr * min_lr_ratio
    schedule: str = "cosine"  # cosine | wsd | wsd-sqrt (warmup-stable-decay; posenc.train.wsd_schedule)
    decay_fraction: float = 0.2  # wsd: the cooldown's share of the steps
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seeds: list[int] = field(default_factory=lambda: [0])  # one model per encoding and seed
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # float32 | bfloat16 (autocast)
    compile: bool = False  # torch.compile the training step (see docs/compare.md for when it pays)
    randomized_positions: bool = False  # Ruoss et al. 2023
    max_pos: int | None = None  # L_max for randomized positions; None: the longest eval length
    packed: bool = False  # train on packed documents (document_ids; positions restart per document)
    # evaluation
    eval_lens: list[int] = field(default_factory=lambda: [64, 128, 256, 512])
    eval_tokens: int = 16384  # scored tokens per evaluation length (text)
    eval_samples: int = 256  # problems per evaluation length (tasks)
    eval_batch_size: int = 16
    sliding: bool = False  # sliding windows instead of non-overlapping ones
    stride: int | None = None  # sliding stride; None: half the window
    position_buckets: int = 16
    # convergence: the validation loss at the training length after every 1/val_points of
    # the steps (the evaluation's own windows or problems; 0: only at the end)
    val_points: int = 5
    # inference-time context extension of the trained rotary models (posenc.compare.extend)
    extend: list[str] | None = None  # e.g. ["none", "yarn", "rerope", "self-extend"]
    # bookkeeping
    checkpoint_every: int = 100  # steps; a checkpoint is also written after each encoding
    workers: int = 0  # CPU processes training models side by side (1 thread each); 0: one per core
    shard: str | None = None  # "i/n": this job runs encodings i, i+n, ... (1-based)
    # word-level, multi-process runs (the paper preset's: posenc.studies.press2022; their defaults
    # leave older runs unchanged)
    data_dir: str | None = None  # WikiText-103 word-level: wiki.{train,valid,test}.tokens
    tokens_per_update: int | None = None  # must equal batch_size x train_len; fixed whatever the processes
    micro_batch: int | None = None  # sequences per process per forward (accumulation); None: batch_size / W
    final_norm: bool = True  # False: pre-norm without a final norm
    adaptive_cutoffs: list[int] | None = None  # adaptive input + softmax bands (word-level vocabularies)
    fsdp: bool = False  # under torchrun: shard weights, gradients and optimizer state (FSDP2) instead of DDP
    # attention as today's models have it (posenc.Attention; defaults leave older runs unchanged)
    kv_heads: int | None = None  # grouped-query k/v heads (1: multi-query); None: heads
    qk_norm: str | None = None  # rms | gemma-rms | l2 (posenc.qk_norm)
    qk_norm_position: str = "before"  # before | after the q/k stage
    score_scale: float | None = None  # replaces the Dh^-1/2 factor of every encoding's score scale
    softcap: float | None = None  # tanh logit soft-capping c*tanh(s/c) (Gemma 2)
    attn_dropout: float = 0.0  # dropout on the attention probabilities (fairseq's attention_dropout)
    activation_dropout: float = 0.0  # dropout after the MLP's activation (fairseq's activation_dropout)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field and its allowed range (types included:
        a ``--config`` file's ``"steps": true`` is refused, not read as 1)."""
        check_fields(self)  # every field's type and range (posenc.compare.checks)
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if not self.encodings:
            raise ValueError("encodings must name at least one encoding (or 'all')")
        # passkey draws its filler from the text or dataset named (the embedded corpus by default)
        task = None if self.task == "passkey" else self.task
        sources = [n for n, v in (("text", self.text), ("dataset", self.dataset), ("task", task)) if v]
        if len(sources) > 1:
            raise ValueError(f"give at most one data source, got {sources}")
        if self.dataset_config is not None and self.dataset is None:
            raise ValueError(
                f"dataset_config applies to a dataset only, and none is given (got {self.dataset_config!r})"
            )
        if self.task is not None and self.task not in TASK_NAMES:
            raise ValueError(f"task must be one of {TASK_NAMES}, got {self.task!r}")
        check_task_lengths(self)
        if self.task == "grid" and self.randomized_positions:
            raise ValueError("randomized_positions draws 1-D positions; the grid task has 2-D ones")
        if self.packed and (self.task is not None or self.randomized_positions):
            raise ValueError(
                "packed needs a text source and positions that restart per document; got "
                + ("task=" + repr(self.task) if self.task is not None else "randomized_positions=True")
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.max_pos is not None and self.max_pos < self.train_len:
            raise ValueError(f"max_pos must be >= train_len={self.train_len}, got {self.max_pos}")
        if self.shard is not None:
            parse_shard(self.shard)
        if self.extend is not None:
            bad = [m for m in self.extend if m not in EXTEND_METHODS] if isinstance(self.extend, list) else self.extend
            if bad or not self.extend:
                raise ValueError(f"extend must list methods of {', '.join(EXTEND_METHODS)}, got {self.extend!r}")
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
        return d

    def save(self, path: str | Path) -> None:
        from ..output import write_json

        write_json(path, self.to_dict())


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
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
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
