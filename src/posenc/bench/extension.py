"""The two-map extension methods against plain RoPE through the same path, as ``posenc extend`` runs them.

``posenc bench --extension`` builds one :class:`posenc.Attention` layer with SmolLM2-135M's
attention (width 576, 9 query heads, 3 key/value heads of 64, RoPE θ 1e5) per method and runs,
for every length ``L``, a chunked prefill: ``chunk`` tokens per call appended to the layer's
KV cache, as ``posenc extend`` scores a window (:mod:`posenc.extend.evaluate`). The methods take
``posenc extend``'s settings for a 2× extension of a model trained at ``L / 2``
(:func:`posenc.extend.methods.method_options`): ReRoPE and Self-Extend with a window of
``L / 4``, DCA with chunks of ``3L/8``.

With ``--extension-hf`` the same prefills also run through :func:`posenc.hf.convert` on a one-layer
HF Llama of the same attention (MLP width 1536, vocabulary 256, random weights), as ``posenc extend``
runs an HF checkpoint: path ``hf``, backend ``auto`` only (the adapter picks its backend itself).
``--extension-model DIR`` runs that path on a local checkpoint instead (SmolLM2-135M itself:
``scripts/smollm2.py``), with its own RoPE base and its vocabulary.

Each row is one path (``layer``, ``hf``) and one method on one backend: ``auto`` (what the layer picks: ``sdpa`` for ``rope``,
``maps`` for the others on CPU) and ``chunked`` (every score map materialised in query blocks:
the path before the ``maps`` backend). Times are the CPU time of the calling thread per scored
token (``time.thread_time``; CUDA: synchronised wall time); ``ratio`` is the row's time over
``rope``'s (``auto``) at the same length, the median of the rounds' ratios, each round timing
every row once, interleaved, so a change of load hits all. Nothing is asserted: the table is the result.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .measure import thread_clock

__all__ = ["EXTENSION_METHODS", "ExtensionConfig", "extension_markdown", "extension_table", "run_extension"]

EXTENSION_METHODS = ("rerope", "self-extend", "dca")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_VOCAB = 256  # the HF path's vocabulary: the output head stays a small part of the forward


@dataclass(frozen=True)
class ExtensionConfig:
    """The run: ``lengths`` (tokens), ``chunk`` tokens per call, ``rounds`` interleaved rounds; the layer's
    shape (SmolLM2-135M's attention by default); ``factor``: the extension (trained length ``L / factor``)."""

    lengths: tuple[int, ...] = (2048, 4096, 8192)
    chunk: int = 512
    rounds: int = 2
    methods: tuple[str, ...] = EXTENSION_METHODS
    backends: tuple[str, ...] = ("auto", "chunked")
    paths: tuple[str, ...] = ("layer",)
    model: str | None = None  # the hf path's checkpoint (None: the one-layer random Llama)
    dim: int = 576
    heads: int = 9
    kv_heads: int = 3
    base: float = 1e5
    factor: int = 2
    device: str = "cpu"
    dtype: str = "float32"


def _subject(cfg: ExtensionConfig, path: str, method: str, length: int):
    """The posenc layer, or the converted one-layer HF Llama, running ``method``."""
    from ..extend.methods import method_classes, method_options

    opts = {} if method == "rope" else method_options(method, train_tokens=max(2, length // cfg.factor),
                                                      longest_tokens=length)  # fmt: skip
    name = "rope" if method == "rope" else method_classes(method).get("rope", "rope")
    torch.manual_seed(0)
    if path == "hf" and cfg.model is not None:
        from transformers import AutoModelForCausalLM

        import posenc.hf as ph

        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=_DTYPES[cfg.dtype], local_files_only=True,
                                                     trust_remote_code=False)  # fmt: skip
        model = ph.convert(model, encoding=name, **opts)
    elif path == "hf":
        from transformers import LlamaConfig, LlamaForCausalLM

        import posenc.hf as ph

        config = LlamaConfig(vocab_size=_VOCAB, hidden_size=cfg.dim, intermediate_size=1536, num_hidden_layers=1,
                             num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                             max_position_embeddings=length, rope_theta=cfg.base)  # fmt: skip
        model = ph.convert(LlamaForCausalLM(config), encoding=name, **opts)
    else:
        from ..layer.attention import Attention

        model = Attention(cfg.dim, cfg.heads, name, kv_heads=cfg.kv_heads, causal=True, base=cfg.base, **opts)
    return model.to(device=cfg.device, dtype=_DTYPES[cfg.dtype]).eval()


def _vocab(cfg: ExtensionConfig) -> int:
    if cfg.model is None:
        return _VOCAB
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(cfg.model, local_files_only=True, trust_remote_code=False).vocab_size


def _prefill(subject, path: str, x: torch.Tensor, chunk: int, backend: str, clock) -> float:
    """Seconds of one chunked prefill of ``x`` (``layer``: ``(1, L, D)`` inputs; ``hf``: ``(1, L)`` token
    ids) through a fresh cache."""
    if path == "hf":
        from transformers import DynamicCache

        cache = DynamicCache(config=subject.config)

        def call(s):
            subject(input_ids=x[:, s : s + chunk], cache=cache, use_cache=True)
    else:
        cache = subject.init_cache(1, x.shape[1], dtype=x.dtype, device=x.device)
        kw = {} if backend == "auto" else {"backend": backend}

        def call(s):
            subject(x[:, s : s + chunk], cache=cache, **kw)

    with torch.no_grad():
        start = clock()
        for s in range(0, x.shape[1], chunk):
            call(s)
        return clock() - start


def run_extension(cfg: ExtensionConfig, progress: Callable[[str], None] | None = None) -> list[dict]:
    """One row per path × length × (``rope``, then each method × backend): ms per token, ratio to ``rope``."""
    device, rows = torch.device(cfg.device), []
    clock = thread_clock(device)
    for path in cfg.paths:
        backends = cfg.backends if path == "layer" else ("auto",)
        cases = [("rope", "auto")] + [(m, b) for m in cfg.methods for b in backends]
        for n in cfg.lengths:
            if progress:
                progress(f"extension ({path}): {len(cases)} cases at {n} tokens, chunks of {cfg.chunk}")
            g = torch.Generator().manual_seed(n)
            if path == "hf":
                x = torch.randint(0, _vocab(cfg), (1, n), generator=g).to(device)
            else:
                x = torch.randn(1, n, cfg.dim, generator=g).to(device, _DTYPES[cfg.dtype])
            rows += _measure(cfg, path, cases, x, clock)
    return rows


def _measure(cfg: ExtensionConfig, path: str, cases: list, x: torch.Tensor, clock) -> list[dict]:
    n, subjects, status = x.shape[1], {}, {}
    for m, b in cases:
        try:
            if m not in subjects:
                subjects[m] = _subject(cfg, path, m, n)
            _prefill(subjects[m], path, x[:, : min(n, cfg.chunk)], cfg.chunk, b, clock)  # warm-up
            status[m, b] = "ok"
        except (ValueError, RuntimeError, ImportError) as e:
            status[m, b] = f"error: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
    times: dict[tuple[str, str], list[float]] = {c: [] for c in cases if status[c] == "ok"}
    for _ in range(cfg.rounds):  # interleaved, so a change of load hits every case
        for c in times:
            times[c].append(_prefill(subjects[c[0]], path, x, cfg.chunk, c[1], clock))
    base, rows = times.get(("rope", "auto")), []
    for c in cases:
        t = times.get(c)
        ratio = statistics.median(a / r for a, r in zip(t, base) if r > 0) if t and base else None
        rows.append(_row(cfg, path, c, n, None if not t else statistics.median(t) / n, ratio, status[c]))
    return rows


def _row(cfg: ExtensionConfig, path: str, case: tuple[str, str], n: int, per_token, ratio, status: str) -> dict:
    keep = {k: v for k, v in asdict(cfg).items() if k not in ("lengths", "methods", "backends", "paths")}
    return {**keep, "path": path, "method": case[0], "backend": case[1], "tokens": n,
            "ms_per_token": None if per_token is None else round(per_token * 1000, 4),
            "ratio": None if ratio is None else round(ratio, 3), "status": status}  # fmt: skip


def extension_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the report's table."""
    head = ["path", "method", "backend", "tokens", "ms / token", "/ rope", "status"]
    body = [[r["path"], f"`{r['method']}`", r["backend"], str(r["tokens"]),
             "—" if r["ms_per_token"] is None else f"{r['ms_per_token']:.4f}",
             "—" if r["ratio"] is None else f"{r['ratio']:.2f}×", r["status"]] for r in rows]  # fmt: skip
    return head, body


def extension_markdown(rows: list[dict], table: str) -> list[str]:
    """The Markdown section of the report around ``table`` (the rows rendered)."""
    r = rows[0]
    return [
        "## Two-map extension methods against plain RoPE",
        "",
        f"One attention layer (width {r['dim']}, {r['heads']} query / {r['kv_heads']} key-value heads, RoPE θ "
        f"{r['base']:g}) runs a chunked prefill of each length in chunks of {r['chunk']} tokens through its KV "
        f"cache, as `posenc extend` scores a window; the methods take `extend`'s settings for a {r['factor']}× "
        "extension. CPU time of the calling thread per token (CUDA: synchronised wall time), interleaved rounds; "
        "`/ rope` is the median of the rounds' ratios to `rope` on `auto` (SDPA) at the same length. `auto` runs "
        "the `maps` backend on CPU; `chunked` materialises every score map. Path `hf`: the same through "
        "`posenc.hf.convert` on "
        + (
            f"`{r['model']}`."
            if r.get("model")
            else "a one-layer HF Llama of that attention (MLP 1536, vocabulary 256)."
        ),
        "",
        table,
        "",
    ]
