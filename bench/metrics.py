"""Figures of one run, derived from its rank logs (and, for torchpass, its ledger).

Definitions (the same for every strategy):

* wall time: launch to the first completion of step N; training time: first
  completion of step 1 to that of step N (what faults can cost: process start-up
  before step 1 varies by seconds from run to run on a shared machine, with or
  without faults, so time lost is computed on training time);
* steps recomputed: completed steps completed again (a rollback), counted on the
  rank that redid most; steps discarded: torchft step attempts whose gradients
  were thrown away because the all-reduce failed (that work is lost too);
* samples skipped: ``N x world x batch`` minus the samples the N committed steps
  trained (torchft trains only the participating groups' batches);
* steady-state step time: mean period between first completions of steps
  ``w+1..N`` of a fault-free run (checkpoint saves included), ``w`` warm-up steps;
  pace: the same period in a run with faults, up to its first fault;
* recovery of a fault: torchpass's ledger timings; for the others, from the rank
  logs: restart and re-initialisation, then the steps recomputed until the
  restarted processes complete the step the job had reached, or the next one
  when the checkpoint holds that step (checkpoint); the
  survivors' longest stall between two step completions after the fault, and
  when the killed group trains again (torchft). Each total includes the compute
  of one step, as torchpass's does (it ends when the re-executed step is done).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .runner import RunRecord

__all__ = ["RunFigures", "figures", "time_lost_per_fault", "time_lost_per_fault_paced"]


@dataclass
class RunFigures:
    """What one run measured."""

    strategy: str
    faults: int
    """Faults injected."""
    wall_s: float
    """Launch to the first completion of step N."""
    train_s: float
    """First completion of step 1 to the first completion of step N."""
    steps_recomputed: int
    """Completed steps done again (rollback to a checkpoint)."""
    steps_discarded: int
    """Step attempts thrown away without committing (torchft after a failed all-reduce)."""
    samples_skipped: int
    """Samples of the N steps never trained."""
    step_s: float
    """Mean step period after warm-up (meaningful for fault-free runs)."""
    pace_s: float
    """Mean step period from warm-up to the first fault: the run's own undisturbed pace."""
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    """Per fault: step, rank, ``total_s`` and the phases, in seconds."""
    bytes_moved: int = 0
    """State bytes sent to replacement processes (torchpass)."""
    fetch_s: float = 0.0
    """Time the replacement spent fetching them (torchpass, summed over faults)."""
    progress: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since launch, step) for every completed step: the plot's curve."""


def _steps(run: RunRecord) -> list[dict[str, Any]]:
    return sorted((r for recs in run.logs.values() for r in recs if r["kind"] == "step" and r["t"] <= run.t_end), key=lambda r: r["t"])


def _first_completion(steps: list[dict[str, Any]]) -> dict[int, float]:
    first: dict[int, float] = {}
    for r in steps:
        first.setdefault(r["step"], r["t"])
    return first


