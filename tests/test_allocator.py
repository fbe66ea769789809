"""posenc.tune_allocator: glibc's thresholds, checked by what they change (page faults)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import posenc
from posenc.allocator import MMAP_THRESHOLD, TRIM_THRESHOLD, _glibc, allocator_settings

# 3 cycles of 8 x 16 MiB float32 tensors allocated, written and freed, after 2 warm-up cycles:
# prints the minor page faults of the 3 cycles (each cycle touches 32768 pages of 4 KiB)
_CYCLES = """
import resource, sys, torch, posenc
if sys.argv[1] == "tuned":
    assert posenc.tune_allocator()
elif sys.argv[1] == "mmap":  # every block from a fresh mapping, returned on free
    assert posenc.tune_allocator(128 * 1024, 128 * 1024)
def cycle():
    ts = [torch.empty(4 * 2**20).fill_(1.0) for _ in range(8)]
    del ts
cycle(); cycle()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    cycle()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""
_PAGES = 3 * 8 * 16 * 2**20 // 4096


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
    out = subprocess.run([sys.executable, "-c", _CYCLES, mode], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")
def test_tuned_heap_keeps_freed_blocks():
    """Tuned, freed blocks stay in the heap and are reused without page faults. The control
    (a fixed 128 KiB mmap threshold: every block a fresh mapping, unmapped on free) faults
    on about every page, so the count does see faults. glibc's defaults lie anywhere in
    between (4096 to 98 208 faults measured here): its dynamic thresholds and the heap's
    layout decide, which is what made one case's time depend on what ran before it."""
    control, tuned = _faults("mmap"), _faults("tuned")
    assert control > _PAGES // 2, f"the control faulted only {control} times in {_PAGES} pages"
    assert tuned < _PAGES // 20, f"tuned still faulted {tuned} times in {_PAGES} pages"


@pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")
def test_tune_allocator_records_its_settings():
    # (this process's allocator is changed for the rest of the session: harmless, and the
    # values are posenc bench's own defaults)
    assert posenc.tune_allocator() is True
    s = allocator_settings()
    assert s["libc"].startswith("glibc ")
    assert s["mmap_threshold"] == MMAP_THRESHOLD == 32 * 2**20 and s["trim_threshold"] == TRIM_THRESHOLD == 2**31 - 1


@pytest.mark.parametrize("bad", [1.5, "1024", True, None])
def test_tune_allocator_rejects_non_ints(bad):
    with pytest.raises(TypeError, match="mmap_threshold must be an int"):
        posenc.tune_allocator(bad)
    with pytest.raises(TypeError, match="trim_threshold must be an int"):
        posenc.tune_allocator(2**20, bad)


@pytest.mark.parametrize("bad", [0, -1, 2**31])
def test_tune_allocator_rejects_out_of_range(bad):
    with pytest.raises(ValueError, match=r"mmap_threshold must be in 1 \.\. 2147483647 bytes"):
        posenc.tune_allocator(bad)
    with pytest.raises(ValueError, match=r"trim_threshold must be in 1 \.\. 2147483647 bytes"):
        posenc.tune_allocator(2**20, bad)
