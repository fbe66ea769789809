"""What ``posenc extend`` measures on one (method, length) cell.

* **Perplexity, sliding window** (Press et al. 2022, the YaRN paper's protocol, §4.3.1):
  windows of the evaluated length ``L`` start every ``stride`` tokens; each window scores
  only the tokens the previous one did not, so every token of the text is scored once,
  with up to ``L`` tokens of context.
* **Perplexity, non-overlapping windows**: the text cut into windows of ``L``, every token
  scored (context 0 .. L-1); the second column.
* **Perplexity, truncated per document** (``--protocol truncated``; the YaRN repository's
  ``eval/perplexity.py``): the first ``L`` tokens of each of the same documents, every token
  scored, ``exp`` of the mean of the documents' mean losses (:mod:`posenc.extend.documents`
  says what a document is).
* **Time per token**: the wall time of the non-overlapping pass over its tokens (prefill).
* **Memory**: the bytes the KV cache holds at the end of a window of ``L`` (measured on the
  cache's tensors), CUDA's peak allocation on a GPU, and the process's peak resident set so
  far (``ru_maxrss``: it never goes down, so with lengths run in increasing order it is the
  peak at the longest length).

Every window runs as a chunked prefill: ``chunk`` tokens per forward call, appended to the
model's cache, so attention scores take ``O(chunk · L)`` memory per head and the cache
``O(L)`` per layer, never ``O(L²)``. ``sink-window`` (StreamingLLM, positions counted inside
the cache as the authors' ``enable_pos_shift``) keeps ``sinks`` first tokens and evicts the
oldest others: on a posenc ``TransformerLM`` exactly per token (``posenc.SinkWindow``); on an
HF model in blocks of ``b = window // 4`` tokens (:func:`sink_block`; one token at a time cost
~100 ms per token on a loaded CPU), so a query there sees the sinks and between
``window - b + 1`` and ``window`` recent tokens, itself included: never more than the window.
Its memory is ``O(sinks + window)`` at any length.
"""

from __future__ import annotations

import math
import resource
import time
from typing import Any

import torch
from torch import Tensor

__all__ = ["PROTOCOLS", "token_scores", "perplexity", "truncated", "cache_bytes", "peak_rss_bytes", "sink_block"]

# --protocol's names -> (the cell's perplexity key, the label every output gives its column)
PROTOCOLS = {"sliding": ("ppl", "sliding"), "windows": ("ppl_windows", "non-overlapping"),
             "truncated": ("ppl_truncated", "truncated per document")}  # fmt: skip


def peak_rss_bytes() -> int:
    """The process's peak resident set so far (Linux ``ru_maxrss``, KiB -> bytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cache_bytes(cache: Any) -> int:
    """Bytes of the tensors a cache holds (HF ``DynamicCache`` or posenc ``ModelCache``)."""
    seen: set[int] = set()

    def walk(obj: Any, depth: int) -> int:
        if isinstance(obj, Tensor):
            if obj.data_ptr() in seen:
                return 0
            seen.add(obj.data_ptr())
            return obj.numel() * obj.element_size()
        if depth > 3 or obj is None or isinstance(obj, (int, float, str, bool)):
            return 0
        if isinstance(obj, (list, tuple)):
            return sum(walk(x, depth + 1) for x in obj)
        if isinstance(obj, dict):
            return sum(walk(x, depth + 1) for x in obj.values())
        d = getattr(obj, "__dict__", None)
        return sum(walk(x, depth + 1) for x in d.values()) if d else 0

    return walk(cache, 0)


def _hf_stream(model, ids: Tensor, chunk: int, sink: dict | None):
    from transformers import DynamicCache

    from ..hf.keys import keep_raw_keys

    cache = DynamicCache(config=model.config)
    n = ids.shape[-1]
    if sink is None:
        for s in range(0, n, chunk):
            yield model(input_ids=ids[None, s : s + chunk], cache=cache, use_cache=True).logits[0], cache
        return
    # raw keys: eviction moves the kept rows to other positions, which rotated keys would not follow
    keep_raw_keys(cache)
    keep_first, window = sink["sinks"], sink["window"]
    block = sink_block(window)
    s = 0
    while s < n:
        room = keep_first + window - cache.get_seq_length()
        if room <= 0:  # full: evict the oldest tokens after the sinks, room for one block
            keep_last = window - block  # no query sees more than sinks + window keys
            for layer in cache.layers:
                layer.keys = torch.cat((layer.keys[..., :keep_first, :], layer.keys[..., -keep_last:, :]), dim=-2)
                layer.values = torch.cat((layer.values[..., :keep_first, :], layer.values[..., -keep_last:, :]), -2)
            room = block
        m = min(block, room, n - s)  # until the cache is first full, exactly the full forward
        c = cache.get_seq_length()
        pos = torch.arange(c, c + m, device=ids.device)[None]  # positions inside the cache (pos_shift)
        yield model(input_ids=ids[None, s : s + m], position_ids=pos, cache=cache, use_cache=True).logits[0], cache
        s += m


def sink_block(window: int) -> int:
    """Tokens per forward call of ``sink-window`` on an HF model: a quarter of the window."""
    return max(1, window // 4)


def _run_stream(model, ids: Tensor, chunk: int, sink: dict | None):
    from ..layer.cache import SinkWindow

    policy = SinkWindow(sink["sinks"], sink["window"]) if sink else None
    p = next(model.parameters())
    cache = model.init_cache(1, ids.shape[-1], dtype=p.dtype, device=p.device, policy=policy)
    for s in range(0, ids.shape[-1], chunk):
        yield model(ids[None, s : s + chunk], cache=cache)[0], cache


@torch.no_grad()
def token_scores(kind: str, model, ids: Tensor, *, chunk: int, sink: dict | None = None) -> tuple[Tensor, Tensor, int]:
    """``(nll, pred, kv_bytes)`` of one sequence ``ids`` ``(n,)``: the negative log-likelihood
    (float64) and the argmax of every next token ``(n - 1,)``, and the cache's bytes at the end."""
    stream = _hf_stream if kind == "hf" else _run_stream
    nll, pred, at, cache = [], [], 0, None
    for logits, cache in stream(model, ids, chunk, sink):  # noqa: B007 - the cache of the last step is measured
        m = logits.shape[0]
        targets = ids[at + 1 : at + 1 + m]
        logits = logits[: targets.shape[0]].double()  # the last position predicts past the text
        nll.append(torch.nn.functional.cross_entropy(logits, targets, reduction="none"))
        pred.append(logits.argmax(-1))
        at += m
    return torch.cat(nll).cpu(), torch.cat(pred).cpu(), cache_bytes(cache)


