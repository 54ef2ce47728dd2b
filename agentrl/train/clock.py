"""Where a training step's time goes, phase by phase, on the device's own timeline.

On a GPU each phase boundary is a CUDA event recorded in the current stream: marking costs no
synchronisation, and the phases are read once, after the step, with one wait. A phase's time is
then the GPU's time between its boundaries, host stalls included (a starved GPU waits inside the
phase that starved it). Elsewhere the boundaries are wall-clock readings.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class StepClock:
    """`mark(phase)` closes the running phase and opens `phase`; `mark(None)` closes the last.
    `seconds()` sums each phase's intervals (a phase may be opened many times: the forward and
    backward of each micro-batch)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str | None, Any]] = []

    def mark(self, phase: str | None) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((phase, event))
        else:
            self._marks.append((phase, time.perf_counter()))

    def seconds(self) -> dict[str, float]:
        if not self._marks:
            return {}
        if self.cuda:
            self._marks[-1][1].synchronize()
        out: dict[str, float] = {}
        for (phase, start), (_, end) in zip(self._marks, self._marks[1:], strict=False):
            if phase is None:
                continue
            took = start.elapsed_time(end) / 1000 if self.cuda else end - start
            out[phase] = out.get(phase, 0.0) + took
        return out
