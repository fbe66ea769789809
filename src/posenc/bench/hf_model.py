"""A real checkpoint through posenc's HF adapter against stock HF, in the same process.

``posenc bench --hf-model DIR`` loads a local HF causal LM twice per method: stock, with the
method's own ``rope_parameters`` (what transformers runs without posenc), and the same weights
converted by :func:`posenc.hf.convert` (the method then runs through posenc's attention). For
each length ``n`` it times, interleaved over ``rounds``:

* ``prefill``: one forward over ``n`` tokens with a cache (what the first token costs);
* ``decode``: the median per-token step of ``steps`` greedy tokens after that prefill (``n``
  cached tokens), the cache growing as ``generate`` grows it.

The model that runs second in a round runs slower (about 2–3 % per decoding step on SmolLM2 at
2 048 cached tokens, whichever model it is), so the order alternates from round to round: an
even number of rounds gives each model the first place equally often.

Times are the CPU time of the calling thread (``time.thread_time``) on CPU, so a machine shared
with other work still compares like with like (wall time on CUDA, synchronised); ``ratio`` is
posenc over stock, the median of the rounds' ratios. Nothing is asserted: the table is the result.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .measure import thread_clock

__all__ = ["HF_METHODS", "HFModelConfig", "hf_model_table", "rope_parameters", "run_hf_model"]

HF_METHODS = ("rope", "yarn", "linear", "ntk", "dynamic")


@dataclass(frozen=True)
class HFModelConfig:
    """The run: checkpoint ``path``, ``methods`` (:data:`HF_METHODS`) at ``factor`` times the trained
    length, ``lengths`` (prompt tokens), ``steps`` decoded tokens, ``rounds`` interleaved rounds."""

    path: str
    methods: tuple[str, ...] = ("rope", "yarn")
    lengths: tuple[int, ...] = (2048, 8192)
    steps: int = 8
    rounds: int = 2
    factor: float = 2.0
    device: str = "cpu"
    dtype: str = "float32"


def rope_parameters(config, method: str, factor: float) -> dict | None:
    """The stock ``rope_parameters`` of ``method`` on ``config`` (None: the checkpoint's own): the
    options ``posenc extend`` runs the method with (:func:`posenc.extend.methods.method_options`
    at ``factor`` times the trained length) as a stock config writes them
    (:func:`posenc.extend.save.stock_parameters`; ``ntk``: a new ``rope_theta``, bloc97 2023)."""
    from ..extend.methods import method_options
    from ..extend.save import stock_parameters

    if method == "rope":
        return None
    own = dict(config.rope_parameters or {})
    if own.get("rope_theta") is None:
        raise ValueError(f"{config.model_type}: rope_parameters has no rope_theta")
    trained = int(getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings)
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    opts = method_options(method, train_tokens=trained, longest_tokens=int(trained * factor),
                          base=own["rope_theta"], rotary_dim=d)  # fmt: skip
    return stock_parameters(own, opts)


def _load(cfg: HFModelConfig, method: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    import posenc.hf

    dtype = getattr(torch, cfg.dtype)
    config = AutoConfig.from_pretrained(cfg.path, local_files_only=True, trust_remote_code=False)
    params = rope_parameters(config, method, cfg.factor)
    if params is not None:
        config.rope_parameters = params
    longest = max(cfg.lengths) + cfg.steps
    if params is not None and method != "dynamic":  # (yarn checks the extended length there; dynamic
        # reads its trained length there)
        longest = max(longest, int(config.max_position_embeddings * cfg.factor))
    config.max_position_embeddings = max(config.max_position_embeddings, longest)

    def model():
        m = AutoModelForCausalLM.from_pretrained(
            cfg.path, config=config, dtype=dtype, local_files_only=True, trust_remote_code=False
        )
        return m.to(cfg.device).eval()

    return model(), posenc.hf.convert(model())


def _time(model, tokens: torch.Tensor, steps: int, clock) -> tuple[float, float]:
    """``(prefill seconds, median seconds per decoded token)`` of one round."""
    with torch.no_grad():
        start = clock()
        out = model(tokens, use_cache=True)
        prefill = clock() - start
        cache, nxt, times = out.past_key_values, out.logits[:, -1:].argmax(-1), []
        for _ in range(steps):
            start = clock()
            out = model(nxt, cache=cache, use_cache=True)
            times.append(clock() - start)
            nxt = out.logits[:, -1:].argmax(-1)
    return prefill, statistics.median(times)


def run_hf_model(cfg: HFModelConfig, progress: Callable[[str], None] | None = None) -> list[dict]:
    """One row per method × length × phase (``prefill``, ``decode``): stock and posenc ms, the ratio."""
    device, rows = torch.device(cfg.device), []
    clock = thread_clock(device)
    for method in cfg.methods:
        try:
            stock, ours = _load(cfg, method)
        except (OSError, ValueError, RuntimeError) as e:
            status = f"error: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
            rows += [_row(cfg, method, n, phase, status=status) for n in cfg.lengths for phase in ("prefill", "decode")]
            continue
        vocab = stock.config.vocab_size
        for n in cfg.lengths:
            if progress:
                progress(f"hf model: {method} at {n} tokens ({cfg.rounds} rounds)")
            tokens = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
            got = {"stock": [], "posenc": []}
            for r in range(cfg.rounds):  # interleaved, so a change of load hits both; the order alternates
                for name in ("stock", "posenc")[:: 1 if r % 2 == 0 else -1]:  # (the second model runs slower)
                    got[name].append(_time(stock if name == "stock" else ours, tokens, cfg.steps, clock))
            for i, phase in enumerate(("prefill", "decode")):
                s = [r[i] for r in got["stock"]]
                p = [r[i] for r in got["posenc"]]
                ratio = statistics.median(b / a for a, b in zip(s, p) if a > 0)
                rows.append(_row(cfg, method, n, phase, statistics.median(s), statistics.median(p), ratio, (s, p)))
        del stock, ours
    return rows


def _row(cfg, method, n, phase, stock=None, ours=None, ratio=None, rounds=((), ()), status="ok") -> dict:
    """One table row; ``rounds``: each round's stock and posenc seconds (the medians' and ratio's data)."""

    def ms(t):
        return None if t is None else round(t * 1000, 3)

    keep = {k: v for k, v in asdict(cfg).items() if k not in ("methods", "lengths")}
    return {**keep, "method": method, "tokens": n, "phase": phase, "stock_ms": ms(stock), "posenc_ms": ms(ours),
            "ratio": None if ratio is None or math.isnan(ratio) else round(ratio, 3), "status": status,
            "stock_rounds_ms": [ms(t) for t in rounds[0]], "posenc_rounds_ms": [ms(t) for t in rounds[1]]}  # fmt: skip


def hf_model_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the report's table."""
    head = ["method", "phase", "tokens", "stock ms", "posenc ms", "posenc / stock", "status"]

    def ms(x):
        return "—" if x is None else f"{x:.1f}"

    body = [[f"`{r['method']}`", r["phase"] + (" (per token)" if r["phase"] == "decode" else ""), str(r["tokens"]),
             ms(r["stock_ms"]), ms(r["posenc_ms"]), "—" if r["ratio"] is None else f"{r['ratio']:.3f}×", r["status"]]
            for r in rows]  # fmt: skip
    return head, body
