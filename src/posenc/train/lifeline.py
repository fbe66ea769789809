"""A process that dies with the process that started it.

A training process that outlives its launcher goes on writing checkpoints into a run folder
whose lock it then holds alone, so a ``--resume`` after the launcher was killed is refused (or,
worse, races the orphan). Two uses: :mod:`posenc.compare.runner`'s CPU workers, and the ranks
``torchrun`` starts, which it puts in sessions of their own, so a SIGKILL of ``torchrun``'s
process group (the OOM killer's or a scheduler's signal, which runs no cleanup) does not reach
them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

__all__ = ["die_with", "watch_parent"]


def die_with(parent: int, *, kernel: bool = True, every: float = 0.5) -> None:
    """End this process when ``parent`` (the pid that started it) dies.

    ``kernel``: on Linux also ask the kernel for a SIGKILL when the parent *thread* that started
    this process exits (``prctl(PR_SET_PDEATHSIG)``): immediate, but only right where that
    thread lives as long as its process (a pool started from the caller's thread; not a
    launcher whose threads are not ours to know). The watchdog thread (:func:`watch_parent`)
    runs in every case and everywhere: it exits this process once it is re-parented.
    """
    if kernel and sys.platform.startswith("linux"):
        import ctypes

        try:  # PR_SET_PDEATHSIG = 1
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)
    threading.Thread(target=watch_parent, args=(parent, every), name="posenc-parent-watchdog", daemon=True).start()


def watch_parent(parent: int, every: float = 0.5) -> None:
    """Exit this process (no cleanup: the parent's files are not ours) once ``parent`` is gone:
    a process is re-parented when its parent dies, so ``getppid`` changes."""
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(1)
