"""The job's progress over time: sampled once a second by node 0's launcher, kept in ``<run_dir>/timeline.jsonl``.

One sample: the time, the step rank 0 executes (its heartbeat: one store read),
the generation, the spares free and whether a migration runs. The live metrics
(``core/metrics.py``) read every sample; the file keeps one when something other
than the step changed (a migration began or ended, a spare came or went) and
otherwise one per ``KEEP_EVERY_S``, so a month-long job writes a few MB.
``torchpass report --plot`` draws it with the ledger's migrations.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .control import Heartbeat, Keys, try_get

if TYPE_CHECKING:
    from .controller import Controller

__all__ = ["ProgressSample", "Timeline", "read_timeline", "take_sample", "SAMPLE_S"]

SAMPLE_S = 1.0
"""Seconds between samples: finer than any scrape interval, one store read each."""

KEEP_EVERY_S = 10.0
"""Seconds between kept samples while nothing but the step changes: a plot's resolution, 8,640 lines a day."""

FILE = "timeline.jsonl"


@dataclass(frozen=True)
class ProgressSample:
    t: float
    step: int | None
    """The step rank 0 executes (None before its first heartbeat)."""
    generation: int
    spares_free: dict[int, int]
    """Node -> ready spares no rank was given."""
    migrating: bool


def take_sample(controller: Controller) -> ProgressSample:
    free: dict[int, int] = {n: 0 for n in range(controller.spec.nnodes)}
    for node in controller.spares.values():
        free[node] = free.get(node, 0) + 1
    wid = controller.members.get(0)
    beat = try_get(controller.store, Keys.heartbeat(wid), Heartbeat) if wid is not None else None
    return ProgressSample(time.time(), beat.step if beat else None, controller.generation, free, controller.migration is not None)


class Timeline:
    """Appends kept samples to ``<run_dir>/timeline.jsonl`` (see the module docstring)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / FILE
        self._last: ProgressSample | None = None

    def record(self, sample: ProgressSample, keep: bool = False) -> None:
        """Append ``sample`` if it is to be kept; ``keep``: in any case (the job's last)."""
        last = self._last
        changed = last is None or (sample.generation, sample.spares_free, sample.migrating) != (last.generation, last.spares_free, last.migrating)
        if not keep and not changed and last is not None and sample.t - last.t < KEEP_EVERY_S:
            return
        self._last = sample
        row = asdict(sample)
        row["spares_free"] = {str(n): c for n, c in sample.spares_free.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def read_timeline(run_dir: str | Path) -> list[dict[str, Any]]:
    """The kept samples of a run, oldest first (a torn last line is skipped); empty if none were kept."""
    path = Path(run_dir) / FILE
    if not path.exists():
        return []
    rows = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return rows
