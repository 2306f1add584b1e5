"""The seeded failure schedule every fault-tolerant strategy receives.

Faults are placed in training progress, not wall time: fault i is a SIGKILL of
rank ``rank`` the first time the job completes step ``at_step`` (a strategy that
rolls back does not see it again). Gaps between faults, and before the first,
are drawn uniformly from ``[min_gap_k, max_gap_k] x K`` steps, K being the
checkpoint interval: the proportions of the commercial product's published
benchmark (a checkpoint every K steps, a fault every 3 to 5 K steps).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .config import ScheduleConfig

__all__ = ["Fault", "fault_schedule"]


@dataclass(frozen=True)
class Fault:
    """One injected fault."""

    at_step: int
    """Injected once the job has completed this step for the first time."""
    rank: int
    """The rank (torchft: the replica group) whose process is SIGKILLed."""


def fault_schedule(cfg: ScheduleConfig, steps: int, world_size: int) -> list[Fault]:
    """The faults for a job of ``steps`` steps on ``world_size`` ranks (the same for every strategy)."""
    rng = random.Random(cfg.seed)
    k = cfg.checkpoint_every
    faults: list[Fault] = []
    at = 0
    while True:
        at += max(1, round(rng.uniform(cfg.min_gap_k * k, cfg.max_gap_k * k)))
        if at > steps - cfg.tail_steps:
            return faults
        faults.append(Fault(at, rng.randrange(world_size)))
