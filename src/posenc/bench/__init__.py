"""Speed and memory benchmarks: ``posenc bench``.

* :mod:`posenc.bench.layers` — the layers timed: posenc's attention per encoding, plain
  SDPA as the baseline, HF and x-transformers originals;
* :mod:`posenc.bench.measure` — median timing, peak memory (CUDA allocator / CPU
  ``torch.profiler`` memory events), machine record;
* :mod:`posenc.bench.runner` — every case over lengths and modes, ratios in the same run;
* :mod:`posenc.bench.throughput` — training tokens/s, TransformerLM vs x-transformers;
* :mod:`posenc.bench.kv_cache` — decoding memory of grouped k/v against full heads (``--kv-cache``);
* :mod:`posenc.bench.report` — tables, JSON/CSV, log-log plot; :mod:`posenc.bench.markdown` —
  the Markdown report; :mod:`posenc.bench.compile` — ``torch.compile`` graph breaks;
* :mod:`posenc.bench.cli` — the command.
"""

from .kv_cache import KVCacheConfig, run_kv_cache
from .measure import machine_record, peak_memory, time_runs
from .runner import BenchConfig, run_layers
from .throughput import ThroughputConfig, run_throughput

__all__ = [
    "BenchConfig",
    "KVCacheConfig",
    "ThroughputConfig",
    "machine_record",
    "peak_memory",
    "run_kv_cache",
    "run_layers",
    "run_throughput",
    "time_runs",
]
