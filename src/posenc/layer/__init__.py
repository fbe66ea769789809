"""The attention layer and what it keeps between calls.

* :mod:`~posenc.layer.call` — :class:`~posenc.layer.call.Call`, one forward as every layer sees
  it, built and checked once (:func:`~posenc.layer.call.make_call`);
* :mod:`~posenc.layer.attention` — :class:`posenc.Attention`: ``(x, call, cache)`` -> projections,
  the q/k step (:func:`~posenc.layer.attention.encode`, shared with ``posenc.hf``), a backend;
* :mod:`~posenc.layer.cache` — KV caches (plain, rolling, StreamingLLM's) and the input history;
  :mod:`~posenc.layer.memory` — Transformer-XL's memory, a cache policy of its own;
* :mod:`~posenc.layer.setup` — the encoding a layer is built with, and which layers share one;
  :mod:`~posenc.layer.spec` — one layer as data (:class:`posenc.LayerSpec`);
  :mod:`~posenc.layer.qk_norm` — per-head q/k norms.
"""