def perplexity(kind: str, model, text: Tensor, length: int, *, stride: int, windows: int, chunk: int,
               sink: dict | None = None, sliding: bool = True) -> dict[str, Any]:  # fmt: skip
    """Sliding-window and non-overlapping perplexity of ``text`` ``(N,)`` at ``length``.

    Both passes cover the first ``windows · length`` tokens of the text (as many whole
    windows as it has): the sliding one scores each of them once (the first token aside),
    the non-overlapping one ``length - 1`` per window. ``sink-window`` has no window of
    ``length``: its first column is one stream over those tokens (the authors' protocol),
    each token seeing the sinks and the last ``window`` tokens. With one window, or a stride of
    ``length``, the two protocols are the same computation: it runs once (``one_pass``), both
    values its. Returns
    ``{"ppl", "ppl_windows", "nll", "nll_windows", "tokens", "ms_per_token", "kv_bytes",
    "stride", "windows"}``; a non-finite loss gives ``None`` perplexity and ``nonfinite: True``.
    ``sliding=False``: no sliding pass (no ``ppl``/``nll``; the non-overlapping one always runs:
    it times the prefill).
    """
    n_win = max(1, min(windows, len(text) // length))
    span = text[: n_win * length]
    total, count, prev_end = 0.0, 0, 0
    # one window, or a stride of a whole window: the sliding pass is the non-overlapping one (same
    # tokens, same context); sink-window's sliding pass is one stream, not windows
    once = n_win == 1 or (sink is None and stride == length)
    if (
        sink is not None and not once and sliding
    ):  # StreamingLLM: one stream over the text, the cache bounded by its policy
        nll, _, _ = token_scores(kind, model, span, chunk=chunk, sink=sink)
        total, count, prev_end = float(nll.sum()), nll.numel(), len(span)
    for begin in range(0, len(span) - 1 if sink is None and not once and sliding else 0, stride):
        end = min(begin + length, len(span))
        nll, _, _ = token_scores(kind, model, span[begin:end], chunk=chunk, sink=sink)
        new = end - max(prev_end, begin + 1)  # targets this window scores first
        total += float(nll[-new:].sum()) if new > 0 else 0.0
        count += max(new, 0)
        prev_end = end
        if end == len(span):
            break
    t0, tot_w, cnt_w, kv = time.perf_counter(), 0.0, 0, 0
    for w in range(n_win):
        nll, _, kv = token_scores(kind, model, span[w * length : (w + 1) * length], chunk=chunk, sink=sink)
        tot_w, cnt_w = tot_w + float(nll.sum()), cnt_w + nll.numel()
    elapsed = time.perf_counter() - t0
    if once:
        total, count = tot_w, cnt_w
    out = {"nll": total / max(count, 1), "nll_windows": tot_w / max(cnt_w, 1), "tokens": count,
           "tokens_windows": cnt_w, "ms_per_token": 1000 * elapsed / max(n_win * length, 1), "kv_bytes": kv,
           "stride": stride, "windows": n_win, "one_pass": once}  # fmt: skip
    if not sliding:
        del out["nll"], out["tokens"], out["stride"]
    return _with_ppl(out)


def _with_ppl(out: dict[str, Any]) -> dict[str, Any]:
    for k in [k for k in out if k.startswith("nll")]:
        v = out[k]
        out["ppl" + k[3:]] = math.exp(v) if math.isfinite(v) and v < 700 else None
        if not math.isfinite(v):
            out["nonfinite"] = True
    return out


def truncated(kind: str, model, documents: list[Tensor], *, length: int, chunk: int,
              sink: dict | None = None) -> dict[str, Any]:  # fmt: skip
    """The truncated per-document protocol at ``length``: the first ``length`` tokens of each
    document (every one has at least the longest length, posenc.extend.documents), all scored;
    ``{"nll_truncated", "ppl_truncated", "documents"}`` (no document: ``ppl_truncated`` None)."""
    if not documents:
        return {"ppl_truncated": None, "documents": 0}
    per_doc = []
    for d in documents:
        nll, _, _ = token_scores(kind, model, d[:length], chunk=chunk, sink=sink)
        per_doc.append(float(nll.mean()))
    return _with_ppl({"nll_truncated": sum(per_doc) / len(per_doc), "documents": len(per_doc)})
