"""The worker's side of a migration: a survivor's recovery and a spare's join.

Both end the same way, by *entering* the generation the controller planned
(:meth:`Migration._enter`): load what the plan says this rank fetches,
publish the rank's address, report ready, wait for ``go``, rebuild every
process group on the new generation, barrier, and resume at
``target_version + 1``. An attempt can be abandoned at any of these steps (a
member or a source died, a transfer failed); the rank is then in the planned
generation and reports again there.

Survivor (:meth:`Migration.recover`), after a collective failed or the
generation ended:

1. release the rank's process groups and end the generation if nobody has;
   a rank whose CUDA context a sticky error broke leaves here as a failed
   rank (:data:`~torchpass.core.devices.CUDA_BROKEN_EXIT`);
2. undo the interrupted step: partial gradients dropped, RNG and the
   provider's extras back to the step start, data rewound (a rank that died
   inside its commit is *dirty*: its state will be copied from a replica);
3. publish its state for others to copy and report ``(version, clean)``;
4. wait for the next generation's plan: leave if the plan gives the rank to
   another process (this one was declared lost), stay a source and exit if it
   retires the rank (a drain), else enter it; report again on an abandoned
   attempt.

Spare (:meth:`Migration.join`): it ran the training script with local groups
up to the first step boundary; it enters the generation of its assignment as
the rank it replaces, fetching every class of state, and leaves if a later
plan releases it. A framework whose set-up needs the state (Megatron-LM's)
has the spare fetch it during set-up (:meth:`Migration.prefetch`, still with
local groups) and enter at the first step boundary; the small state is
restored only then, since set-up between may draw random numbers.

Invariants: a rank resumes only after ``go`` for a generation whose every
member loaded the plan's target version; a process whose rank was given to
another process never joins a generation; the ``done`` record is written at
the first step boundary after the migration (or at the end of training).

It works on the runtime's step bookkeeping (``step``, ``version``,
``clean``, ``in_step``, ``committing``) and identity, which
:class:`~torchpass.core.runtime.Runtime` owns.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from . import comms, devices
from .control import Keys, Plan, Ready, Status, put_counted
from .liveness import STORE_LOST_EXIT
from .state_copy import Timings
from .transfer import TransferError

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["Migration"]


def _now() -> float:
    return time.time()


class Migration:
    """Recovery and joining for one worker's runtime (see the module docstring)."""

    def __init__(self, rt: Runtime):
        self._rt = rt
        self._timings = Timings()
        self._pending_done: dict[str, Any] | None = None
        self._prefetched: tuple[int, dict[str, Any] | None] | None = None
        """(generation, small state) of a spare's :meth:`prefetch`, until it enters that generation."""
        self._prefetched_at = 0.0

    # ---- survivor ----------------------------------------------------------------
    def recover(self, cause: str) -> int:
        """Run the survivor side of a migration; returns the step to execute next."""
        rt = self._rt
        assert rt.provider is not None and rt.rank is not None and rt.copier is not None
        t_fail = _now()
        rt.phase = "recover"
        comms.release_generation(rt.generation)
        rt.store.compare_set(Keys.end(rt.generation), "", f"rank {rt.rank}: {cause}"[:500])
        running = comms.settle_device_copies()
        if running:
            print(f"[torchpass] rank {rt.rank}: {running} abandoned CUDA collective(s) still running after release", file=sys.stderr, flush=True)
        broken = devices.cuda_context_error()
        if broken is not None:
            # Its state on the device may be anything, and every CUDA call would fail: a failed rank.
            print(f"[torchpass] rank {rt.rank}: leaving as a failed rank, its CUDA context is broken: {broken}", file=sys.stderr, flush=True)
            os._exit(devices.CUDA_BROKEN_EXIT)
        aborted = rt.in_step
        interrupted_step = rt.step
        dirty = rt.committing
        rt.committing = False
        rt.in_step = False
        rt.discard_step_gate()
        rt.provider.discard_step()
        if aborted and not dirty and rt.version == interrupted_step - 1:
            # Back to exactly the state at the start of the interrupted step: its
            # forward already drew random numbers and updated buffers.
            assert rt.step_small is not None
            rt.copier.restore_rng(rt.step_small["rng"])
            if rt.data is not None:
                start = rt.data.step_start(interrupted_step)
                assert start is not None
                rt.data.seek(start)
        rt.clean = not dirty
        self._timings = Timings()
        while True:
            buddy = rt.buddy
            status = Status(
                rt.rank,
                rt.wid,
                rt.version,
                rt.clean,
                interrupted_step,
                list(rt.server.address),
                draining=rt.drain_requested,
                snapshots=buddy.snapshot_versions() if buddy is not None else [],
                holds={str(k): v for k, v in buddy.held_versions().items()} if buddy is not None else {},
            )
            rt.server.publish(rt.copier.capture(rt.version))
            put_counted(rt.store, rt.generation, "status", Keys.status(rt.generation, rt.rank), status)
            plan = rt.answers.plan(rt.generation + 1)
            replaced_by = plan.joins.get(str(rt.rank))
            if replaced_by is not None and rt.wid not in plan.retire:
                # Declared lost (stopped, or its node cut off) while the job went on: its rank
                # belongs to another process now, which must be the only one to join as it.
                self._exit_replaced(replaced_by)
            if rt.wid in plan.retire:
                self._retire(plan)
                rt.monitor.enter(plan.generation)
                continue
            if self._enter(plan, joining=False):
                break
        rt.server.publish(None)
        self._pending_done = {"recovered_s": _now() - t_fail}
        rt.phase = "train"
        return plan.target_version + 1

    def _exit_replaced(self, by: str) -> None:
        rt = self._rt
        print(
            f"[torchpass] rank {rt.rank} ({rt.wid}): the controller gave this rank to {by} (this process was "
            "declared lost); exiting",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(STORE_LOST_EXIT)

    def _retire(self, plan: Plan) -> None:
        """A draining rank: stay a source until the new generation starts, then leave."""
        rt = self._rt
        if not rt.answers.go(plan.generation):
            return
        rt.phase = "done"
        print(f"[torchpass] rank {rt.rank} ({rt.wid}) handed over to {plan.joins[str(rt.rank)]}; exiting", flush=True)
        rt.server.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    # ---- spare -------------------------------------------------------------------
    def prefetch(self, plan: Plan, assigned_at: float) -> Plan:
        """Fetch the state of the spare's assignment now, without going live; returns the plan fetched for.

        For frameworks whose set-up must see the state before the loop starts
        (Megatron-LM sizes its data pipeline and loop counters from a loaded
        checkpoint) while the set-up's collectives must stay local: the spare
        enters the generation later, at :meth:`join`, with the small state
        (RNG streams, data position) restored only then.
        """
        self._timings = Timings()
        self._timings.add("spare_setup", _now() - assigned_at)
        while True:
            failure, small = self._fetch(plan, joining=True, defer_small=True)
            if not failure:
                self._prefetched = (plan.generation, small)
                self._prefetched_at = _now()
                return plan
            self._go_live(plan, failure)  # reports the failed attempt; the controller plans again
            plan = self._next_assignment(plan)

    def join(self, plan: Plan, assigned_at: float) -> int:
        """Enter ``plan`` (the spare's assignment) as the rank it replaces; returns the first step to execute."""
        if self._prefetched is None:
            self._timings = Timings()
            self._timings.add("spare_setup", _now() - assigned_at)
        else:
            self._timings.add("spare_setup", _now() - self._prefetched_at)
        while not self._enter(plan, joining=True):
            plan = self._next_assignment(plan)
        self._pending_done = {"recovered_s": _now() - assigned_at}
        return plan.target_version + 1

    def _next_assignment(self, plan: Plan) -> Plan:
        """The next plan, if it still gives this spare the rank; else the spare leaves."""
        rt = self._rt
        plan = rt.answers.plan(plan.generation + 1)
        if plan.joins.get(str(rt.rank)) != rt.wid:
            print(f"[torchpass] spare {rt.wid} was released from rank {rt.rank}; exiting", flush=True)
            sys.stdout.flush()
            os._exit(0)
        return plan

    # ---- entering a generation ---------------------------------------------------
    def _enter(self, plan: Plan, *, joining: bool) -> bool:
        """Fetch what the plan says, report ready, and go live on ``plan.generation``.

        Returns False when the attempt was abandoned (a member or a source died,
        a transfer failed): the rank is then in ``plan.generation`` and reports
        again there, and the controller plans the next generation.
        """
        rt = self._rt
        assert rt.copier is not None
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[0] == plan.generation:
            failure = ""
            rt.copier.restore_small(prefetched[1], joining=joining)
        else:
            failure, _ = self._fetch(plan, joining=joining, defer_small=False)
        return self._go_live(plan, failure)

    def _fetch(self, plan: Plan, *, joining: bool, defer_small: bool) -> tuple[str, dict[str, Any] | None]:
        """Load what ``plan`` says this rank fetches; returns the failure ("" if none) and any deferred small state."""
        rt = self._rt
        assert rt.rank is not None and rt.copier is not None
        failure, small = "", None
        t0 = _now()
        try:
            small = rt.copier.apply(plan, self._timings, joining=joining, defer_small=defer_small)
            rt.version = plan.target_version
        except (TransferError, OSError) as exc:
            failure = f"rank {rt.rank} could not fetch its state: {exc}"
            print(f"[torchpass] {failure}", file=sys.stderr, flush=True)
        self._timings.add("transfer", _now() - t0)
        return failure, small

    def _go_live(self, plan: Plan, failure: str) -> bool:
        """Report this attempt (ready, or its failure), wait for ``go``, and rebuild the groups on ``plan.generation``."""
        rt = self._rt
        assert rt.rank is not None
        rt.publish_rankinfo(plan.generation)
        answer = Ready(rt.wid, plan.generation, failure)
        put_counted(rt.store, plan.generation, "ready", Keys.ready(plan.generation, rt.rank), answer)
        go = rt.answers.go(plan.generation)
        rt.monitor.enter(plan.generation)
        if not go:
            return False
        t0 = _now()
        try:
            comms.rebuild_all(rt.store, plan.generation, timedelta(seconds=rt.config.rebuild_timeout_s))
            dist.barrier()
            if hasattr(rt.provider, "resume"):
                rt.provider.resume()  # type: ignore[union-attr]
        except (dist.DistError, RuntimeError) as exc:
            if not rt.is_comm_failure(exc):
                raise
            # A member died between "go" and the end of the rebuild: this generation is over too.
            reason = f"rank {rt.rank}: rebuilding generation {plan.generation} failed: {exc}"
            print(f"[torchpass] {reason}", file=sys.stderr, flush=True)
            comms.release_generation(plan.generation)
            rt.store.compare_set(Keys.end(plan.generation), "", reason[:500])
            return False
        self._timings.add("rebuild", _now() - t0)
        rt.version = plan.target_version
        rt.step = plan.target_version + 1
        rt.clean = True
        rt.protect()
        return True

    # ---- the done record -----------------------------------------------------------
    @property
    def done_pending(self) -> bool:
        """A migration finished and its ``done`` record is not written yet."""
        return self._pending_done is not None

    def report_done(self) -> None:
        """Write the ``done`` record of the migration this rank just finished, with its timings."""
        rt = self._rt
        assert self._pending_done is not None and rt.rank is not None
        timings = self._timings
        detail = {**self._pending_done, **timings.values, "bytes": timings.bytes_moved, "t_done": _now()}
        put_counted(rt.store, rt.generation, "done", Keys.done(rt.generation, rt.rank), detail)
        self._pending_done = None
