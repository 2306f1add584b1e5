"""The per-node agent: starts active workers and hot spares, watches them, fences on request.

Like torch elastic's agent it owns the processes of one node, built on its
``SubprocessHandler`` (process start in a new session, stdout/stderr files,
kill by process group) and ``TailLog`` (prefixed console tee). Unlike it, a
worker's death never takes the others down: the agent reports the exit to the
controller and keeps every other process running.

Each ``tick``:

* reaps exited workers and reports them (exit code or signal, and the message
  of the error file the worker bootstrap writes on an uncaught exception);
* fences (SIGKILL) a worker whose heartbeat is older than
  ``heartbeat_timeout_s`` (a SIGSTOPped or wedged process) and reports it hung.
  Heartbeats are read twice per ``heartbeat_interval_s``, not every tick: an exit
  is seen by the local poll at once, a hang only after the timeout anyway, and
  reading every worker's key every tick would be 40 store round trips a second
  per worker for nothing;
* executes the controller's orders from the node mailbox (read twice per heartbeat
  interval, with the node's own beat): fence a worker, retire a spare;
* refreshes the node's own heartbeat (a counter, ``core/liveness.py``), by which
  the controller notices a whole node disappearing, and looks for the
  controller's verdict that this node is lost: a node declared lost (its agent
  was stopped or cut off long enough) has had its ranks given to spares, so the
  agent kills every worker it still has and exits.

The agent ends its workers and itself when the store has not answered for
``store_timeout_s`` (node 0 is gone), so no process of a dead job lingers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
from torch.distributed.elastic.multiprocessing.tail_log import TailLog

from . import nccl_transport, rendezvous_store
from .config import TorchPassConfig, config_from_mapping
from .control import Heartbeat, Keys, Mailbox, Report, StoreAddress, get_if_present, put, try_get, worker_id
from .failures import FENCE_DUMP_SIGNAL, is_comm_error, is_device_failure
from .job_secret import SECRET_ENV
from .signed_store import FORGED
from .liveness import STORE_LOST_EXIT, HangWatch, StoreWatchdog

__all__ = ["Agent", "NodeSpec"]

NODE_LOST_EXIT = 76
"""Exit code of a launcher whose node the controller declared lost (its ranks were given to spares)."""

FENCE_DUMP_WAIT_S = 0.3
"""How long a fence waits for the worker's stack dump before it kills it."""


@dataclass
class NodeSpec:
    node: int
    nnodes: int
    nproc_per_node: int
    spares_per_node: int
    store_host: str
    store_port: int
    run_id: str
    run_dir: Path
    target: list[str]
    """``["-m", module, *args]`` or ``[script, *args]``."""
    tee: bool = True
    store_etcd: str | None = None
    """The job's etcd URL when the control plane is on etcd (``store_host:store_port`` then serves set-up only)."""


@dataclass
class _Worker:
    wid: str
    role: str
    rank: int | None
    local_rank: int
    """Its slot on the node: ``LOCAL_RANK``, the GPU it runs on (:mod:`torchpass.core.devices`)."""
    handler: SubprocessHandler
    tail: TailLog | None
    error_file: Path
    started: float
    fenced_for: str = ""
    last_heartbeat: float = 0.0


