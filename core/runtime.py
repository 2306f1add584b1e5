"""The in-worker side of live migration: a worker's identity, its attachment, and the per-step hooks.

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
* ``step_end(k)`` snapshots sharded state and starts its buddy push (every
  ``buddy_interval_steps``); the next gradient collective waits for the push;
* a heartbeat thread writes ``hb/<wid>`` every ``heartbeat_interval_s``; a
  monitor thread blocks on ``g/<g>/end`` and, when the controller (or a peer)
  ends the generation, releases this rank's process groups and gates so a call
  blocked on a dead or hung peer returns at once; a watchdog ends the process
  if the store stops answering for ``store_timeout_s``.

A failure hands over to :mod:`~torchpass.core.migration` (a survivor's
recovery, a spare's join), which works on this module's step bookkeeping.

Collaborators, each a module of its own: :mod:`~torchpass.core.migration`
(recovery and joining), :mod:`~torchpass.core.state_copy` (capturing and
loading the rank's state), :mod:`~torchpass.core.buddy_routing` (where the
buddy copy goes), :mod:`~torchpass.core.liveness` (heartbeats, the store
watchdog), :mod:`~torchpass.core.generation_monitor` (the end of a
generation), :mod:`~torchpass.core.mirror` (small state to the store),
:mod:`~torchpass.core.controller_answers` (waits for the controller),
:mod:`~torchpass.core.signals` and :mod:`~torchpass.core.chaos`.

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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import comms, job_secret
from .adapter import SMALL_CLASS, StateProvider
from .buddy import BuddyKeeper, GateReleased
from .buddy_routing import BuddyRouting, GenerationEnded
from .chaos import chaos_trigger
from .config import TorchPassConfig, config_from_env
from .control import Keys, Mailbox, Plan, Report, StoreAddress, WorkerRecord, get, put
from .controller_answers import UNTIL_ANSWERED, ControllerAnswers
from .critical_path import CriticalPathTimers
from .data import ReplayableData
from .failures import is_comm_error
from .generation_monitor import GenerationMonitor
from .liveness import STORE_LOST_EXIT, Heartbeater, StoreWatchdog
from .manifest import capture, fingerprint
from .migration import Migration
from .mirror import SmallStateMirror
from .rng import capture_rng
from .signals import install_handlers
from .state_copy import StateCopier
from .topology import layout_to_dict
from .transfer import ReceivePool, StateServer, TransferError

__all__ = ["Runtime", "current", "CommFailure", "FINAL_DIGESTS"]

FINAL_DIGESTS = "final"
"""The run-dir folder of the ranks' final state digests (``telemetry.final_digest``)."""

