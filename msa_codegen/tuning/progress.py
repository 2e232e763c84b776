"""The tuner's progress: one line per bucket and direction, and its summary line.

On a terminal the line is rewritten in place (carriage return) after every trial; elsewhere
(CI logs, pipes) plain lines are written, one when a quarter of the trials more is done, so a log
stays short. The summary line of a finished bucket and direction reads

    bucket 131072 fwd: 16 trials, 7 pruned (shared memory), 0 failed, best 8.61 ms, 31 s
"""
from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import TextIO


def quiet_known_warnings() -> None:
    """Keep the tuner's output to its progress lines: PyTorch warns once per process that the
    autograd engine's device thread had no current CUDA context when the backward of a timed
    trial first calls cuBLAS (it sets the primary context itself; nothing is wrong)."""
    warnings.filterwarnings("ignore", message=r"Attempting to run cuBLAS, but there was no current CUDA context",
                            category=UserWarning)


@dataclasses.dataclass
class TuneStats:
    """What one bucket and direction did (this process)."""

    bucket: int
    direction: str
    total: int                     # trials asked for
    trials: int = 0                # candidates compiled and run (timed or failed)
    pruned_smem: int = 0           # excluded before compiling: shared memory (estimate or compile for the target)
    pruned_other: int = 0          # excluded before compiling: registers, tiles, descriptor faults
    failed: int = 0                # compile or launch errors, wrong results
    out_of_resources: int = 0      # of the failed: out of resources at compile or launch
    best_ms: float | None = None
    budget_stop: bool = False      # stopped before ``total`` because the time budget was spent
    seconds: float | None = dataclasses.field(default=None, compare=False)   # wall-clock, once done

    def line(self) -> str:
        parts = [f"{self.trials} trials" + (f" of {self.total}" if self.budget_stop else ""),
                 f"{self.pruned_smem} pruned (shared memory)"]
        if self.pruned_other:
            parts.append(f"{self.pruned_other} pruned (registers, tiles)")
        failed = f"{self.failed} failed"
        if self.out_of_resources:
            failed += f" ({self.out_of_resources} out of resources)"
        parts.append(failed)
        parts.append(f"best {self.best_ms:.4g} ms" if self.best_ms is not None else "best -")
        tail = ", budget spent" if self.budget_stop else ""
        if self.seconds is not None:
            tail += f", {self.seconds:.0f} s"
        return f"bucket {self.bucket} {self.direction}: {', '.join(parts)}{tail}"


class Progress:
    """The live line of one bucket and direction (``update`` after every trial, ``close`` at the
    end); ``enabled=False`` writes nothing."""

    def __init__(self, stats: TuneStats, enabled: bool = True, stream: TextIO | None = None):
        self.stats, self.enabled = stats, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._width = 0
        self._next_plain = 0

    def _text(self) -> str:
        return f"[{self.stats.trials}/{self.stats.total}] {self.stats.line()}"

    def update(self) -> None:
        if not self.enabled:
            return
        if self.tty:
            text = self._text()
            self.stream.write("\r" + text.ljust(self._width))
            self._width = max(self._width, len(text))
            self.stream.flush()
        elif self.stats.trials >= self._next_plain:
            self.stream.write(self._text() + "\n")
            self.stream.flush()
            self._next_plain = self.stats.trials + max(1, self.stats.total // 4)

    def close(self) -> None:
        """On a terminal, erase the live line (the caller prints the summary)."""
        if self.enabled and self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
