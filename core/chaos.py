"""Deterministic chaos: one fault at one protocol point of one step, on one rank (``ChaosConfig``).

``torchpass inject`` and ``torchpass chaos`` land faults from outside, at
wall-clock moments; the windows where a race would hide a bug (inside the
optimizer step, right as the backward starts) need a fault at an exact point.
The runtime calls ``fire(point, step)`` at each point, but only when a
:class:`ChaosTrigger` exists: with chaos off (the default) none is built and
the per-step path pays one ``is None`` test.

The trigger fires in the process first started for the rank, never in the
spare that replaces it (the fault would repeat forever).
"""

from __future__ import annotations

import os
import signal
import threading
import time

from .config import ChaosConfig

__all__ = ["ChaosTrigger", "chaos_trigger", "TERM_HOLD_S"]

POINTS_REPORTED_BY_SOME = (
    "last_forward: only DeepSpeed's unchanged loops, which see each forward call; commit and after_commit: "
    "only steps whose optimizer step runs"
)
"""Which points some training loops never reach, for the error that names a point that never came."""

TERM_HOLD_S = 60.0
"""``term``: the longest a rank is held at the point waiting for its drain to end the generation."""


class ChaosTrigger:
    """Kills, stalls or drains this process at the configured point of the configured step (once)."""

    def __init__(self, config: ChaosConfig, rank: int, ending: threading.Event):
        self._config = config
        self._rank = rank
        self._ending = ending
        self._fired = False

    def fire(self, point: str, step: int) -> None:
        c = self._config
        if self._fired or c.kill_step != step or c.kill_point != point:
            return
        self._fired = True
        print(f"[torchpass] chaos: {c.action} rank {self._rank} at {point} of step {step}", flush=True)
        if c.action == "term":
            os.kill(os.getpid(), signal.SIGTERM)  # the handler asks for the drain
            # Held at the point until the drain ends the generation, so every rank is caught there
            # (inside the commit: all of them mid-collective), then on into the dead generation.
            self._ending.wait(TERM_HOLD_S)
            return
        if c.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # stall: heartbeats go on, the step never finishes
            time.sleep(3600)

    def check_fired(self, step: int) -> None:
        """At the end of ``step``: raise if it was the configured step and its point never came.

        A point the training loop does not report (``last_forward`` outside DeepSpeed's
        unchanged loops, ``commit`` in a step whose update was skipped) would otherwise
        leave a fault test passing with no fault injected.
        """
        c = self._config
        if self._fired or c.kill_step != step:
            return
        raise RuntimeError(
            f"torchpass: chaos.kill_point {c.kill_point!r} never came in step {step} on rank {self._rank}, so no "
            f"fault was injected: this training loop does not report that point ({POINTS_REPORTED_BY_SOME})"
        )


def chaos_trigger(config: ChaosConfig, rank: int | None, role: str, ending: threading.Event) -> ChaosTrigger | None:
    """The trigger for this process, or None when chaos is off or aimed elsewhere; ``ending``: the generation's end."""
    if config.kill_rank < 0 or rank != config.kill_rank or role != "active" or os.environ.get("TORCHPASS_STARTED_AS") != "active":
        return None
    return ChaosTrigger(config, rank, ending)