class CommFailure(RuntimeError):
    """Raised by the runtime itself when a generation ended while the rank was between collectives."""


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
        self.secret = job_secret.from_worker_env()
        """The job secret: store values are sealed with it and state-channel connections prove it."""
        self.store_address = StoreAddress(host, self.store_port, self.secret, etcd=env.get("TORCHPASS_STORE_ETCD"))
        self.store = self.store_address.connect()
        self.events = Mailbox(self.store, Keys.events)
        self.answers = ControllerAnswers(self.store, lambda: f"rank {self.rank} ({self.wid})")
        self.rank: int | None = int(env["RANK"]) if self.role == "active" else None
        self.monitor = GenerationMonitor(self.store_address, UNTIL_ANSWERED, self._on_generation_end)
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
        self.step_small: dict[str, Any] | None = None
        """The small state at the start of the current step, restored when a survivor re-executes it."""
        self._mirror: SmallStateMirror | None = None
        self._plan: Plan | None = None
        self._t_assigned = 0.0
        self._pool: ReceivePool | None = None
        self.buddy: BuddyKeeper | None = None
        """This rank's snapshots, buddy pushes and the copies it holds for others (sharded state only)."""
        self._routing: BuddyRouting | None = None
        self.copier: StateCopier | None = None
        """Captures and loads this rank's state; set once attached."""
        self.migration = Migration(self)
        self._push_gate = False
        self.timers = CriticalPathTimers()
        """The training thread's time inside the per-step hooks (see ``core/critical_path.py``)."""
        self.server = StateServer(
            secret=self.secret,
            chunk_bytes=self._config.transfer_chunk_bytes,
            host="127.0.0.1" if host in ("127.0.0.1", "localhost") else address_towards(host),
            hold_into=lambda src, manifest: self._holder().hold_into(src, manifest),
            on_held=lambda src, captured: self._holder().on_held(src, captured),
        )
        self._attached = False
        self._chaos = chaos_trigger(self._config.chaos, self.rank, self.role, self.monitor.ending)
        self._register()
        self._watchdog = StoreWatchdog(self.config.store_bound_s(), self._exit_store_lost)
        Heartbeater(
            self.store_address,
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
            f"[torchpass] {self.wid} (rank {self.rank}): the store at {self.store_address.describe()} has not "
            f"answered for {silent_s:.0f} s (store_timeout_s: {self.config.store_bound_s():g} s): {self.store_address.silence_means()}; exiting",
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
        if self.buddy is not None:
            self.buddy.interrupt()

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
        self._t_assigned = time.time()
        self.phase = "setup"
        self._register()
        return self.rank

    def _prefault_pool(self) -> None:
        """Fault in receive memory for one rank's state while idle (see ReceivePool)."""
        store = self.store_address.connect()
        store.wait([Keys.state_bytes], UNTIL_ANSWERED)
        expected = int(store.get(Keys.state_bytes))
        if expected and self._pool is None:
            self._pool = ReceivePool(int(expected * 1.05))

    # ---- attach ---------------------------------------------------------
    def prefetch(self, provider: StateProvider, data: ReplayableData | None = None) -> int:
        """A spare: load its assignment's state now, during set-up, and enter at :meth:`attach`; returns its version.

        For frameworks whose set-up needs the state (see ``Migration.prefetch``).
        """
        if self.role != "spare" or self._plan is None:
            raise RuntimeError("prefetch is for a spare that was given a rank, before it attaches")
        self._bind(provider, data, [])
        self._plan = self.migration.prefetch(self._plan, self._t_assigned)
        return self._plan.target_version

    def attach(self, provider: StateProvider, data: ReplayableData | None, start_step: int, optimizers: list[torch.optim.Optimizer]) -> int:
        """Called at the first step boundary; returns the first step to execute."""
        if self.copier is None:
            self._bind(provider, data, optimizers)
        elif provider is not self.provider or data is not self.data or optimizers:
            raise RuntimeError("attach after prefetch: pass the provider and data given to prefetch, and no optimizers")
        layout = provider.layout()
        assert self.rank is not None and self.copier is not None
        if self.role == "spare":
            assert self._plan is not None
            first = self.migration.join(self._plan, self._t_assigned)
        else:
            self.version = start_step - 1
            self.step = start_step
            # Before the layout report: a rank lost before its first step start must
            # still have its version's RNG and data position on record.
            self._mirror_small(self.version, self.copier.small_state(), durable=True)
            self._mirror.flush(self.config.report_timeout_s)
            components, classes = provider.state_components()
            captured = capture(components, classes, self.version, device_tensors="buffers")  # only its size is read
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
            if self._chaos is not None:
                self._chaos.fire("attach", start_step)
            self.publish_rankinfo(self.generation)
            self.protect()
        self._attached = True
        self.phase = "train"
        return first

    def _bind(self, provider: StateProvider, data: ReplayableData | None, optimizers: list[torch.optim.Optimizer]) -> None:
        """Take the framework's state and data, hook its optimizers, and set up the state copier and buddy keeper."""
        self.provider = provider
        self.data = data
        self._optimizers_total = len(optimizers)
        for opt in optimizers:
            opt.register_step_pre_hook(self._commit_begin)
            opt.register_step_post_hook(self._commit_end)
        assert self.rank is not None
        self._mirror = SmallStateMirror(self.store_address, self.rank)
        comms.before_collective = self._before_collective
        # Watching the generation from here on: a fault during start-up or during a
        # spare's join must release this rank's waits too.
        self.monitor.start()
        layout = provider.layout()
        if layout.derived_classes() and not hasattr(provider, "resume"):
            raise TypeError(
                f"torchpass: the layout of {type(provider).__name__} declares derived state classes "
                f"{layout.derived_classes()}, which only a provider with resume() can recompute after a migration"
            )
        sharded = set(layout.sharded_classes())
        mode = self.config.redundancy
        if mode == "buddy" or (mode == "auto" and sharded):
            push = set(layout.copied_classes()) if mode == "buddy" else sharded - set(layout.derived_classes())
            self.buddy = BuddyKeeper(
                rank=self.rank,
                classes_to_push=push | {SMALL_CLASS},
                chunk_bytes=self.config.transfer_chunk_bytes,
                retries=self.config.transfer_retries,
                timeout=self.config.rebuild_timeout_s,
                secret=self.secret,
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
        self._routing = BuddyRouting(self.store, self.rank, self.world_size)
        self.copier = StateCopier(
            self.rank, provider, data, self.config, self.store, self.buddy, lambda: self._pool, self.secret, frozenset(layout.derived_classes())
        )

    # ---- per-step hooks -------------------------------------------------
    def step_begin(self, step: int) -> None:
        started = self.timers.clock()
        self.timers.step_started(self.generation, step, started)
        self.step = step
        self.in_step = True
        self.clean = True
        self._optimizers_done = 0
        rng = capture_rng()
        if self.data is not None:
            self.data.mark_step(step)
        # Kept to restore a survivor that re-executes this step (RNG, provider state).
        assert self.copier is not None
        self.step_small = self.copier.small_state(rng)
        self._mirror_small(self.version, self.step_small)
        self.timers.add("step_begin", started)
        if self._chaos is not None:
            self._chaos.fire("step_start", self.step)

    def step_end(self, step: int) -> None:
        started = self.timers.clock()
        if self.committing:
            # A step that stepped only some of its optimizers: the state moved all the same.
            self.committing = False
        self.version = max(self.version, step)
        self.in_step = False
        if self._chaos is not None:
            self._chaos.fire("step_end", step)
            self._chaos.check_fired(step)
        if self.buddy is not None and self.version % self.config.buddy_interval_steps == 0:
            # At the step boundary, not at the optimizer step: the scheduler step and
            # anything else the step updates after the commit belong to this version.
            self.protect()
        self.timers.add("step_end", started)
        if self.migration.done_pending:
            self.migration.report_done()

    def commit_started(self) -> None:
        """The step's persistent state is about to change (called by optimizer hooks, or by an adapter)."""
        if self.in_step and not self.committing:
            if self._chaos is not None:
                self._chaos.fire("commit", self.step)
            started = self.timers.clock()
            if self.buddy is not None:
                self.buddy.wait_copied()
            self.committing = True
            self.timers.add("commit", started)

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

    def last_forward_started(self) -> None:
        """The forward of this step's last micro-batch began (adapters that see each forward call it)."""
        if self.in_step and self._chaos is not None:
            self._chaos.fire("last_forward", self.step)

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
            assert self.copier is not None
            started = self.timers.clock()
            self._mirror_small(self.step, self.copier.small_state(), durable=True)
            self._push_gate = self.buddy is not None
            self.timers.add("backward", started)

    def _before_collective(self) -> None:
        assert self._mirror is not None
        started = self.timers.clock()
        self._mirror.flush(self.config.report_timeout_s)
        if self._push_gate:
            assert self.buddy is not None
            # Cleared first: the collectives of the recovery that may follow pass no gate.
            self._push_gate = False
            try:
                self.buddy.wait_pushed()
            except GateReleased as exc:
                raise CommFailure(f"rank {self.rank}: {exc}") from exc
        self.timers.add("collective_gate", started)

    def discard_step_gate(self) -> None:
        """Drop the interrupted step's buddy gate: the recovery's own collectives pass none."""
        self._push_gate = False

    # ---- buddies --------------------------------------------------------
    def publish_rankinfo(self, generation: int) -> None:
        """Publish this rank's address for ``generation`` (see ``core/buddy_routing.py``)."""
        assert self._routing is not None
        self._routing.publish(self.node, self.server.address, self.wid, generation)

    def protect(self) -> None:
        """Snapshot the current state and send its buddy copy (at a step boundary, after attaching or a migration)."""
        if self.buddy is None:
            return
        assert self._routing is not None and self.copier is not None
        try:
            target = self._routing.target(self.generation, self.ending, self.buddy)
        except GenerationEnded as exc:
            # The migration that follows snapshots and pushes again once its generation is live.
            print(f"[torchpass] rank {self.rank}: no buddy copy this generation: {exc}", file=sys.stderr, flush=True)
            return
        self.buddy.start(self.copier.capture(self.version, device_tensors="live", derived=False), target)

    def _holder(self) -> BuddyKeeper:
        if self.buddy is None:
            raise TransferError("this rank keeps no buddy copies (redundancy is not 'buddy' here)")
        return self.buddy

    def _mirror_small(self, version: int, small: dict[str, Any], durable: bool = False) -> None:
        assert self._mirror is not None
        self._mirror.submit(version, small, durable=durable)

    # ---- failure classification -----------------------------------------
    def is_comm_failure(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a collective failing because a peer or the generation went away."""
        if isinstance(exc, (CommFailure, dist.DistError)) or self.ending.is_set():
            return True
        if isinstance(exc, RuntimeError) and is_comm_error(str(exc)):
            return True
        return bool(self.store.check([Keys.end(self.generation)]))

    # ---- migration --------------------------------------------------------
    def recover(self, cause: str) -> int:
        """Run the survivor side of a migration (see ``core/migration.py``); returns the step to execute next."""
        return self.migration.recover(cause)

    # ---- shutdown --------------------------------------------------------
    def finish(self) -> None:
        if self.migration.done_pending:
            # A migration whose generation had no step left to execute: it is done all the same.
            self.migration.report_done()
        self.phase = "done"
        if self.buddy is not None:
            self.buddy.finishing = True
        if self.config.telemetry.final_digest and self.provider is not None and self.rank is not None:
            self._write_final_digest()
        if self.rank is not None and self._attached:
            extra = {"buddy": asdict(self.buddy.counters())} if self.buddy is not None else None
            self.timers.write(Path(os.environ["TORCHPASS_RUN_DIR"]), self.rank, extra)

    def _write_final_digest(self) -> None:
        """``<run_dir>/final/rank<r>.json``: this rank's final state digest, version and PID (see TelemetryConfig)."""
        assert self.rank is not None
        folder = Path(os.environ["TORCHPASS_RUN_DIR"]) / FINAL_DIGESTS
        folder.mkdir(parents=True, exist_ok=True)
        record = {"rank": self.rank, "version": self.version, "pid": os.getpid(), "digest": fingerprint(self.copier.capture(self.version))}
        tmp = folder / f"rank{self.rank}.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, folder / f"rank{self.rank}.json")


def address_towards(host: str) -> str:
    """This machine's address on the interface that routes to ``host`` (the store's): where peers reach it.

    The host name is not enough: on a machine with several interfaces (or a container, or a network
    namespace) it may resolve to an address peers cannot reach. A UDP socket's ``connect`` sends nothing;
    it only asks the kernel which local address it would use."""
    import socket

    family, kind, _, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as probe:
        probe.connect(target)
        return probe.getsockname()[0]


_RUNTIME: Runtime | None = None


def current() -> Runtime | None:
    """This process's runtime when it was started by ``torchpass launch``, else None."""
    return _RUNTIME


def init_from_env() -> Runtime:
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = Runtime()
    return _RUNTIME