def figures(run: RunRecord, n_steps: int, world: int, batch: int) -> RunFigures:
    """The figures of ``run``, a job of ``n_steps`` steps on ``world`` ranks of ``batch`` samples each.

    The steady state is measured after a fifth of the steps (at least 3): hot spares and late
    replica groups finish starting up while the first steps run."""
    steps = _steps(run)
    recomputed = 0
    discarded = 0
    for recs in run.logs.values():
        done = [r["step"] for r in recs if r["kind"] == "step" and r["t"] <= run.t_end]
        recomputed = max(recomputed, len(done) - len(set(done)))
        discarded = max(discarded, sum(1 for r in recs if r["kind"] == "discarded" and r["t"] <= run.t_end))
    trained: dict[int, int] = {}
    for r in steps:
        trained[r["step"]] = max(trained.get(r["step"], 0), r["samples"])
    skipped = sum(world * batch - trained.get(s, 0) for s in range(1, n_steps + 1))
    first = _first_completion(steps)
    w = min(max(3, n_steps // 5), n_steps - 1)
    step_s = (first[n_steps] - first[w]) / (n_steps - w) if w in first else (first[n_steps] - run.t_launch) / n_steps
    first_fault = min((f.at_step for f in run.faults[: len(run.fault_times)]), default=n_steps)
    pace_s = (first[first_fault] - first[w]) / (first_fault - w) if w in first and first_fault > w else step_s
    out = RunFigures(
        strategy=run.strategy,
        faults=len(run.fault_times),
        wall_s=run.wall_s,
        train_s=first[n_steps] - first.get(1, run.t_launch),
        steps_recomputed=recomputed,
        steps_discarded=discarded,
        samples_skipped=skipped,
        step_s=step_s,
        pace_s=pace_s,
        progress=[(r["t"] - run.t_launch, r["step"]) for r in steps],
    )
    if run.strategy == "torchpass":
        _torchpass_recoveries(run, out)
    elif run.strategy == "checkpoint":
        _restart_recoveries(run, steps, out)
    elif run.strategy == "torchft":
        _torchft_recoveries(run, steps, out)
    return out


def _torchpass_recoveries(run: RunRecord, out: RunFigures) -> None:
    migrations = [e for e in run.ledger if e["type"] == "migration" and e["outcome"] == "success"]
    for fault, event in zip(run.faults, migrations):
        timings = dict(event["timings"])
        out.recoveries.append(
            {"at_step": fault.at_step, "rank": fault.rank, "total_s": timings.pop("total", 0.0), "phases": timings, "steps_lost": event["steps_lost"]}
        )
        out.bytes_moved += int(event["bytes_moved"])
        out.fetch_s += float(timings.get("fetch", 0.0))


def _window(run: RunRecord, i: int) -> tuple[float, float]:
    end = run.fault_times[i + 1] if i + 1 < len(run.fault_times) else run.t_end
    return run.fault_times[i], end


def _restart_recoveries(run: RunRecord, steps: list[dict[str, Any]], out: RunFigures) -> None:
    records = [r for recs in run.logs.values() for r in recs]
    for i, fault in enumerate(run.faults[: len(run.fault_times)]):
        t_fault, t_next = _window(run, i)
        rank = run.fault_ranks[i]
        reached = max(r["step"] for r in steps if r["t"] <= t_fault)
        starts = [r for r in records if r["kind"] == "start" and t_fault < r["t"] <= t_next]
        restarted = {r["pid"] for r in starts}
        ready = [(r["t"], r["step"]) for r in records if r["kind"] == "ready" and r["pid"] in restarted]
        # Back where it was: the restarted processes complete the step the job had reached (or, when the newest
        # checkpoint is that step, the step after it).
        back = sorted(r["t"] for r in steps if r["step"] >= reached and r["pid"] in restarted)
        if not (starts and ready and back):
            out.recoveries.append({"at_step": fault.at_step, "rank": rank, "total_s": None, "phases": {}, "note": "not recovered"})
            continue
        t_ready, resumed_from = max(ready)
        t_start = min(r["t"] for r in starts)
        out.recoveries.append(
            {
                "at_step": fault.at_step,
                "rank": rank,
                "total_s": back[0] - t_fault,
                "phases": {
                    "detect_and_restart": t_start - t_fault,
                    "init_and_load": t_ready - t_start,
                    "recompute": back[0] - t_ready,
                },
                "steps_lost": reached - resumed_from,
            }
        )


def _torchft_recoveries(run: RunRecord, steps: list[dict[str, Any]], out: RunFigures) -> None:
    first = sorted(_first_completion(steps).items())
    for i, fault in enumerate(run.faults[: len(run.fault_times)]):
        t_fault, t_next = _window(run, i)
        # The survivors' stall: the longest gap between step completions from the last one before the fault
        # on (the step in flight may still commit before the quorum notices the loss).
        times = [t for _, t in first if t <= t_fault][-1:] + [t for _, t in first if t_fault < t <= t_next]
        gaps = [(b - a, b) for a, b in zip(times, times[1:])]
        resumed = max(gaps)[1] - t_fault if gaps else None
        rank = run.fault_ranks[i]
        victim = run.logs.get(rank, [])
        old_pids = {r["pid"] for r in victim if r["t"] <= t_fault}
        rejoined = [r["t"] for r in steps if t_fault < r["t"] <= t_next and r["rank"] == rank and r["pid"] not in old_pids]
        out.recoveries.append(
            {
                "at_step": fault.at_step,
                "rank": rank,
                "total_s": resumed,
                "phases": {"survivors_resume": resumed, "group_rejoins": rejoined[0] - t_fault if rejoined else None},
                "note": "" if rejoined else "the killed group did not rejoin before the next fault or step N",
            }
        )


def time_lost_per_fault(faulty: RunFigures, clean: RunFigures, world: int, batch: int) -> float | None:
    """Wall time lost per fault to train the same samples: the training-time difference to the fault-free run of
    the same strategy, plus the time the extra skipped samples would take at the steady step rate."""
    if faulty.faults == 0:
        return None
    extra_steps = (faulty.samples_skipped - clean.samples_skipped) / (world * batch)
    return (faulty.train_s - clean.train_s + extra_steps * clean.step_s) / faulty.faults


def time_lost_per_fault_paced(faulty: RunFigures, clean: RunFigures, n_steps: int, world: int, batch: int) -> float | None:
    """The same, against the faulty run's own pace before its first fault instead of another run: training time
    minus ``N - 1`` steps at that pace, plus the extra skipped samples at that pace. Insensitive to the machine
    being faster or slower in one run than in the other (a shared machine), sensitive to the pace's own noise."""
    if faulty.faults == 0:
        return None
    extra_steps = (faulty.samples_skipped - clean.samples_skipped) / (world * batch)
    return (faulty.train_s - (n_steps - 1 - extra_steps) * faulty.pace_s) / faulty.faults
