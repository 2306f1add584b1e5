"""The runtime's own timers: how long the training thread spends inside torchpass, per step.

Whatever torchpass does on the training thread lengthens every step; the rest
(mirror writes, buddy pushes, heartbeats) runs on threads of its own. Each
per-step hook of :class:`~torchpass.core.runtime.Runtime` adds its elapsed
time here under a section name, and each step start closes the previous step's
period, so the result is the hooks' share of the step as the job ran it (CPU
contention included), not an estimate.

A step period counts only when the next step follows it directly (same
generation, next number): a migration's recovery is not a step.

At the end of the run each rank writes its summary to
``<run_dir>/timers/rank<r>.json`` (:data:`TIMERS`); ``torchpass report`` and
the benchmarks read them.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["SECTIONS", "TIMERS", "CriticalPathTimers", "CriticalPathSummary", "read_summaries"]

TIMERS = "timers"
"""The run-dir folder of the ranks' timer summaries."""

SECTIONS = ("step_begin", "backward", "collective_gate", "commit", "step_end")
"""The runtime's per-step hooks, each timed on the training thread."""


@dataclass
class CriticalPathSummary:
    """One rank's timers at the end of its run (per step: means over the counted step periods)."""

    rank: int
    steps: int
    """Step periods counted (a step followed directly by the next one)."""
    step_s: float
    """Mean wall time of a counted step period."""
    per_step_us: dict[str, float]
    """Mean microseconds per step spent in each section."""
    total_us: float
    """Their sum: the training thread's time inside torchpass per step."""
    fraction: float
    """``total_us`` as a fraction of the step."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Counters other parts of the runtime add (e.g. the buddy copies' bytes)."""


class CriticalPathTimers:
    """Accumulates the training thread's time per section and the step periods (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._seconds = dict.fromkeys(SECTIONS, 0.0)
        self._counted = dict.fromkeys(SECTIONS, 0.0)
        self._at_open = dict.fromkeys(SECTIONS, 0.0)
        self._steps = 0
        self._step_seconds = 0.0
        self._open: tuple[int, int, float] | None = None

    def add(self, section: str, started: float) -> None:
        """Add the time since ``started`` (a :attr:`clock` reading) to ``section``."""
        self._seconds[section] += self.clock() - started

    def step_started(self, generation: int, step: int, now: float) -> None:
        """A step starts: close the previous period if this step follows it directly."""
        if self._open is not None:
            generation0, step0, started = self._open
            if generation == generation0 and step == step0 + 1:
                self._steps += 1
                self._step_seconds += now - started
                # Only the counted periods' section time, so the fraction compares like with like.
                for name in SECTIONS:
                    self._counted[name] += self._seconds[name] - self._at_open[name]
        self._open = (generation, step, now)
        self._at_open = dict(self._seconds)

    def summary(self, rank: int, extra: dict[str, Any] | None = None) -> CriticalPathSummary:
        steps = max(self._steps, 1)
        per_step = {name: self._counted[name] / steps * 1e6 for name in SECTIONS}
        total = sum(per_step.values())
        step_s = self._step_seconds / steps
        return CriticalPathSummary(rank, self._steps, step_s, per_step, total, total / 1e6 / step_s if step_s else 0.0, extra or {})

    def write(self, run_dir: Path, rank: int, extra: dict[str, Any] | None = None) -> None:
        """``<run_dir>/timers/rank<r>.json``, written whole or not at all."""
        folder = run_dir / TIMERS
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"rank{rank}.json.tmp"
        tmp.write_text(json.dumps(asdict(self.summary(rank, extra))))
        os.replace(tmp, folder / f"rank{rank}.json")


def read_summaries(run_dir: str | Path) -> list[CriticalPathSummary]:
    """Every rank's summary in ``run_dir``, by rank (empty when the run wrote none)."""
    folder = Path(run_dir) / TIMERS
    if not folder.is_dir():
        return []
    found = [CriticalPathSummary(**json.loads(p.read_text())) for p in folder.glob("rank*.json")]
    return sorted(found, key=lambda s: s.rank)
