"""The event ledger: every migration attempt and job-level event, one JSON object per line.

``events.jsonl`` in the run directory is append-only and written only by the
controller, so lines never interleave. ``torchpass report`` computes the
success rate from it (successful qualifying migrations / qualifying migrations,
the brief's headline metric) and the time lost per event and in total.

Classes follow the brief's failure taxonomy: *qualifying* failures (a process
exit or kill, a hang, a planned drain, a node loss) must be resolved by live
migration; *disqualifying* ones (no spare left, no surviving copy of some state,
a failure of the control plane's host) are recorded but not counted against the
success rate.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["PLANNED", "MigrationEvent", "JobEvent", "Ledger", "read_ledger", "QUALIFYING", "DISQUALIFYING"]

PLANNED = "planned"
"""The cause of a migration asked for without a scheduler signal (SIGTERM, ``torchpass migrate``)."""
QUALIFYING = "qualifying"
DISQUALIFYING = "disqualifying"


@dataclass
class MigrationEvent:
    """One migration attempt: what failed, what was done, how long each phase took."""

    generation: int
    cause: str
    """``kill`` (process exit or signal), ``hang``, ``node`` (a node lost), ``comm`` (a collective failed and no
    process was lost), ``progress`` (no step finished within the hang timeout); planned: ``planned`` (SIGTERM,
    ``torchpass migrate``) or the scheduler signal that asked for it (``slurm-drain``, ``slurm-fail``,
    ``slurm-maint``, see ``core/slurm.py``)."""
    classification: str
    outcome: str
    """``success``, ``superseded`` (a further fault interrupted it; the next attempt continues) or ``failed``."""
    failed_ranks: list[int] = field(default_factory=list)
    replaced: dict[str, str] = field(default_factory=dict)
    """Rank -> the worker id of the spare that took it over."""
    target_step: int = 0
    """The step training resumed at (the re-executed in-flight step)."""
    steps_lost: int = 0
    """Completed steps rolled back (0 when a data-parallel replica held the current state)."""
    sources: dict[str, Any] = field(default_factory=dict)
    """Rank -> ranks its state was copied from, with their coordinates."""
    bytes_moved: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: detect, report, plan, spare_setup, transfer, rebuild, resume, total."""
    message: str = ""
    fenced: dict[str, str] = field(default_factory=dict)
    """Rank -> why the controller fenced it during the migration although the fault was another rank's (a
    survivor that went silent or was not ready in time). Such a migration cost the job more than the failed
    process, so ``torchpass report`` lists it apart from clean ones."""
    trigger: dict[str, Any] = field(default_factory=dict)
    """A planned migration's request: ``signal``, the scheduler's ``reason`` and what it read (``trigger``)."""
    t: float = field(default_factory=time.time)
    type: str = "migration"


@dataclass
class JobEvent:
    """Job-level events: start, end, a spare lost, an operator request."""

    type: str
    message: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    t: float = field(default_factory=time.time)


class Ledger:
    """Appends events to ``<run_dir>/events.jsonl``; flushed and fsynced per line so a crash loses nothing."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.path = Path(run_dir) / "events.jsonl"
        self._lock = threading.Lock()
        self.listeners: list[Callable[[MigrationEvent | JobEvent], None]] = []
        """Called with each event once it is on disk (the live metrics, ``core/metrics.py``)."""

    def drop_torn_line(self) -> int:
        """Cut a last line a killed writer left half-written (a controller taking over appends after it); bytes cut."""
        if not self.path.exists():
            return 0
        with self._lock, open(self.path, "rb+") as f:
            data = f.read()
            keep = data.rfind(b"\n") + 1
            if keep == len(data):
                return 0
            f.truncate(keep)
            return len(data) - keep

    def append(self, event: MigrationEvent | JobEvent) -> None:
        line = json.dumps(dataclasses.asdict(event), sort_keys=True)
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        for listener in self.listeners:
            listener(event)


def read_ledger(run_dir: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Events of a run, in order. A torn last line (the writer killed mid-write) is skipped."""
    path = Path(run_dir) / "events.jsonl"
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
