"""Run one strategy to N steps while injecting the failure schedule; return what happened, raw.

The driver watches the ranks' logs (``bench/workload.py``): progress is the
highest step any rank has completed. Fault i is injected the first time
progress reaches its step. The run's wall time ends when step N is first
completed; the processes then get a grace period to exit on their own.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchpass.core.ledger import read_ledger

from .config import BenchConfig
from .schedule import Fault
from .strategies import Strategy, kill_rank, launch

__all__ = ["RunRecord", "run_strategy", "read_logs"]

POLL_S = 0.02
"""How often the driver reads the logs: the delay between reaching a fault's step and injecting it."""
EXIT_GRACE_S = 10.0
"""How long processes may take to exit after step N before they are killed."""


@dataclass
class RunRecord:
    """One run, as observed."""

    strategy: str
    faults: list[Fault]
    t_launch: float
    t_end: float
    """When step N was first completed."""
    fault_times: list[float]
    """Wall time at which each fault was injected."""
    fault_ranks: list[int]
    """The rank each fault hit (the scheduled one unless it had no live process, see ``kill_rank``)."""
    logs: dict[int, list[dict[str, Any]]]
    """Rank -> its log records in order."""
    ledger: list[dict[str, Any]] = field(default_factory=list)
    """torchpass's events.jsonl (empty for the other strategies)."""

    @property
    def wall_s(self) -> float:
        return self.t_end - self.t_launch


def read_logs(log_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Every rank's records; a line still being written is left for the next read."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(log_dir.glob("rank*.jsonl")):
        records = []
        for line in path.read_text().splitlines(keepends=True):
            if line.endswith("\n"):
                records.append(json.loads(line))
        out[int(path.stem[4:])] = records
    return out


def _progress(log_dir: Path) -> int:
    return max((r["step"] for recs in read_logs(log_dir).values() for r in recs if r["kind"] == "step"), default=0)


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def run_strategy(name: str, cfg: BenchConfig, faults: list[Fault], work: Path) -> RunRecord:
    """Run ``name`` in a fresh ``work`` directory, injecting ``faults``."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t_launch = time.time()
    run = launch(name, cfg, work, len(faults))
    try:
        fault_times, fault_ranks = _drive(run, cfg, faults, t_launch)
        t_end = min(
            r["t"] for recs in read_logs(run.logs).values() for r in recs if r["kind"] == "step" and r["step"] == cfg.workload.steps
        )
        deadline = time.time() + EXIT_GRACE_S
        while any(p.poll() is None for p in run.main) and time.time() < deadline:
            time.sleep(0.1)
    finally:
        run.stop()
    ledger = read_ledger(run.run_dir) if name == "torchpass" else []
    return RunRecord(name, faults, t_launch, t_end, fault_times, fault_ranks, read_logs(run.logs), ledger)


def _drive(run: Strategy, cfg: BenchConfig, faults: list[Fault], t_launch: float) -> tuple[list[float], list[int]]:
    pending = list(faults)
    fault_times: list[float] = []
    fault_ranks: list[int] = []
    while True:
        progress = _progress(run.logs)
        if progress >= cfg.workload.steps:
            return fault_times, fault_ranks
        if pending and progress >= pending[0].at_step:
            fault_ranks.append(kill_rank(run, pending.pop(0).rank, cfg.world_size))
            fault_times.append(time.time())
        ended = [p for p in run.main if p.poll() is not None]
        if ended:
            # A run ends early only if it failed: say how, with the end of its output.
            outputs = "\n".join(f"--- {p.name}\n{_tail(p)}" for p in sorted((run.work / "out").glob("*.log")))
            raise RuntimeError(f"{run.name}: a process exited ({ended[0].returncode}) before step {cfg.workload.steps}:\n{outputs}")
        if time.time() - t_launch > cfg.run_timeout_s:
            raise TimeoutError(f"{run.name}: step {cfg.workload.steps} not reached in {cfg.run_timeout_s:.0f} s")
        time.sleep(POLL_S)
