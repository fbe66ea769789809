"""Training progress as a :class:`~posenc.train.Callback`: a tqdm bar on a terminal, plain
lines otherwise (a log file gets one line per tenth of the steps, no carriage returns)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from .loop import Callback, TrainState

__all__ = ["Progress"]


class Progress(Callback):
    """Progress of one training run.

    Args:
        tag: what is trained, e.g. ``"[3/7] rope"`` (encoding 3 of 7).
        total: the last step.
        start: the step the run starts (or resumes) from.
        log: where plain lines go (``print`` by default).
        terminal: draw a bar; default: whether stderr is a terminal.
    """

    def __init__(
        self, tag: str, total: int, start: int = 0, log: Callable[[str], None] = print, terminal: bool | None = None
    ) -> None:
        self.tag, self.total, self.log = tag, total, log
        self.every = max(1, total // 10)
        self.bar = None
        if sys.stderr.isatty() if terminal is None else terminal:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, desc=tag, unit="step", dynamic_ncols=True, leave=True)
        self.last, self.tokens, self.t = start, 0, time.perf_counter()

    def on_step(self, state: TrainState) -> None:
        step = state.step
        if not (step == self.total or step % (10 if self.bar is not None else self.every) == 0):
            return
        now = time.perf_counter()
        seen = state.tokens - self.tokens
        tok_s = seen / (now - self.t) if now > self.t else 0.0
        self.tokens, self.t = state.tokens, now
        loss = state.losses[-1]
        if self.bar is not None:
            self.bar.update(step - self.last)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
        else:
            self.log(f"{self.tag}: step {step}/{self.total}  loss {loss:.3f}  {tok_s:,.0f} tok/s")
        self.last = step

    def on_end(self, state: TrainState) -> None:
        if self.bar is not None:
            self.bar.close()
