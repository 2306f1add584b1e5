"""The in-worker side of live migration: step bookkeeping, liveness, recovery and joining.

One :class:`Runtime` lives in every process ``torchpass launch`` starts. It
implements the worker half of the migration protocol; the controller
(:mod:`torchpass.core.controller`) implements the other half.

Steady state (per step, nothing on the critical path but a few microseconds):

* ``step_begin(k)`` snapshots the RNG streams locally and records where step k's
  batches start; a background thread mirrors the rank's small state (RNG, data
  position) to the store at each step start and each commit;
* the *commit* of step k is its optimizer step. Until the commit begins the
  rank's state is version k-1; once it ends, version k; a failure inside it
  leaves the state *dirty* (unusable, it will be copied from a replica);
* a heartbeat thread writes ``hb/<wid>`` every ``heartbeat_interval_s``; a
  monitor thread blocks on ``g/<g>/end`` and, when the controller (or a peer)
  ends the generation, releases this rank's process groups so a collective
  blocked on a dead or hung peer returns at once; a watchdog ends the process
  if the store stops answering for ``store_timeout_s``.

Survivor recovery (``recover``), after a collective failed or the generation
ended: release own groups, end the generation if nobody has, undo the
interrupted step (partial gradients, RNG back to the step start, data rewound),
publish the state for others to copy, report ``(version, clean)``, wait for the
plan of the next generation, fetch state if the plan says so (a rank that
lagged or was dirty), report ready, wait for ``go``, rebuild all process groups
on the new generation, barrier, and resume at ``target_version + 1``.

Spare join (``attach`` on a spare): the spare ran the training script with
local process groups; it fetches every class of state from the sources the
plan names, restores the small state of the rank it replaces, replays set-up
decisions (DDP buckets) while still local, reports ready, waits for ``go``,
goes live on the new generation, barrier, and resumes with the survivors.

Collaborators, each a module of its own: :mod:`~torchpass.core.liveness`
(heartbeats, the store watchdog), :mod:`~torchpass.core.generation_monitor`
(the end of a generation), :mod:`~torchpass.core.mirror` (small state to the
store), :mod:`~torchpass.core.controller_answers` (waits for the controller),
:mod:`~torchpass.core.signals` and :mod:`~torchpass.core.chaos`. What remains
here is the protocol itself: the step hooks, recovery and joining, which share
the steps of entering a generation.

Requirements on the training loop: steps are delimited by ``step_begin`` /
``step_end``; the optimizer step is the only place the persistent state
changes; code after the optimizer step may be cut short by a migration (its
side effects happen at most once); batches come from :class:`ReplayableData`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import comms
from .adapter import SMALL_CLASS, StateProvider
from .config import TorchPassConfig, config_from_env
from .control import (
    Keys,
    Mailbox,
    Plan,
    Ready,
    Report,
    Status,
    WorkerRecord,
    connect,
    get,
    put,
    put_counted,
    read_mirror,
)
from .buddy import BuddyKeeper, GateReleased
from .chaos import chaos_trigger
from .controller_answers import UNTIL_ANSWERED, ControllerAnswers
from .data import ReplayableData
from .failures import is_comm_error
from .generation_monitor import GenerationMonitor
from .liveness import STORE_LOST_EXIT, Heartbeater, StoreWatchdog
from .manifest import Captured, capture, fingerprint, rebuild
from .mirror import SmallStateMirror
from .rng import capture_rng, restore_rng
from .signals import install_handlers
from .topology import Placement, assign_buddies, layout_to_dict
from .transfer import ReceivePool, StateServer, TransferError, fetch_state

__all__ = ["Runtime", "current", "CommFailure", "FINAL_DIGESTS"]

FINAL_DIGESTS = "final"
"""The run-dir folder of the ranks' final state digests (``telemetry.final_digest``)."""

class CommFailure(RuntimeError):
    """Raised by the runtime itself when a generation ended while the rank was between collectives."""


@dataclass
class _Timings:
    values: dict[str, float] = field(default_factory=dict)
    bytes_moved: int = 0

    def add(self, name: str, seconds: float) -> None:
        self.values[name] = self.values.get(name, 0.0) + seconds


def _now() -> float:
    return time.time()


