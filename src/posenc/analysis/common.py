"""Shared pieces of the analyses: which encodings to look at, models to look into, the
attention scores of a layer split by where position entered, and output files.

Every analysis works on a :class:`posenc.TransformerLM`, either freshly initialised
(``random``) or loaded from a checkpoint saved by ``posenc compare`` (or by
:func:`train_tiny`). It only calls the stage interface of the encodings
(``embed``, ``rotate``, ``score_terms``, ``bias``), so an encoding that
registers is analysed without any change here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..backends import scores
from ..base import available, check_lengths
from ..checkpoint import load_checkpoint, save_checkpoint
from ..model import TransformerLM


@dataclass
class Spec:
    """An encoding name with build options, written ``name`` or ``name@{json options}``.

    ``rope@{"base": 500000}`` or ``rope@{"rope_scaling": {"rope_type": "linear", "factor": 4}}``.
    """

    name: str
    options: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return self.name + " " + ",".join(f"{k}={v}" for k, v in self.options.items())

    @property
    def slug(self) -> str:
        """A file name for the spec: ``rope``, ``rope_base=500000``."""
        return "".join(c if c.isalnum() or c in "-=." else "_" for c in self.label).strip("_")

    @classmethod
    def parse(cls, text: str) -> Spec:
        name, sep, opts = text.partition("@")
        if not name:
            raise ValueError(f"encoding spec {text!r} has no name; write name or name@{{json options}}")
        if not sep:
            return cls(name)
        try:
            options = json.loads(opts)
        except json.JSONDecodeError as e:
            raise ValueError(f'options of {text!r} are not valid JSON ({e}); e.g. rope@{{"base": 500000}}') from e
        if not isinstance(options, dict):
            raise ValueError(f"options of {text!r} must be a JSON object, got {type(options).__name__}")
        return cls(name, options)


def split_specs(args: list[str]) -> list[str]:
    """``--encodings`` as compare takes it: names separated by commas or spaces (or both).

    Commas inside a spec's JSON options (``rope@{"base": 1, "x": 2}``) do not split it.
    """
    out: list[str] = []
    for arg in args:
        depth, start = 0, 0
        for i, ch in enumerate(arg):
            depth += (ch in "{[") - (ch in "}]")
            if ch == "," and depth == 0:
                out.append(arg[start:i])
                start = i + 1
        out.append(arg[start:])
    return [s.strip() for s in out if s.strip()]


def resolve(specs: list[str], *, want=None) -> tuple[list[Spec], list[str]]:
    """Parse encoding specs (``name`` or ``name@{json}``; ``"all"`` = every registered one).

    Args:
        specs: the specs, each possibly a comma-separated list (see :func:`split_specs`).
        want: optional predicate ``cls -> str | None``; a returned string is the reason
            the analysis does not apply to that encoding (skipped with a note).

    Returns:
        ``(kept, notes)``.

    Raises:
        ValueError: an unknown encoding name (the message lists the registered ones).
    """
    from ..base import get_class

    names = available()
    out: list[Spec] = []
    notes: list[str] = []
    expanded: list[str] = []
    for s in split_specs(specs):
        expanded.extend(names if s == "all" else [s])
    seen = set()
    for text in expanded:
        spec = Spec.parse(text)
        if spec.label in seen:
            continue
        seen.add(spec.label)
        get_class(spec.name)  # ValueError: unknown encoding, listing the valid names
        if want is not None:
            reason = want(get_class(spec.name))
            if reason:
                notes.append(f"skipped {spec.label!r}: {reason}")
                continue
        out.append(spec)
    return out, notes


# ============================================================================ models
@dataclass
class Subject:
    """A model to analyse and where it came from (``"random"`` or a checkpoint path)."""

    label: str
    model: TransformerLM
    source: str
    train_len: int

    @property
    def name(self) -> str:
        return self.model.encoding_name


def random_model(
    spec: Spec, *, dim=64, depth=2, heads=4, max_len=256, vocab_size=256, seed=0, causal=True
) -> TransformerLM:
    """A freshly initialised model (GPT-2 init; the encoding initialises itself)."""
    torch.manual_seed(seed)
    model = TransformerLM(vocab_size, dim, depth, heads, spec.name, max_len, causal=causal, **spec.options)
    return model.eval()


def build_subjects(specs: list[Spec], notes: list[str], *, max_len: int, seed: int, **kw) -> list[Subject]:
    """Random-weight models for ``specs``; one that fails to build is skipped with a note."""
    out = []
    for spec in specs:
        try:
            model = random_model(spec, max_len=max_len, seed=seed, **kw)
        except (ValueError, TypeError) as e:
            notes.append(f"skipped {spec.label!r}: cannot build it ({e})")
            continue
        out.append(Subject(spec.label, model, "random", max_len))
    return out


def checkpoint_paths(path: str | Path) -> list[Path]:
    """A checkpoint file, or every ``*.pt`` of a run directory (``<run>/checkpoints/*.pt``)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        found = sorted((p / "checkpoints").glob("*.pt")) or sorted(p.glob("*.pt"))
        if found:
            return found
        raise ValueError(f"no checkpoints in {p} (looked for {p}/checkpoints/*.pt and {p}/*.pt)")
    raise ValueError(f"checkpoint path {p} does not exist")


def train_len_of(model: TransformerLM, extra: dict) -> int:
    """The training length recorded in a checkpoint (several key names are accepted)."""
    for key in ("train_len", "seq_len", "block_size", "context", "length"):
        if isinstance(extra.get(key), int):
            return extra[key]
    for sub in ("compare_config", "config", "args", "train_config"):
        d = extra.get(sub)
        if isinstance(d, dict):
            for key in ("train_len", "seq_len", "block_size", "context", "length"):
                if isinstance(d.get(key), int):
                    return d[key]
    if model.max_len:
        return model.max_len
    raise ValueError("the checkpoint records no training length (train_len/seq_len) and the model has no max_len")


def load_subjects(paths: list[str], notes: list[str]) -> list[Subject]:
    """Models from checkpoint files or run directories.

    Raises:
        ValueError: a path that does not exist, holds no checkpoint, or one that cannot be read.
    """
    out = []
    for arg in paths:
        for p in checkpoint_paths(arg):
            try:
                model, extra = load_checkpoint(p)
            except Exception as e:  # truncated, random bytes, another format: one clear error
                reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
                raise ValueError(f"--checkpoint {str(p)!r} is not a readable posenc checkpoint ({reason})") from None
            label = p.stem if p.stem.startswith(model.encoding_name) else model.encoding_name
            out.append(Subject(f"{label} (trained)", model.eval(), str(p), train_len_of(model, extra)))
    return out


def synthetic_batch(batch: int, length: int, vocab_size: int, generator: torch.Generator) -> Tensor:
    """Repeated random blocks: each row is a random block of 4..12 tokens, repeated.

    Predicting the next token needs looking back one period, a content-and-position
    lookup, so a few hundred steps give attention with visible positional structure.
    """
    rows = []
    for _ in range(batch):
        period = int(torch.randint(4, 13, (1,), generator=generator))
        block = torch.randint(0, vocab_size, (period,), generator=generator)
        rows.append(block.repeat(length // period + 1)[:length])
    return torch.stack(rows)


def train_tiny(
    spec: Spec, *, steps=600, length=32, batch=32, dim=64, depth=2, heads=4, vocab_size=16, seed=0, lr=3e-3
) -> tuple[TransformerLM, dict]:
    """Train a small causal LM on :func:`synthetic_batch` data; returns ``(model, extra)``.

    ``extra`` holds what :func:`save_checkpoint` stores next to the weights (``train_len``,
    ``steps``, ``task``, final ``loss``), the same keys ``posenc compare`` checkpoints use
    for the training length.
    """
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    # untied unit-variance token embeddings, as `posenc compare` trains: with GPT-2's 0.02
    # the unit-amplitude sinusoids drown the tokens and the sinusoidal model never learns
    model = TransformerLM(
        vocab_size, dim, depth, heads, spec.name, length, tie_embeddings=False, embed_std=1.0, **spec.options
    )
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        tokens = synthetic_batch(batch, length + 1, vocab_size, g)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    extra = {"train_len": length, "steps": steps, "task": "repeated random blocks", "loss": float(loss.detach())}
    return model.eval(), extra


def tiny_checkpoints(specs: list[Spec], out_dir: Path, notes: list[str], *, steps: int, length: int) -> list[str]:
    """Train (or reuse) ``<out_dir>/checkpoints/<name>.pt`` for each spec; return the paths."""
    ckdir = Path(out_dir) / "checkpoints"
    ckdir.mkdir(parents=True, exist_ok=True)
    paths = []
    for spec in specs:
        path = ckdir / f"{spec.slug}.pt"
        if not path.exists():
            try:
                model, extra = train_tiny(spec, steps=steps, length=length)
            except (ValueError, TypeError) as e:
                notes.append(f"skipped training {spec.label!r}: {e}")
                continue
            save_checkpoint(path, model, **extra)
        paths.append(str(path))
    return paths


# ============================================================================ scores
def layer_inputs(model: TransformerLM, tokens: Tensor, pos: Tensor) -> list[Tensor]:
    """The input of every block (before ``ln1``), ``(B, L, D)`` each, from a plain forward.

    Raises ``ValueError`` for positions past ``max_len`` of an encoding that does not extrapolate.
    """
    check_lengths(model.encodings, pos)
    x = model.embed(tokens, pos)
    outs = []
    for block in model.blocks:
        outs.append(x)
        x = block(x, pos, None)
    return outs


def causal_mask(model: TransformerLM, L: int, device=None) -> Tensor | None:
    """``(L, L)`` bool, True = visible; None for a bidirectional model."""
    if not model.causal:
        return None
    i = torch.arange(L, device=device)
    return i[None, :] <= i[:, None]


def attention_scores(model: TransformerLM, tokens: Tensor, pos: Tensor | None = None) -> list[Tensor]:
    """Pre-mask attention logits of every layer, ``(B, H, L, L)`` each, float32.

    The same sum every backend computes: ``scale·(q̃·k̃ + score_terms) + bias``.
    """
    B, L = tokens.shape
    pos = torch.arange(L).unsqueeze(0) if pos is None else pos.reshape(1, L) if pos.dim() == 1 else pos
    out = []
    for block, x in zip(model.blocks, layer_inputs(model, tokens, pos), strict=True):
        parts = score_parts(block, x, pos)
        out.append(sum(parts.values()))
    return out


def attention_probs(model: TransformerLM, tokens: Tensor, pos: Tensor | None = None) -> list[Tensor]:
    """Attention probabilities of every layer, ``(B, H, L, L)`` each."""
    L = tokens.shape[1]
    mask = causal_mask(model, L)
    probs = []
    for s in attention_scores(model, tokens, pos):
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        probs.append(torch.softmax(s, dim=-1))
    return probs


def score_parts(block, x: Tensor, pos: Tensor) -> dict[str, Tensor]:
    """One layer's logits split by stage: ``qk`` (``scale·q̃·k̃``), ``terms``, ``bias``.

    ``x``: the block input ``(B, L, D)`` (before ``ln1``); ``pos``: ``(1|B, L)``.
    The parts sum to the pre-mask logits; each is ``(B, H, L, L)`` float32
    (:func:`posenc.scores` with ``parts=True``, the sum every backend computes).
    """
    attn = block.attn
    q, k, _, q_pos, k_pos = attn.project(block.attention_input(x, pos), pos)
    return scores(attn.encoding, q, k, q_pos, k_pos, qk_proj=(attn.q_proj, attn.k_proj), parts=True)


# ============================================================================ numbers
def masked_values(t: Tensor, mask: Tensor | None) -> Tensor:
    """Entries of ``(..., L, L)`` where ``mask`` ``(L, L)`` is True, flattened."""
    if mask is None:
        return t.reshape(-1)
    return t[..., mask].reshape(-1)


def diagonal_share(m: Tensor, *, skip_main: bool = False, keep: Tensor | None = None) -> float | None:
    """Share of the variance of a square matrix explained by its mean along each diagonal.

    ``1 - Σ (m_ij - mean_{j-i}(m))² / Σ (m_ij - mean(m))²``: 1 for a Toeplitz matrix (a
    function of ``j - i`` alone). ``skip_main`` drops ``i = j`` (a Gram matrix's norms);
    ``keep`` ``(L, L)`` bool restricts it to some entries (the causal triangle).
    For an ``L×L`` matrix of i.i.d. noise the expected share is about ``(2L-1)/L²``.
    None for a constant matrix (nothing to explain).
    """
    m = m.double()
    L = m.shape[-1]
    i = torch.arange(L)
    d = (i[None, :] - i[:, None]) + (L - 1)  # (L, L) diagonal index in [0, 2L-2]
    keep = torch.ones(L, L, dtype=torch.bool) if keep is None else keep.clone()
    if skip_main:
        keep &= d != L - 1
    vals, idx = m[keep], d[keep]
    sums = torch.zeros(2 * L - 1, dtype=torch.float64).index_add_(0, idx, vals)
    counts = torch.zeros(2 * L - 1, dtype=torch.float64).index_add_(0, idx, torch.ones_like(vals))
    fit = (sums / counts.clamp(min=1))[idx]
    total = ((vals - vals.mean()) ** 2).sum()
    if total <= 1e-20 * max(1.0, float((vals**2).sum())):
        return None
    return float(1 - ((vals - fit) ** 2).sum() / total)


def rel_change(new: Tensor, ref: Tensor) -> float:
    """``‖new - ref‖ / ‖ref‖`` (Frobenius), 0 when both are 0."""
    den = float(ref.double().norm())
    num = float((new.double() - ref.double()).norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


# ============================================================================ output
def write_json(path: Path, data) -> Path:
    """Write ``data`` with floats kept to 7 significant digits (float32 has no more)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_round(data), indent=1) + "\n")
    return path


def _round(x):
    if isinstance(x, float):
        return x if not math.isfinite(x) else float(f"{x:.7g}")
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def panel_grid(plt, n_items: int, per_item: int, items_per_row: int, size=(3.2, 3.0)):
    """A figure with ``per_item`` side-by-side panels for each of ``n_items``, wrapped.

    Returns ``(fig, axes_of)`` where ``axes_of(k)`` is the list of item ``k``'s panels;
    unused panels are hidden.
    """
    n_items = max(n_items, 1)
    cols = per_item * min(items_per_row, n_items)
    rows = math.ceil(n_items / items_per_row)
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n_items * per_item :]:
        ax.set_visible(False)

    def axes_of(k: int):
        return flat[k * per_item : (k + 1) * per_item]

    return fig, axes_of


def print_table(title: str, columns: list[str], rows: list[list], notes: list[str] | None = None) -> None:
    """A short summary table on stdout (rich), then the notes."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*(_fmt(v) for v in r))
    console = Console(width=160)
    console.print(table)
    for n in notes or []:
        console.print(f"note: {n}", markup=False, highlight=False)


def _fmt(v) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e4):
            return f"{v:.2e}"
        return f"{v:.4f}"
    return str(v)
