"""How long a training sequence of each task is, in model tokens (:func:`sequence_length`).

Above every task module (it asks each task for its own ``seq_len``), so the tasks need not
import each other.
"""

from __future__ import annotations

import torch

from .grid import GridTask
from .kazemnejad import KAZEMNEJAD_TASKS, KazemnejadTask
from .paper_tasks import paper_task
from .passkey import PasskeyTask
from .tasks import TASK_NAMES, TASKS, SyntheticTask

__all__ = ["sequence_length"]


def sequence_length(task: str | None, n: int) -> int:
    """Model input tokens of a training sequence of size ``n`` of ``task`` (None: text, where
    ``n`` counts tokens already): the task's own ``seq_len``, so figures mark the training
    length where its sequences end. For ``count`` that is the longest program (``4 n + 2``;
    training rows vary in length and are padded to their batch's longest).

    Raises:
        ValueError: ``task`` is not one of :data:`TASK_NAMES`, or ``n`` is not a positive int.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"sequence_length: n must be a positive int, got {n!r}")
    if task is not None and task not in TASK_NAMES:
        raise ValueError(f"sequence_length: unknown task {task!r}; tasks: {', '.join(TASK_NAMES)}")
    empty = torch.empty(0, dtype=torch.uint8)  # no filler: seq_len needs none
    # text (None) counts tokens as passkey does (TextData.seq_len; a TextData needs a corpus)
    makers = {None: lambda: PasskeyTask(empty, empty), "passkey": lambda: PasskeyTask(empty, empty),
              "grid": GridTask, "count": lambda: paper_task("count"), "flip-flop": lambda: paper_task("flip-flop"),
              **{t: (lambda t=t: SyntheticTask(t)) for t in TASKS},
              **{t: (lambda t=t: KazemnejadTask(t)) for t in KAZEMNEJAD_TASKS}}  # fmt: skip
    return makers[task]().seq_len(n)