class Runtime:
    """The migration runtime of one worker process (see the module docstring for the protocol)."""

    def __init__(self, config: TorchPassConfig | None = None):
        env = os.environ
        self._config = config or config_from_env()
        self.wid = env["TORCHPASS_WID"]
        self.node = int(env["TORCHPASS_NODE"])
        self.role = env["TORCHPASS_ROLE"]
        self.world_size = int(env["TORCHPASS_WORLD_SIZE"])
        host, port = env["TORCHPASS_STORE"].rsplit(":", 1)
        self.store_host, self.store_port = host, int(port)
        self.store = connect(host, self.store_port)
        self.events = Mailbox(self.store, Keys.events)
        self.answers = ControllerAnswers(self.store, lambda: f"rank {self.rank} ({self.wid})")
        self.rank: int | None = int(env["RANK"]) if self.role == "active" else None
        self.monitor = GenerationMonitor(host, self.store_port, UNTIL_ANSWERED, self._on_generation_end)
        self.step = 0
        self.version = 0
        self.in_step = False
        self.committing = False
        self.clean = True
        self.phase = "setup"
        self.provider: StateProvider | None = None
        self.data: ReplayableData | None = None
        self.drain_requested = False
        self._optimizers_total = 0
        self._optimizers_done = 0
        self._step_small: dict[str, Any] | None = None
        self._mirror: SmallStateMirror | None = None
        self._plan: Plan | None = None
        self._pending_done: dict[str, Any] | None = None
        self._timings = _Timings()
        self._pool: ReceivePool | None = None
        self._buddy: BuddyKeeper | None = None
        self._buddy_target: tuple[int, tuple[str, int] | None] | None = None
        self._push_gate = False
        self.server = StateServer(
            host="127.0.0.1" if host in ("127.0.0.1", "localhost") else _my_host(),
            hold_into=lambda src, manifest: self._holder().hold_into(src, manifest),
            on_held=lambda src, captured: self._holder().on_held(src, captured),
        )
        comms.exclude_ports(peer=self.store_port, local=self.server.address[1])
        self._attached = False
        self._chaos = chaos_trigger(self._config.chaos, self.rank, self.role, self.monitor.ending)
        self._register()
        self._watchdog = StoreWatchdog(self.config.store_bound_s(), self._exit_store_lost)
        Heartbeater(
            host,
            self.store_port,
            self.wid,
            self.config.heartbeat_interval_s,
            lambda: (self.step, self.generation, self.phase),
            self._watchdog,
        )

    # ---- registration and liveness ------------------------------------
    def _register(self) -> None:
        record = WorkerRecord(
            self.wid, self.node, os.getpid(), self.role, self.rank, self.generation, list(self.server.address)
        )
        put(self.store, Keys.worker(self.wid), record)

    def _exit_store_lost(self, silent_s: float) -> None:
        print(
            f"[torchpass] {self.wid} (rank {self.rank}): the store at {self.store_host}:{self.store_port} has not "
            f"answered for {silent_s:.0f} s (store_timeout_s: {self.config.store_bound_s():g} s): node 0 is gone; exiting",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(STORE_LOST_EXIT)

    @property
    def config(self) -> TorchPassConfig:
        return self._config

    @config.setter
    def config(self, config: TorchPassConfig) -> None:
        """Adapters replace the launcher's config with the framework's own block (chaos settings included)."""
        self._config = config
        self._chaos = chaos_trigger(config.chaos, self.rank, self.role, self.monitor.ending)
        self._watchdog.bound_s = config.store_bound_s()

    def _on_generation_end(self, generation: int, reason: str) -> None:
        """The monitor thread saw ``generation`` end: wake whatever of this rank waits on it."""
        del reason
        comms.release_generation(generation)
        if self._buddy is not None:
            self._buddy.interrupt()

    def _set_generation(self, g: int) -> None:
        self.monitor.enter(g)

    @property
    def generation(self) -> int:
        return self.monitor.generation

    @property
    def ending(self) -> threading.Event:
        """Set once this rank's generation has ended (the loop then recovers at the next step boundary)."""
        return self.monitor.ending

    @property
    def ending_reason(self) -> str:
        return self.monitor.reason

    def install_signal_handlers(self) -> None:
        """SIGTERM asks for a planned migration of this rank (see ``core/signals.py``)."""
        install_handlers(self._on_term)

    def _on_term(self) -> None:
        if self.rank is None or not self._attached:
            # A spare, or a rank that has not joined yet: nothing to hand over.
            os._exit(0)
        if not self.drain_requested:
            self.drain_requested = True
            self.events.post(Report("drain", self.wid, self.node, self.rank, self.generation, detail={"signal": "SIGTERM"}))

    # ---- spares ---------------------------------------------------------
    def wait_for_assignment(self) -> int:
        """Block until the controller gives this spare a rank; exit cleanly if the job ends first."""
        self.phase = "spare"
        threading.Thread(target=self._prefault_pool, name="torchpass-pool", daemon=True).start()
        self.events.post(Report("spare_ready", self.wid, self.node))
        assignment = self.answers.assignment(self.wid)
        if "exit" in assignment:
            self.phase = "done"
            print(f"[torchpass] spare {self.wid}: {assignment['exit']}", flush=True)
            sys.stdout.flush()
            os._exit(0)
        self.rank = int(assignment["rank"])
        self._plan = get(self.store, Keys.plan(int(assignment["generation"])), Plan)
        self._set_generation(self._plan.generation)
        self._t_assigned = _now()
        self.phase = "setup"
        self._register()
        return self.rank

    def _prefault_pool(self) -> None:
        """Fault in receive memory for one rank's state while idle (see ReceivePool)."""
        store = connect(self.store_host, self.store_port)
        store.wait([Keys.state_bytes], UNTIL_ANSWERED)
        expected = int(store.get(Keys.state_bytes))
        if expected and self._pool is None:
            self._pool = ReceivePool(int(expected * 1.05))

    # ---- attach ---------------------------------------------------------
    def attach(self, provider: StateProvider, data: ReplayableData | None, start_step: int, optimizers: list[torch.optim.Optimizer]) -> int:
        """Called at the first step boundary; returns the first step to execute."""
        self.provider = provider
        self.data = data
        self._optimizers_total = len(optimizers)
        for opt in optimizers:
            opt.register_step_pre_hook(self._commit_begin)
            opt.register_step_post_hook(self._commit_end)
        assert self.rank is not None
        self._mirror = SmallStateMirror(self.store_host, self.store_port, self.rank)
        comms.before_collective = self._before_collective
        layout = provider.layout()
        sharded = set(layout.sharded_classes())
        mode = self.config.redundancy
        if mode == "buddy" or (mode == "auto" and sharded):
            push = set(layout.state_classes) if mode == "buddy" else sharded
            self._buddy = BuddyKeeper(
                rank=self.rank,
                classes_to_push=push | {SMALL_CLASS},
                chunk_bytes=self.config.transfer_chunk_bytes,
                retries=self.config.transfer_retries,
                timeout=self.config.rebuild_timeout_s,
                publish=lambda captured, copy: self.server.publish(captured, copy),
                withdraw=self.server.withdraw,
            )
        elif mode == "replica" and sharded:
            print(
                f"[torchpass] rank {self.rank}: redundancy 'replica' leaves state classes {sorted(sharded)} without a "
                "second copy: losing a rank will stop the job (use 'auto' or 'buddy')",
                file=sys.stderr,
                flush=True,
            )
        if self.role == "spare":
            first = self._join()
        else:
            self.version = start_step - 1
            self.step = start_step
            components, classes = provider.state_components()
            captured = capture(components, classes, self.version)
            if layout.world_size != self.world_size:
                raise ValueError(
                    f"torchpass: the framework's layout spans {layout.world_size} ranks but the job has "
                    f"{self.world_size}; layout: {layout.describe()}"
                )
            self.events.post(
                Report(
                    "attached",
                    self.wid,
                    self.node,
                    self.rank,
                    self.generation,
                    detail={
                        "layout": layout_to_dict(layout),
                        "state_bytes": captured.manifest.nbytes,
                        "groups": comms.group_signature(),
                        "config": self.config.to_dict(),
                        "version": self.version,
                    },
                )
            )
            first = start_step
            self._publish_rankinfo()
            self._protect()
        self._attached = True
        self.phase = "train"
        self.monitor.start()
        return first

    # ---- per-step hooks -------------------------------------------------
    def step_begin(self, step: int) -> None:
        self.step = step
        self.in_step = True
        self.clean = True
        self._optimizers_done = 0
        rng = capture_rng()
        if self.data is not None:
            self.data.mark_step(step)
        # Kept to restore a survivor that re-executes this step (RNG, provider state).
        self._step_small = self._small_state(rng)
        self._mirror_small("start", self.version, self._step_small)
        if self._chaos is not None:
            self._chaos.fire("step_start", self.step)

    def step_end(self, step: int) -> None:
        if self.committing:
            # A step that stepped only some of its optimizers: the state moved all the same.
            self.committing = False
        self.version = max(self.version, step)
        self.in_step = False
        if self._buddy is not None and self.version % self.config.buddy_interval_steps == 0:
            # At the step boundary, not at the optimizer step: the scheduler step and
            # anything else the step updates after the commit belong to this version.
            self._buddy.start(self._capture(), self._buddy_address())
        if self._pending_done is not None:
            self._report_done()

    def commit_started(self) -> None:
        """The step's persistent state is about to change (called by optimizer hooks, or by an adapter)."""
        if self.in_step and not self.committing:
            if self._chaos is not None:
                self._chaos.fire("commit", self.step)
            if self._buddy is not None:
                self._buddy.wait_copied()
            self.committing = True

    def commit_finished(self) -> None:
        """The step's state update is complete: the rank now holds version ``step``."""
        if self.in_step:
            self.committing = False
            self.version = self.step
            if self._chaos is not None:
                self._chaos.fire("after_commit", self.step)

    def _commit_begin(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        del optimizer, args, kwargs
        self.commit_started()

    def _commit_end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        del optimizer, args, kwargs
        if self.in_step:
            self._optimizers_done += 1
            if self._optimizers_done >= self._optimizers_total:
                self.commit_finished()

    def _small_state(self, rng: dict[str, Any]) -> dict[str, Any]:
        extra = self.provider.small_state() if self.provider is not None and hasattr(self.provider, "small_state") else None
        rng = {**rng, "provider": extra} if extra is not None else rng
        return {"rng": rng, "data": self.data.snapshot() if self.data is not None else None}

    def _restore_small(self, rng: dict[str, Any]) -> None:
        """Restore RNG streams and the provider's small state from a small-state record's ``rng`` part."""
        assert self.provider is not None
        restore_rng(rng)
        if "provider" in rng:
            self.provider.load_small_state(rng["provider"])  # type: ignore[attr-defined]

    def backward_started(self) -> None:
        """A backward pass of this step began: the step's RNG draws and batches are final.

        Record the rank's small state as of the end of this step (version = step)
        and make it durable before the rank's next collective. A failure can end
        the step on the survivors but not on this rank: a ring allreduce may
        complete on peers that received this rank's last chunk while this rank
        dies before its own completes. Those survivors hold version ``step``,
        and whoever replaces this rank needs its RNG at exactly that version.
        """
        if self.in_step and self._mirror is not None:
            if self._chaos is not None:
                self._chaos.fire("backward", self.step)
            self._mirror_small("backward", self.step, self._small_state(capture_rng()), durable=True)
            self._push_gate = self._buddy is not None

    def _before_collective(self) -> None:
        assert self._mirror is not None
        self._mirror.flush(self.config.report_timeout_s)
        if self._push_gate:
            assert self._buddy is not None
            # Cleared first: the collectives of the recovery that may follow pass no gate.
            self._push_gate = False
            try:
                self._buddy.wait_pushed()
            except GateReleased as exc:
                raise CommFailure(f"rank {self.rank}: {exc}") from exc

    # ---- buddies --------------------------------------------------------
    def _publish_rankinfo(self) -> None:
        assert self.rank is not None
        info = {"node": self.node, "addr": list(self.server.address), "wid": self.wid, "generation": self.generation}
        put(self.store, Keys.rankinfo(self.rank), info)

    def _protect(self) -> None:
        """Snapshot the current state and send its buddy copy (after attaching or a migration)."""
        if self._buddy is not None:
            self._buddy.start(self._capture(), self._buddy_address())

    def _holder(self) -> BuddyKeeper:
        if self._buddy is None:
            raise TransferError("this rank keeps no buddy copies (redundancy is not 'buddy' here)")
        return self._buddy

    def _buddy_address(self) -> tuple[str, int] | None:
        """Where this rank's buddy copy goes in the current generation (None on a one-rank world)."""
        assert self.rank is not None and self._buddy is not None
        if self._buddy_target is None or self._buddy_target[0] != self.generation:
            keys = [Keys.rankinfo(r) for r in range(self.world_size)]
            self.store.wait(keys, UNTIL_ANSWERED)
            infos = [json.loads(self.store.get(k)) for k in keys]
            buddies = assign_buddies(Placement({r: info["node"] for r, info in enumerate(infos)}))
            mine = buddies[self.rank]
            target = None if mine == self.rank else tuple(infos[mine]["addr"])
            self._buddy.forget_holdings_except({r for r, b in buddies.items() if b == self.rank and r != self.rank})
            self._buddy_target = (self.generation, target)  # type: ignore[assignment]
        return self._buddy_target[1]

    def _mirror_small(self, kind: str, version: int, small: dict[str, Any], durable: bool = False) -> None:
        assert self._mirror is not None
        self._mirror.submit(version, {"kind": kind, **small}, durable=durable)

    # ---- failure classification -----------------------------------------
    def is_comm_failure(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a collective failing because a peer or the generation went away."""
        if isinstance(exc, (CommFailure, dist.DistError)) or self.ending.is_set():
            return True
        if isinstance(exc, RuntimeError) and is_comm_error(str(exc)):
            return True
        return bool(self.store.check([Keys.end(self.generation)]))

    # ---- survivor recovery ---------------------------------------------
    def recover(self, cause: str) -> int:
        """Run the survivor side of a migration; returns the step to execute next."""
        assert self.provider is not None and self.rank is not None
        t_fail = _now()
        self.phase = "recover"
        comms.release_generation(self.generation)
        self.store.compare_set(Keys.end(self.generation), "", f"rank {self.rank}: {cause}"[:500])
        aborted = self.in_step
        interrupted_step = self.step
        dirty = self.committing
        self.committing = False
        self.in_step = False
        # The discarded step's gate: the recovery's own collectives pass none.
        self._push_gate = False
        self.provider.discard_step()
        if aborted and not dirty and self.version == interrupted_step - 1:
            # Back to exactly the state at the start of the interrupted step: its
            # forward already drew random numbers and updated buffers.
            assert self._step_small is not None
            self._restore_small(self._step_small["rng"])
            if self.data is not None:
                start = self.data.step_start(interrupted_step)
                assert start is not None
                self.data.seek(start)
        self.clean = not dirty
        self._timings = _Timings()
        while True:
            status = Status(
                self.rank,
                self.wid,
                self.version,
                self.clean,
                interrupted_step,
                list(self.server.address),
                draining=self.drain_requested,
                snapshots=self._buddy.snapshot_versions() if self._buddy is not None else [],
                holds={str(k): v for k, v in self._buddy.held_versions().items()} if self._buddy is not None else {},
            )
            self.server.publish(self._capture())
            put_counted(self.store, self.generation, "status", Keys.status(self.generation, self.rank), status)
            plan = self.answers.plan(self.generation + 1)
            replaced_by = plan.joins.get(str(self.rank))
            if replaced_by is not None and self.wid not in plan.retire:
                # Declared lost (stopped, or its node cut off) while the job went on: its rank
                # belongs to another process now, which must be the only one to join as it.
                self._exit_replaced(replaced_by)
            if self.wid in plan.retire:
                self._retire(plan)
                self._set_generation(plan.generation)
                continue
            if self._join_generation(plan, joining=False):
                break
        self.server.publish(None)
        self._pending_done = {"recovered_s": _now() - t_fail}
        self.phase = "train"
        return plan.target_version + 1

    def _join_generation(self, plan: Plan, *, joining: bool) -> bool:
        """Fetch what the plan says, report ready, and go live on ``plan.generation``.

        Returns False when the attempt was abandoned (a member or a source died,
        a transfer failed): the rank is then in ``plan.generation`` and reports
        again there, and the controller plans the next generation.
        """
        assert self.rank is not None
        failure = ""
        t0 = _now()
        try:
            self._apply_plan(plan, joining=joining)
        except (TransferError, OSError) as exc:
            failure = f"rank {self.rank} could not fetch its state: {exc}"
            print(f"[torchpass] {failure}", file=sys.stderr, flush=True)
        self._timings.add("transfer", _now() - t0)
        self._publish_rankinfo()
        answer = Ready(self.wid, plan.generation, failure)
        put_counted(self.store, plan.generation, "ready", Keys.ready(plan.generation, self.rank), answer)
        go = self.answers.go(plan.generation)
        self._set_generation(plan.generation)
        if not go:
            return False
        t0 = _now()
        try:
            comms.rebuild_all(self.store, plan.generation, timedelta(seconds=self.config.rebuild_timeout_s))
            dist.barrier()
            if hasattr(self.provider, "resume"):
                self.provider.resume()  # type: ignore[union-attr]
        except (dist.DistError, RuntimeError) as exc:
            if not self.is_comm_failure(exc):
                raise
            # A member died between "go" and the end of the rebuild: this generation is over too.
            reason = f"rank {self.rank}: rebuilding generation {plan.generation} failed: {exc}"
            print(f"[torchpass] {reason}", file=sys.stderr, flush=True)
            comms.release_generation(plan.generation)
            self.store.compare_set(Keys.end(plan.generation), "", reason[:500])
            return False
        self._timings.add("rebuild", _now() - t0)
        self.version = plan.target_version
        self.step = plan.target_version + 1
        self.clean = True
        self._protect()
        return True

    def _exit_replaced(self, by: str) -> None:
        print(
            f"[torchpass] rank {self.rank} ({self.wid}): the controller gave this rank to {by} (this process was "
            "declared lost); exiting",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(STORE_LOST_EXIT)

    def _retire(self, plan: Plan) -> None:
        """A draining rank: stay a source until the new generation starts, then leave."""
        if not self.answers.go(plan.generation):
            return
        self.phase = "done"
        print(f"[torchpass] rank {self.rank} ({self.wid}) handed over to {plan.joins[str(self.rank)]}; exiting", flush=True)
        self.server.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    # ---- state ------------------------------------------------------------
    def _capture(self) -> Captured:
        assert self.provider is not None
        components, classes = self.provider.state_components()
        components = {**components, "__small__": self._small_state(capture_rng())}
        classes = {**classes, "__small__": SMALL_CLASS}
        return capture(components, classes, self.version, meta={"classes": classes})

    def _read_copy(self, plan: Plan, sources: tuple[tuple[int, str], ...], classes: set[str], *, joining: bool) -> dict[str, Any]:
        """The components of ``classes`` at the plan's target, from this process's own snapshot or over the network.

        A source naming this rank is this process only when it is not joining: a spare that
        takes over a draining rank has the same rank number as its source, which is the
        draining process, and reads that one's snapshot over the network.
        """
        target = plan.target_version
        if sources == ((self.rank, "snapshot"),) and not joining:
            assert self._buddy is not None
            snap = self._buddy.snapshot(target)
            if snap is None:
                raise TransferError(f"rank {self.rank} has no snapshot of step {target} any more")
            # Copy out of the snapshot: loading it directly would make live optimizer
            # state alias snapshot buffers that later snapshots overwrite.
            manifest = snap.manifest
            mine = self._capture()
            own = {e.name: t for e, t in zip(mine.manifest.entries, mine.tensors)}
            tensors = []
            for entry, saved in zip(snap.manifest.entries, snap.tensors):
                live = own.get(entry.name)
                if live is not None and live.dtype == saved.dtype and live.shape == saved.shape:
                    tensors.append(live.copy_(saved))
                else:
                    tensors.append(saved.clone())
        else:
            manifest, tensors, stats = fetch_state(
                [(tuple(plan.addresses[str(r)]), copy) for r, copy in sources],  # type: ignore[misc]
                target,
                chunk_bytes=self.config.transfer_chunk_bytes,
                retries=self.config.transfer_retries,
                timeout=self.config.rebuild_timeout_s,
                verify_replicas=self.config.verify_replicas,
                state_classes=classes,
                into=self._capture(),
                pool=self._pool,
            )
            self._timings.bytes_moved += stats.nbytes
            self._timings.add("fetch", stats.seconds)
        component_classes = manifest.meta["classes"]
        state = rebuild(manifest, tensors)
        return {name: value for name, value in state.items() if component_classes[name] in classes}

    def _apply_plan(self, plan: Plan, *, joining: bool) -> None:
        assert self.provider is not None and self.rank is not None
        rank_plan = plan.rank_plan(self.rank)
        target = plan.target_version
        by_sources: dict[tuple[tuple[int, str], ...], set[str]] = {}
        for cls, sources in rank_plan.fetch.items():
            by_sources.setdefault(tuple((int(r), str(c)) for r, c in sources), set()).add(cls)
        if "/" in rank_plan.small_from:
            r, copy = rank_plan.small_from.split("/", 1)
            by_sources.setdefault(((int(r), copy),), set()).add(SMALL_CLASS)
        received: dict[str, Any] = {}
        for sources, classes in by_sources.items():
            received.update(self._read_copy(plan, sources, classes, joining=joining))
        small = received.pop("__small__", None)
        if received:
            self.provider.load_components(received, joining=joining)
        if rank_plan.small_from == "mirror":
            small = read_mirror(self.store, self.rank).get(target)
            if small is None:
                raise TransferError(f"rank {self.rank}'s mirror has no record for step {target}")
        if small is not None:
            # Data before RNG. ReplayableData starts epoch iterators with the global RNG
            # saved and restored, so the order is for sources that draw when advanced.
            if self.data is not None and small["data"] is not None:
                if joining:
                    self.data.fast_forward(small["data"])
                else:
                    self.data.seek(small["data"]["position"])
            self._restore_small(small["rng"])
        self.version = target

    # ---- joining --------------------------------------------------------
    def _join(self) -> int:
        assert self._plan is not None
        plan = self._plan
        self._timings = _Timings()
        self._timings.add("spare_setup", _now() - self._t_assigned)
        while not self._join_generation(plan, joining=True):
            plan = self.answers.plan(plan.generation + 1)
            if plan.joins.get(str(self.rank)) != self.wid:
                print(f"[torchpass] spare {self.wid} was released from rank {self.rank}; exiting", flush=True)
                sys.stdout.flush()
                os._exit(0)
        self._pending_done = {"recovered_s": _now() - self._t_assigned}
        return plan.target_version + 1

    def _report_done(self) -> None:
        assert self._pending_done is not None and self.rank is not None
        detail = {**self._pending_done, **self._timings.values, "bytes": self._timings.bytes_moved, "t_done": _now()}
        put_counted(self.store, self.generation, "done", Keys.done(self.generation, self.rank), detail)
        self._pending_done = None

    # ---- shutdown --------------------------------------------------------
    def finish(self) -> None:
        if self._pending_done is not None:
            # A migration whose generation had no step left to execute: it is done all the same.
            self._report_done()
        self.phase = "done"
        if self._buddy is not None:
            self._buddy.finishing = True
        if self.config.telemetry.final_digest and self.provider is not None and self.rank is not None:
            self._write_final_digest()

    def _write_final_digest(self) -> None:
        """``<run_dir>/final/rank<r>.json``: this rank's final state digest, version and PID (see TelemetryConfig)."""
        assert self.rank is not None
        folder = Path(os.environ["TORCHPASS_RUN_DIR"]) / FINAL_DIGESTS
        folder.mkdir(parents=True, exist_ok=True)
        record = {"rank": self.rank, "version": self.version, "pid": os.getpid(), "digest": fingerprint(self._capture())}
        tmp = folder / f"rank{self.rank}.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, folder / f"rank{self.rank}.json")


def _my_host() -> str:
    import socket

    return socket.gethostname()


_RUNTIME: Runtime | None = None


def current() -> Runtime | None:
    """This process's runtime when it was started by ``torchpass launch``, else None."""
    return _RUNTIME


def init_from_env() -> Runtime:
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = Runtime()
    return _RUNTIME


