"""The C allocator's settings for long attention on the CPU.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves a request of at
least its *mmap threshold* with a fresh ``mmap`` (128 KiB at first, raised on the fly up to
32 MiB as such blocks are freed) and gives the top of its heap back to the system once more
than its *trim threshold* is free there (twice the mmap threshold). A blocked attention
backend allocates and frees tensors of a few MiB per query block, hundreds of times a
step; whenever they come from a fresh mapping, the kernel zeroes every page on first
touch, so an encoding's time depended on what had run before it in the process (``posenc
bench`` times every encoding in one process).

:func:`tune_allocator` raises both thresholds, so that freed blocks stay in the heap and
are reused; requests from 32 MiB up are still mapped and unmapped (a higher threshold let
the heap fragment at long lengths). The measurements behind both settings, and the cost
(the process keeps up to 2 GiB of freed heap), are in docs/bench.md, "The C allocator".
``posenc bench`` calls it unless given ``--allocator default``;
a training script can call it once at start. It acts on glibc only (Linux); elsewhere it
does nothing and returns False. Setting the environment variables
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` before Python starts does the
same and also allows a trim threshold past 2 GiB (``mallopt`` takes a C ``int``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "allocator_settings", "tune_allocator"]

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 2**20  # requests below 32 MiB come from the heap, larger ones are mapped
TRIM_THRESHOLD = 2**31 - 1  # the largest value mallopt takes: free heap is kept up to ~2 GiB
_INT_MAX = 2**31 - 1

_settings: dict | None = None


@functools.cache
def _glibc():
    """The C library when it is glibc (it has ``gnu_get_libc_version``), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc


def _check(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int (bytes), got {value!r}")
    if not 0 < value <= _INT_MAX:
        raise ValueError(f"{name} must be in 1 .. {_INT_MAX} bytes (a C int), got {value}")
    return value


def tune_allocator(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Set glibc's mmap and trim thresholds (bytes) for this process (module doc).

    Returns True when both were set, False where the C library is not glibc (nothing is
    changed then). Acts on allocations made after the call; safe to call again.
    """
    global _settings
    mmap_threshold = _check("mmap_threshold", mmap_threshold)
    trim_threshold = _check("trim_threshold", trim_threshold)
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1 and ok
    if ok:
        _settings = {
            "libc": "glibc " + libc.gnu_get_libc_version().decode(),
            "mmap_threshold": mmap_threshold,
            "trim_threshold": trim_threshold,
        }
    return ok


def allocator_settings() -> dict | None:
    """What :func:`tune_allocator` set in this process (None: the C library's defaults)."""
    return None if _settings is None else dict(_settings)
