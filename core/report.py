"""``torchpass report``: the headline figures of a run, computed from its ledger.

Success rate = successful qualifying migrations / qualifying migrations (the
brief's definition). An incident is one fault and everything done about it: a
migration attempt superseded by a further fault continues in the next attempt,
so only an incident's final attempt counts. Time lost per incident is the wall
time from the fault to the re-executed step finishing on every rank.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .critical_path import read_summaries
from .ledger import DISQUALIFYING, QUALIFYING, read_ledger

__all__ = ["RunReport", "build_report", "format_report"]


@dataclass
class RunReport:
    run_dir: str
    job: dict[str, Any] = field(default_factory=dict)
    ended: str = "running (no job_end event yet)"
    exit_code: int | None = None
    qualifying: int = 0
    qualifying_succeeded: int = 0
    succeeded_with_fencing: int = 0
    """Successful qualifying migrations that fenced a process besides the failed ranks' (a survivor went silent)."""
    disqualifying: int = 0
    superseded_attempts: int = 0
    time_lost_s: float = 0.0
    bytes_moved: int = 0
    incidents: list[dict[str, Any]] = field(default_factory=list)
    other_events: list[dict[str, Any]] = field(default_factory=list)
    critical_path: list[dict[str, Any]] = field(default_factory=list)
    """Each rank's per-step time inside torchpass on its training thread (``core/critical_path.py``), once it finished."""

    @property
    def success_rate(self) -> float | None:
        return self.qualifying_succeeded / self.qualifying if self.qualifying else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "success_rate": self.success_rate}

    def add(self, ev: dict[str, Any]) -> None:
        """Count one ledger event (as ``events.jsonl`` holds it); the live metrics count with this too."""
        kind = ev.get("type")
        if kind == "job_start":
            self.job = ev.get("detail", {})
        elif kind in ("job_end", "job_failed"):
            self.ended = ev["message"]
            if kind == "job_end":
                self.exit_code = ev.get("detail", {}).get("exit_code")
        elif kind == "migration":
            if ev["outcome"] == "superseded":
                self.superseded_attempts += 1
                return
            lost = float(ev.get("timings", {}).get("total", 0.0))
            self.incidents.append(
                {
                    "generation": ev["generation"],
                    "cause": ev["cause"],
                    "class": ev["classification"],
                    "outcome": ev["outcome"],
                    "failed_ranks": ev["failed_ranks"],
                    "replaced": ev["replaced"],
                    "resumed_at_step": ev["target_step"],
                    "steps_lost": ev["steps_lost"],
                    "bytes_moved": ev["bytes_moved"],
                    "time_lost_s": lost,
                    "timings": ev.get("timings", {}),
                    "message": ev.get("message", ""),
                    "fenced": ev.get("fenced", {}),
                }
            )
            self.bytes_moved += int(ev["bytes_moved"])
            self.time_lost_s += lost
            if ev["classification"] == QUALIFYING:
                self.qualifying += 1
                self.qualifying_succeeded += ev["outcome"] == "success"
                self.succeeded_with_fencing += ev["outcome"] == "success" and bool(ev.get("fenced"))
            elif ev["classification"] == DISQUALIFYING:
                self.disqualifying += 1
        else:
            self.other_events.append(ev)


def build_report(run_dir: str | Path) -> RunReport:
    run_dir = Path(run_dir)
    if not (run_dir / "events.jsonl").exists():
        raise FileNotFoundError(f"{run_dir} has no events.jsonl; is it the --run-dir of a torchpass launch?")
    rep = RunReport(str(run_dir))
    rep.critical_path = [asdict(s) for s in read_summaries(run_dir)]
    for ev in read_ledger(run_dir):
        rep.add(ev)
    return rep


def format_report(rep: RunReport) -> str:
    lines = [f"run {rep.run_dir}", f"  job: {rep.job.get('world_size', '?')} ranks on {rep.job.get('nnodes', '?')} node(s); {rep.ended}"]
    rate = rep.success_rate
    rate_text = "n/a (no qualifying failure)" if rate is None else f"{rate:.0%} ({rep.qualifying_succeeded}/{rep.qualifying})"
    lines.append(f"  success rate (qualifying migrations): {rate_text}")
    if rep.succeeded_with_fencing:
        lines.append(
            f"  of which {rep.succeeded_with_fencing} fenced a process besides the failed rank(s) (marked *): "
            "a survivor went silent and was replaced too"
        )
    lines.append(f"  disqualifying events: {rep.disqualifying}; attempts superseded by a further fault: {rep.superseded_attempts}")
    lines.append(f"  time lost: {rep.time_lost_s:.2f} s in total; state moved: {rep.bytes_moved / 1e6:.1f} MB")
    if rep.incidents:
        lines.append("")
        lines.append(f"  {'gen':>3}  {'cause':<12} {'class':<13} {'outcome':<8} {'ranks':<10} {'step':>5} {'lost s':>7} {'MB':>8}  phases (s)")
        for inc in rep.incidents:
            phases = " ".join(f"{k}={v:.2f}" for k, v in inc["timings"].items() if k != "total")
            mark = "*" if inc["fenced"] else " "
            lines.append(
                f" {mark}{inc['generation']:>3}  {inc['cause']:<12} {inc['class']:<13} {inc['outcome']:<8} "
                f"{','.join(map(str, inc['failed_ranks'])):<10} {inc['resumed_at_step']:>5} {inc['time_lost_s']:>7.2f} "
                f"{inc['bytes_moved'] / 1e6:>8.1f}  {phases}"
            )
            for rank, why in inc["fenced"].items():
                lines.append(f"        fenced rank {rank}: {why}")
    if rep.critical_path:
        lines.append("")
        lines.append("  training thread inside torchpass, per step (us; mean over the rank's steps):")
        for timers in rep.critical_path:
            sections = " ".join(f"{k}={v:.0f}" for k, v in timers["per_step_us"].items())
            lines.append(
                f"    rank {timers['rank']}: {timers['total_us']:.0f} us of a {timers['step_s'] * 1e3:.1f} ms step "
                f"({timers['fraction']:.2%}) over {timers['steps']} steps: {sections}"
            )
    return "\n".join(lines)


def report_json(rep: RunReport) -> str:
    return json.dumps(rep.to_dict(), indent=1, sort_keys=True)