class Agent:
    """Owns the worker processes of one node (see the module docstring)."""

    def __init__(self, spec: NodeSpec, store: dist.Store, config: TorchPassConfig, say: Callable[[str], None], secret: bytes):
        self.spec = spec
        self._secret = secret
        self.store = store
        self.config = config
        self.say = say
        self.events = Mailbox(store, Keys.events)
        self.mail = Mailbox(store, Keys.node_mail(spec.node))
        self.workers: dict[str, _Worker] = {}
        self.log_dir = spec.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._last_beat = 0.0
        self._beat_seq = 0
        self.forged_orders = 0
        """Orders in this node's mail that did not open under the job secret (logged once)."""
        self._last_heartbeat_scan = 0.0
        self._hangs = HangWatch()
        store_at = StoreAddress(spec.store_host, spec.store_port, secret, etcd=spec.store_etcd)
        self._watchdog = StoreWatchdog(
            config.store_bound_s(),
            lambda silent: self.abandon(
                f"the store at {store_at.describe()} has not answered for {silent:.0f} s "
                f"(store_timeout_s: {config.store_bound_s():g} s): {store_at.silence_means()}",
                STORE_LOST_EXIT,
            ),
            name="torchpass-agent-store-watchdog",
        )
        put(store, f"{Keys.node_mail(spec.node)}/info", {"pid": os.getpid(), "host": os.uname().nodename})

    # ---- process start --------------------------------------------------------------
    def _env(self, wid: str, role: str, rank: int | None, local_rank: int) -> dict[str, str]:
        s = self.spec
        world = s.nnodes * s.nproc_per_node
        env = {
            "TORCHPASS_WID": wid,
            "TORCHPASS_ROLE": role,
            "TORCHPASS_STARTED_AS": role,
            "TORCHPASS_NODE": str(s.node),
            "TORCHPASS_WORLD_SIZE": str(world),
            "TORCHPASS_STORE": f"{s.store_host}:{s.store_port}",
            **({"TORCHPASS_STORE_ETCD": s.store_etcd} if s.store_etcd else {}),
            "TORCHPASS_RUN_DIR": str(s.run_dir),
            "TORCHPASS_AGENT_PID": str(os.getpid()),
            "TORCHPASS_CONFIG": json.dumps(self.config.to_dict()),
            # What torchrun gives its workers, so unmodified scripts run.
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(s.nproc_per_node),
            "GROUP_RANK": str(s.node),
            "GROUP_WORLD_SIZE": str(s.nnodes),
            "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": s.store_host,
            "MASTER_PORT": str(s.store_port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": s.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_ERROR_FILE": str(self.log_dir / f"{wid}.error.json"),
            "PYTHONUNBUFFERED": "1",
            # In the environment, never on the command line (`ps` shows that to every user): job_secret.py.
            SECRET_ENV: self._secret.decode(),
        }
        if rank is not None:
            env.update({"RANK": str(rank), "ROLE_RANK": str(rank)})
        if "OMP_NUM_THREADS" not in os.environ and s.nproc_per_node > 1:
            env["OMP_NUM_THREADS"] = "1"
        env.update(nccl_transport.worker_environment(os.environ))
        env.update(rendezvous_store.worker_environment(os.environ))
        return env

    def spawn(self, wid: str, role: str, rank: int | None, local_rank: int) -> None:
        env = self._env(wid, role, rank, local_rank)
        out, err = self.log_dir / f"{wid}.out", self.log_dir / f"{wid}.err"
        error_file = Path(env["TORCHELASTIC_ERROR_FILE"])
        error_file.unlink(missing_ok=True)
        handler = SubprocessHandler(
            entrypoint=sys.executable,
            args=("-m", "torchpass.core.worker", *self.spec.target),
            env=env,
            stdout=str(out),
            stderr=str(err),
            local_rank_id=local_rank,
            numa_options=None,
        )
        tail = None
        if self.spec.tee:
            prefix = f"[rank{rank}]:" if rank is not None else f"[spare {wid}]:"
            tail = TailLog(wid, {0: str(out), 1: str(err)}, sys.stdout, {0: prefix, 1: prefix}).start()
        self.workers[wid] = _Worker(wid, role, rank, local_rank, handler, tail, error_file, time.time())
        self.events.post(Report("spawned", wid, self.spec.node, rank, detail={"pid": handler.proc.pid, "role": role}))

    def start(self) -> None:
        s = self.spec
        for i in range(s.nproc_per_node):
            self.spawn(worker_id(s.node, False, i), "active", s.node * s.nproc_per_node + i, i)
        for j in range(s.spares_per_node):
            self.spawn(worker_id(s.node, True, j), "spare", None, s.nproc_per_node + j)

    # ---- the tick --------------------------------------------------------------------
    def refresh_config(self) -> None:
        """Adopt the job's own torchpass config once rank 0 has published it (timeouts may differ)."""
        raw = get_if_present(self.store, Keys.config)
        if raw is not None:
            self.config = config_from_mapping(json.loads(raw), source="the job's torchpass config")
            self._watchdog.bound_s = self.config.store_bound_s()

    def _on_bad_order(self, key: str, why: str) -> None:
        if why == FORGED:
            self.forged_orders += 1
            if self.forged_orders > 1:
                return  # logged once; a stranger can write these as fast as it likes
        print(f"[torchpass] node {self.spec.node}: ignoring order {key}: {why}", file=sys.stderr, flush=True)

    def tick(self) -> None:
        now = time.time()
        if now - self._last_beat >= self.config.heartbeat_interval_s / 2:
            lost = get_if_present(self.store, Keys.node_lost(self.spec.node))
            if lost is not None:
                self.abandon(f"the controller declared node {self.spec.node} lost ({lost.decode()}); its ranks run elsewhere", NODE_LOST_EXIT)
            self._beat_seq += 1
            self.store.set(Keys.node_beat(self.spec.node), str(self._beat_seq))
            self._watchdog.alive()
            self._last_beat = now
            # Orders at the beat's pace, not every tick: a read per tick per node was 20 requests a second
            # each, more than the store serves at thousands of nodes, for orders (a fence, a retirement)
            # that nothing waits on.
            for order in self.mail.drain(dict, on_bad=self._on_bad_order):
                if order.get("fence") in self.workers:
                    self.fence(order["fence"], order.get("why", "fenced by the controller"))
                elif order.get("retire") in self.workers:
                    self.retire(order["retire"], order.get("why", "retired by the controller"))
        scan = now - self._last_heartbeat_scan >= self.config.heartbeat_interval_s / 2
        if scan:
            self._last_heartbeat_scan = now
        for w in list(self.workers.values()):
            code = w.handler.proc.poll()
            if code is not None:
                self._reap(w, code)
            elif scan:
                self._check_heartbeat(w, now)

    def _check_heartbeat(self, w: _Worker, now: float) -> None:
        if w.fenced_for:
            return
        hb = try_get(self.store, Keys.heartbeat(w.wid), Heartbeat)
        if hb is None:
            if now - w.started > self.config.spare_join_timeout_s:
                self.fence(w.wid, f"never heartbeated within {self.config.spare_join_timeout_s:.0f} s of starting")
            return
        why = self._hangs.hung(w.wid, w.handler.proc.pid, hb.seq, self.config.heartbeat_timeout_s)
        if why is not None and hb.phase != "done":
            w.last_heartbeat = hb.t
            self.fence(w.wid, why)

    def fence(self, wid: str, why: str) -> None:
        """Kill a worker that must never act again (hung, or replaced while unreachable)."""
        w = self.workers.get(wid)
        if w is None or w.fenced_for:
            return
        w.fenced_for = why
        try:
            # Where was it? The worker writes every thread's stack to its log on this signal
            # (a stopped process cannot, and loses nothing but this pause).
            os.kill(w.handler.proc.pid, FENCE_DUMP_SIGNAL)
            time.sleep(FENCE_DUMP_WAIT_S)
            os.killpg(w.handler.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it died on its own meanwhile; the reaper reports it

    def retire(self, wid: str, why: str) -> None:
        """End a spare the controller took out of its pool (its node is draining): it holds no state, so no dump."""
        w = self.workers.get(wid)
        if w is None or w.fenced_for:
            return
        w.fenced_for = why
        try:
            os.killpg(w.handler.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # gone already; the reaper reports it

    def _reap(self, w: _Worker, code: int) -> None:
        del self.workers[w.wid]
        if w.tail is not None:
            w.tail.stop()
        error = ""
        if w.error_file.exists():
            try:
                error = json.loads(w.error_file.read_text())["message"]["message"]
            except (ValueError, KeyError, TypeError) as exc:
                error = f"(unreadable error file {w.error_file}: {exc})"
        if w.fenced_for:
            how = w.fenced_for
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        detail = {"exitcode": code, "how": how, "pid": w.handler.proc.pid}
        if error:
            detail["error"] = error.strip().splitlines()[-1][:500]
            detail["comm_error"] = is_comm_error(error)
            detail["device_failure"] = is_device_failure(error)
            if detail["device_failure"]:
                detail["how"] = f"died of a GPU failure: {detail['error']}"
        kind = "hung" if w.last_heartbeat else "exit"
        # A hang started when the heartbeats stopped, not when the fence noticed it.
        self.events.post(Report(kind, w.wid, self.spec.node, w.rank, t=w.last_heartbeat or time.time(), detail=detail))

    def abandon(self, why: str, code: int) -> None:
        """Kill every worker of this node and exit the process with ``code``: the job cannot go on here.

        Called from the store watchdog's thread too, while the main thread is
        blocked in a store request that will not return.
        """
        self.say(f"{why}; killing this node's {len(self.workers)} worker(s) and exiting")
        self.stop_all()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def worker_in_slot(self, slot: int) -> str | None:
        """The live worker on slot (``LOCAL_RANK``) ``slot``, if any."""
        return next((w.wid for w in self.workers.values() if w.local_rank == slot and not w.fenced_for), None)

    def alive(self) -> list[str]:
        return list(self.workers)

    def stop_all(self, sig: signal.Signals = signal.SIGKILL) -> None:
        for w in list(self.workers.values()):
            try:
                os.killpg(w.handler.proc.pid, sig)
            except ProcessLookupError:
                pass  # already gone
        deadline = time.time() + 10
        for w in list(self.workers.values()):
            try:
                w.handler.proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.say(f"worker {w.wid} (pid {w.handler.proc.pid}) did not exit after SIGKILL (stuck in the kernel?)")
            if w.tail is not None:
                w.tail.stop()
        self.workers.clear()
