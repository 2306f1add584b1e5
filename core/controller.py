"""The controller: detects failures, plans migrations, drives generations, writes the ledger.

It runs inside node 0's launcher, next to the c10d store it hosts, and is
ticked from the launcher's loop (no thread of its own). Its view of the job
comes only from the store: reports in the ``events`` mailbox (from agents and
workers), heartbeats, and the keys of the migration protocol.

On an etcd store it runs in whichever launcher holds the controller's lease
(``core/controller_election.py``) and can move: at the end of every tick that
changed it, it writes :meth:`Controller.snapshot` (its decisions so far and
how far it has read the mailbox) to ``Keys.controller_state``, and a launcher
that takes over builds its controller from that record
(:meth:`Controller.take_over`). The successor repeats at most the last tick
of its predecessor, whose store writes repeat harmlessly (``end`` and ``go``
are compare-and-set or the same value, a generation's plan already written
is adopted, not made again); only a ledger line of that tick can appear twice.

Per generation g it is in one of three phases:

``running``
    Watches for a failure: a member's process exits (not a clean finish), an
    agent fences a member whose heartbeat stopped, a worker ends generation g
    because a collective failed, a member or node asks to drain (SIGTERM), an
    operator asks to migrate a rank, no step finishes within the hang timeout,
    or a node's agent stops heartbeating. It then sets ``g/<g>/end`` (waking
    every member's monitor) and moves to ``collecting``.

``collecting``
    Waits for every member not known lost to report its status. A member whose
    heartbeat is stale, or who stays silent past ``report_timeout_s``, is
    fenced (killed by its agent) and counted lost: a second fault during the
    migration. Then :func:`~torchpass.core.planner.plan_migration` decides;
    a disqualified plan stops the job with a clear message. Otherwise it
    assigns spares, publishes ``g+1/plan`` and moves to ``joining``.

``joining``
    Waits until every member of g+1 is ready (spares have run the script up to
    their first step and fetched their state); then sets ``g+1/go``. If a member
    or an assigned spare dies first, it sets ``go`` to ``abort`` and plans g+2
    from the statuses the survivors report again. After ``go``, the ``done``
    reports of the members close the ledger event with the timing breakdown.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch.distributed as dist

from .config import TorchPassConfig, config_from_mapping
from .control import (
    Heartbeat,
    Keys,
    Mailbox,
    Plan,
    Ready,
    Report,
    Status,
    WorkerRecord,
    check_all,
    gather,
    get_if_present,
    multi_get,
    present,
    put,
    read_mirror,
    try_get,
    worker_id,
)
from .rng import rng_digest
from .safe_pickle import ForbiddenObject
from .ledger import DISQUALIFYING, PLANNED, QUALIFYING, JobEvent, Ledger, MigrationEvent
from .signed_store import FORGED
from .liveness import BeatWatch
from .planner import Disqualified, MirrorInfo, PlanInput, SpareInfo, plan_migration
from .topology import Layout, Placement, layout_from_dict

__all__ = ["Controller", "JobSpec"]

_PROGRESS = "progress"
"""The job's progress, as a beat of the controller's ``BeatWatch``: the members' highest (generation, step)."""


@dataclass
class JobSpec:
    world_size: int
    nnodes: int
    nproc_per_node: int
    spares_per_node: int
    run_id: str
    command: list[str]


@dataclass
class _Migration:
    generation: int
    """The generation being planned (the ended one plus one)."""
    cause: str
    classification: str
    t_fault: float
    t_detect: float
    failed: set[int] = field(default_factory=set)
    draining: set[int] = field(default_factory=set)
    phase: str = "collecting"
    deadline: float = 0.0
    plan: Plan | None = None
    t_plan: float = 0.0
    t_go: float = 0.0
    message: str = ""
    trigger: dict[str, Any] = field(default_factory=dict)
    """For a planned migration: what asked for it (a scheduler's signal and its reason), for the ledger."""
    attempts: int = 1
    members: dict[int, str] = field(default_factory=dict)
    """Rank -> worker of the generation being planned (the old members plus the plan's joins)."""
    last_scan: float = 0.0
    """When the controller last looked for silent members while collecting statuses."""
    awaiting_spares: float = 0.0
    """When planning first found no ready spare while some were still starting (0: it has not)."""
    silent: set[int] = field(default_factory=set)
    """Ranks fenced during this migration for going silent (never themselves the fault others are fenced beside)."""
    fenced: dict[int, str] = field(default_factory=dict)
    """Rank -> why the controller fenced it during this migration although the fault was another rank's."""

    def is_planned(self) -> bool:
        """Asked for (a drain, a scheduler's signal), not caused by a failure."""
        return self.cause == PLANNED or bool(self.trigger)


class Controller:
    """See the module docstring; ``tick()`` advances it, ``outcome`` is set when the job is over."""

    def __init__(
        self,
        store: dist.Store,
        spec: JobSpec,
        run_dir: Path,
        config: TorchPassConfig,
        say: Callable[[str], None],
        order: Callable[[int, dict[str, Any]], None],
        store_address: str,
        store_etcd: str | None = None,
        node: int = 0,
        state: dict[str, Any] | None = None,
    ):
        """``node``: the node whose launcher runs it (it watches every other node's agent); ``state``: a
        predecessor's :meth:`snapshot` to continue from (see :meth:`take_over`), or None for a new job."""
        self.store = store
        self.node = node
        self.store_address = store_address
        self.store_etcd = store_etcd
        """The job's etcd URL when its control plane is on etcd (``workers.json`` tells operators' tools)."""
        self.spec = spec
        self.run_dir = run_dir
        self.config = config
        self.say = say
        self._order = order
        """Posts an order (``fence`` or ``retire`` a worker) to a node's agent."""
        self.ledger = Ledger(run_dir)
        self.forged_records = 0
        """Mailbox records that did not open under the job secret (see ``_on_bad_record``)."""
        self.events = Mailbox(store, Keys.events)
        self.generation = 0
        self.members: dict[int, str] = {}
        self.node_of: dict[str, int] = {}
        self.records: dict[str, WorkerRecord] = {}
        self.spares: dict[str, int] = {}
        self.finished: set[int] = set()
        self.lost_wids: set[str] = set()
        self.layout: Layout | None = None
        self.attached: set[int] = set()
        self.outcome: tuple[int, str] | None = None
        self.migration: _Migration | None = None
        self.sticky: dict[int, str] = {}
        self._deferred_drains: dict[int, tuple[str, str]] = {}
        """Rank -> (worker, what): drains asked for after the running migration was planned; they start when it ends."""
        self._no_loss_repeats: tuple[int, int] | None = None
        """(step, count): consecutive migrations that lost no process and resumed at that step."""
        self.nodes_lost: set[int] = set()
        self.lost_after_training: set[int] = set()
        """Ranks lost after other ranks had finished training: nothing is left to migrate them for."""
        self._last_progress_scan = 0.0
        self._written_migration: dict[str, Any] | None = None
        self.node_heartbeat_ages: dict[int, float] = {}
        """Node -> seconds its agent had not beaten at the last scan (node 0's agent is this process)."""
        self._last_node_scan = 0.0
        self._beats = BeatWatch()
        """Ages of agents' and workers' heartbeats on this process's clock (never another host's)."""
        self._workers_dirty = False
        self._node_info: dict[int, Any] = {}
        self._layout_raw: dict[str, Any] | None = None
        self._dirty_nodes: set[int] = set()
        """Nodes one of whose process records changed since the last ``_persist_state``."""
        self._launch_members: list[str] = []
        self._record_nodes: set[int] = set()
        """Nodes whose records a successor reads (``Keys.controller_records``)."""
        self._persist = store_etcd is not None
        """Write the snapshot for a successor (on an etcd store only: with node 0's TCPStore nobody could read it)."""
        self._written_state = ""
        if state is None:
            put(store, Keys.gen, 0)
            put(store, Keys.job, {**asdict(spec), "config": config.to_dict()})
            self.ledger.append(JobEvent("job_start", f"{spec.world_size} ranks on {spec.nnodes} node(s)", asdict(spec)))
            if self._persist:
                self._persist_state()  # before any other launcher starts (they wait for the job): a successor always has one
        else:
            self._restore(state)

    # ---- taking over -------------------------------------------------------------
    @classmethod
    def take_over(
        cls,
        store: dist.Store,
        run_dir: Path,
        say: Callable[[str], None],
        order: Callable[[int, dict[str, Any]], None],
        store_address: str,
        store_etcd: str,
        node: int,
    ) -> "Controller":
        """The controller of a job whose controller was lost, continuing from the state it wrote last."""
        raw = try_get_text(store, Keys.controller_state)
        if raw is None:
            raise RuntimeError("the job's controller was lost before it wrote any state a successor could continue from")
        state = json.loads(raw)
        spec = JobSpec(**state["spec"])
        config = config_from_mapping(state["config"], source="the lost controller's state")
        return cls(store, spec, run_dir, config, say, order, store_address, store_etcd, node=node, state=state)

    def snapshot(self) -> dict[str, Any]:
        """Everything this controller decided that the store's keys do not hold, as JSON (see the module docstring).

        Its size follows the changes, not the job: the members as their differences from the launch placement,
        the processes' records apart, per node (``Keys.controller_records``, written when one changes). At
        16,384 ranks the whole state as one value was 3.3 MB (over etcd's default 1.5 MiB request limit) and
        136 ms to encode, every tick.
        """
        m = self.migration
        world = self.spec.world_size
        return {
            "spec": asdict(self.spec),
            "config": self.config.to_dict(),
            "events_read": self.events.read,
            "generation": self.generation,
            "members_moved": {str(r): w for r, w in self.members.items() if w != self._launch_member(r)},
            "members_unknown": [r for r in range(world) if r not in self.members] if len(self.members) < world else [],
            "record_nodes": sorted(self._record_nodes),
            "spares": self.spares,
            "finished": sorted(self.finished),
            "lost_wids": sorted(self.lost_wids),
            "layout": self._layout_raw,
            "attached": "all" if len(self.attached) == world else sorted(self.attached),
            "migration": None if m is None else _migration_to_json(m),
            "sticky": {str(r): w for r, w in self.sticky.items()},
            "deferred_drains": {str(r): list(v) for r, v in self._deferred_drains.items()},
            "no_loss_repeats": list(self._no_loss_repeats) if self._no_loss_repeats else None,
            "nodes_lost": sorted(self.nodes_lost),
            "lost_after_training": sorted(self.lost_after_training),
            "forged_records": self.forged_records,
        }

    def _launch_member(self, rank: int) -> str:
        """The process the launch gave ``rank`` (computed once: the snapshot compares every member with it each tick)."""
        if not self._launch_members:
            n = self.spec.nproc_per_node
            self._launch_members = [worker_id(r // n, False, r % n) for r in range(self.spec.world_size)]
        return self._launch_members[rank]

    def _restore(self, state: dict[str, Any]) -> None:
        world = self.spec.world_size
        self.events = Mailbox(self.store, Keys.events, read=int(state["events_read"]))
        self.generation = int(state["generation"])
        unknown = set(state["members_unknown"])
        self.members = {r: self._launch_member(r) for r in range(world) if r not in unknown}
        self.members.update({int(r): w for r, w in state["members_moved"].items()})
        self._record_nodes = set(state["record_nodes"])
        nodes = sorted(self._record_nodes)
        for records in gather(self.store, [Keys.controller_records(n) for n in nodes], list):
            for raw in records:
                rec = WorkerRecord(**raw)
                self.records[rec.wid] = rec
                self.node_of[rec.wid] = rec.node
        self.spares = {w: int(n) for w, n in state["spares"].items()}
        self.finished = set(state["finished"])
        self.lost_wids = set(state["lost_wids"])
        if state["layout"] is not None:
            self._layout_raw = state["layout"]
            self.layout = layout_from_dict(state["layout"])
        self.attached = set(range(world)) if state["attached"] == "all" else set(state["attached"])
        self.migration = None if state["migration"] is None else _migration_from_json(state["migration"], self.members)
        self.sticky = {int(r): w for r, w in state["sticky"].items()}
        self._deferred_drains = {int(r): (v[0], v[1]) for r, v in state["deferred_drains"].items()}
        self._no_loss_repeats = tuple(state["no_loss_repeats"]) if state["no_loss_repeats"] else None  # type: ignore[assignment]
        self.nodes_lost = set(state["nodes_lost"])
        self.lost_after_training = set(state["lost_after_training"])
        self.forged_records = int(state["forged_records"])
        self._written_state = json.dumps(state, sort_keys=True)
        cut = self.ledger.drop_torn_line()
        self.ledger.append(
            JobEvent(
                "controller_takeover",
                f"node {self.node} took over the controller at generation {self.generation}"
                + (f", migration to generation {self.migration.generation} {self.migration.phase}" if self.migration else ""),
                {"node": self.node, "generation": self.generation, "torn_ledger_bytes": cut},
            )
        )
        self._write_workers_json()

    def _persist_state(self) -> None:
        """Write what changed for a successor: the changed nodes' records first, then the state that names them."""
        if self._dirty_nodes:
            by_node: dict[int, list[dict[str, Any]]] = {n: [] for n in self._dirty_nodes}
            for rec in self.records.values():
                if rec.node in by_node:
                    by_node[rec.node].append(dict(vars(rec)))
            nodes = sorted(by_node)
            self.store.multi_set([Keys.controller_records(n) for n in nodes], [json.dumps(by_node[n]) for n in nodes])
            self._record_nodes |= self._dirty_nodes
            self._dirty_nodes = set()
        text = json.dumps(self.snapshot(), sort_keys=True)
        if text != self._written_state:
            self.store.set(Keys.controller_state, text)
            self._written_state = text

    @property
    def training_waits(self) -> bool:
        """A migration is collecting the survivors' reports or waiting for every rank to be ready: the job
        trains again only after the controller's next look (resuming, it already trains)."""
        return self.migration is not None and self.migration.phase in ("collecting", "joining")

    # ---- bookkeeping -----------------------------------------------------------
    def _write_workers_json(self) -> None:
        """Mark ``workers.json`` stale; it is rewritten once at the end of the tick."""
        self._workers_dirty = True

    def _migration_view(self) -> dict[str, Any] | None:
        """The running migration as ``workers.json`` shows it (``torchpass status``): changes at each phase only."""
        m = self.migration
        if m is None:
            return None
        return {"generation": m.generation, "phase": m.phase, "cause": m.cause, "since": m.t_detect, "message": m.message}

    def _flush_workers_json(self) -> None:
        migration = self._migration_view()
        if not self._workers_dirty and migration == self._written_migration:
            return
        self._workers_dirty = False
        self._written_migration = migration
        # Shallow copies and no indentation: json's C encoder then writes 16,384 records in
        # milliseconds where asdict() and the indenting pure-Python encoder took a second.
        rows = [dict(vars(rec)) for _, rec in sorted(self.records.items())]
        for n in range(self.spec.nnodes):
            if self._node_info.get(n) is None:
                self._node_info[n] = try_get(self.store, f"{Keys.node_mail(n)}/info", dict)
        nodes = {str(n): info for n, info in self._node_info.items()}
        data = {
            "generation": self.generation,
            "world_size": self.spec.world_size,
            "store": self.store_address,
            "store_etcd": self.store_etcd,
            "workers": rows,
            "nodes": nodes,
            "migration": migration,
        }
        tmp = self.run_dir / "workers.json.tmp"
        tmp.write_text(json.dumps(data, sort_keys=True))
        os.replace(tmp, self.run_dir / "workers.json")

    def _set_role(self, wid: str, role: str, rank: int | None = None) -> None:
        rec = self.records.get(wid)
        if rec is None:
            return
        rec.role = role
        if rank is not None:
            rec.rank = rank
        rec.generation = self.generation
        self._dirty_nodes.add(rec.node)

    # ---- the tick ----------------------------------------------------------------
    def tick(self) -> None:
        if self.outcome is None:
            self._tick()
            if self._persist:
                self._persist_state()
        self._flush_workers_json()

    def _tick(self) -> None:
        for report in self.events.drain(Report, on_bad=self._on_bad_record):
            try:
                self._on_report(report)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                # A well-formed record whose content makes no sense (a rank the job does not have, a detail missing).
                self._on_bad_record(f"{Keys.events} ({report.kind} from {report.wid})", f"{type(exc).__name__}: {exc}")
            if self.outcome is not None:
                return
        self._check_nodes()
        if self.outcome is not None:
            return
        if self.migration is None:
            self._watch_running()
        else:
            self._advance_migration()

    def _on_bad_record(self, key: str, why: str) -> None:
        # A record nobody can act on must not take node 0's launcher (and the store) down.
        if why == FORGED:
            # A stranger can write these as fast as it likes: logged and recorded once, then counted.
            self.forged_records += 1
            if self.forged_records > 1:
                return
            why += " (further ones are counted, not logged)"
        self.say(f"ignoring record {key}: {why}")
        self.ledger.append(JobEvent("bad_record", f"{key}: {why}", {"key": key}))

    def _on_report(self, report: Report) -> None:
        kind = report.kind
        if kind == "spawned":
            rec = WorkerRecord(report.wid, report.node, int(report.detail["pid"]), report.detail["role"], report.rank, self.generation)
            self.records[report.wid] = rec
            self.node_of[report.wid] = report.node
            self._dirty_nodes.add(report.node)
            if report.rank is not None and report.detail["role"] == "active":
                self.members[report.rank] = report.wid
            self._write_workers_json()
        elif kind == "spare_ready":
            self.spares[report.wid] = report.node
        elif kind == "attached":
            self._on_attached(report)
        elif kind in ("exit", "hung"):
            self._on_exit(report)
        elif kind in ("drain", "node_drain", "migrate"):
            self._on_drain(report)
        else:
            self.say(f"ignoring unknown report {kind!r} from {report.wid}")

    def _on_attached(self, report: Report) -> None:
        assert report.rank is not None
        self.attached.add(report.rank)
        if len(self.attached) == self.spec.world_size:
            # Progress is measured from the first step, not from process start-up.
            self._beats.forget(_PROGRESS)
        detail = report.detail
        if report.rank == 0 and self.layout is None:
            self._layout_raw = detail["layout"]
            self.layout = layout_from_dict(detail["layout"])
            self.config = config_from_mapping(detail["config"], source="the job's torchpass config (rank 0)")
            self.store.set(Keys.state_bytes, str(int(detail["state_bytes"])))
            self.store.set(Keys.config, json.dumps(self.config.to_dict()))
            self.say(f"job layout: {self.layout.describe()}; {detail['state_bytes'] / 1e6:.1f} MB of state per rank")

    def _on_exit(self, report: Report) -> None:
        wid = report.wid
        code = report.detail.get("exitcode")
        if wid in self.spares:
            del self.spares[wid]
            self._set_role(wid, "lost")
            self.ledger.append(JobEvent("spare_lost", f"spare {wid} exited ({code})", report.detail))
            self.say(f"spare {wid} is gone ({report.detail.get('how', code)}); {len(self.spares)} spare(s) left")
            self._write_workers_json()
            return
        rank = next((r for r, w in self.members.items() if w == wid), None)
        rec = self.records.get(wid)
        if wid in self.sticky.values():
            # A spare that was given a rank and died before the generation went live.
            self.lost_wids.add(wid)
            self._set_role(wid, "lost")
            self._write_workers_json()
            return
        if rank is None:
            # A retired rank leaving, a released spare, or a rank already counted lost.
            if rec is not None and rec.role not in ("retired", "lost"):
                self._set_role(wid, "lost" if code else "finished")
            self._write_workers_json()
            return
        if wid in self.lost_wids:
            # A process the controller already counted lost and fenced: its exit adds nothing.
            self._write_workers_json()
            return
        if code == 0 and report.kind == "exit":
            self.finished.add(rank)
            self._set_role(wid, "finished")
            self._write_workers_json()
            if len(self.finished | self.lost_after_training) == self.spec.world_size:
                if self.migration is not None and self.migration.phase == "resuming":
                    # The migration's generation trained to the end (it may have had no step
                    # left to execute, e.g. after a fault in the last checkpoint save): it succeeded.
                    self._close_resumed(self.migration, follow_up=False)
                self._finish(0, self._completed_message())
            return
        self.lost_wids.add(wid)
        self._set_role(wid, "lost")
        self._write_workers_json()
        error = report.detail.get("error")
        if error and not report.detail.get("comm_error") and not report.detail.get("device_failure"):
            self._stop(
                3,
                f"rank {rank} ({wid}) raised an exception in the training script, which a spare would repeat: {error}",
                DISQUALIFYING,
            )
            return
        cause = "hang" if report.kind == "hung" else "kill"
        how = report.detail.get("how", f"exit code {code}")
        self._failure({rank}, cause, f"rank {rank} ({wid}) {how}", report.t)

    def _on_drain(self, report: Report) -> None:
        if report.kind == "node_drain":
            ranks = {r for r, w in self.members.items() if self.node_of.get(w) == report.node}
            for w in [w for w, n in self.spares.items() if n == report.node]:
                # The node's spares leave with it, first: no rank may move onto a node that is going away.
                del self.spares[w]
                self._set_role(w, "retired")
                self._order(report.node, {"retire": w, "why": f"retired: node {report.node} is draining"})
            signal_name = report.detail.get("signal", "request")
            reason = report.detail.get("reason")
            what = f"node {report.node} is draining ({signal_name}{': ' + reason if reason else ''})"
        elif report.rank is None and report.wid in self.spares:
            # A spare whose GPU is failing: it leaves the pool before any rank is given to it.
            del self.spares[report.wid]
            self._set_role(report.wid, "retired")
            self._order(report.node, {"retire": report.wid, "why": f"retired: {report.detail.get('reason', 'asked to leave')}"})
            self.ledger.append(JobEvent("spare_retired", f"spare {report.wid}: {report.detail.get('reason', '')}", report.detail))
            self.say(f"spare {report.wid} retired ({report.detail.get('reason', 'asked to leave')}); {len(self.spares)} spare(s) left")
            self._write_workers_json()
            return
        else:
            rank = report.rank if report.rank is not None else next((r for r, w in self.members.items() if w == report.wid), None)
            ranks = {rank} if rank is not None else set()
            reason = report.detail.get("reason")
            what = f"rank {rank} asked to migrate ({report.detail.get('signal', 'operator')}{': ' + reason if reason else ''})"
        if not ranks:
            return
        m = self.migration
        if m is not None and m.phase == "collecting":
            m.draining |= ranks
            return
        if m is not None:
            # Planned already: the drain follows once this migration ends (its plan cannot take it now).
            for rank in ranks:
                self._deferred_drains[rank] = (self.members.get(rank, ""), what)
            self.say(f"{what} during the migration to generation {m.generation}: it follows once that one ends")
            return
        cause = str(report.detail.get("cause", PLANNED))
        trigger = {k: report.detail[k] for k in ("signal", "reason", "trigger") if k in report.detail}
        self.migration_start(cause, QUALIFYING, set(), ranks, what, report.t, trigger)

    def _take_deferred_drains(self) -> tuple[set[int], str]:
        """Ranks whose deferred drain still applies (the same process holds the rank), and what asked for it."""
        ranks = {r for r, (wid, _) in self._deferred_drains.items() if self.members.get(r) == wid and wid not in self.lost_wids}
        what = "; ".join(sorted({why for r, (_, why) in self._deferred_drains.items() if r in ranks}))
        self._deferred_drains.clear()
        return ranks, what

    # ---- running ---------------------------------------------------------------
    def _watch_running(self) -> None:
        end = try_get_text(self.store, Keys.end(self.generation))
        if end is not None:
            self._failure(set(), "comm", end, time.time())
            return
        now = time.time()
        if len(self.attached) == self.spec.world_size and not self.finished:
            self._check_progress(now)

    def _node_silent(self, node: int) -> bool:
        """Whether node ``node``'s agent has stopped beating too (it beats twice per heartbeat interval).

        Asked about a member found silent, to name the cause: the node's own loss is
        declared by ``_check_nodes`` after the full timeout, which may come a scan later.
        """
        key = Keys.node_beat(node)
        if node == self.node or not self.store.check([key]):
            return False
        return self._quiet(self._beats.age(("node", node), int(self.store.get(key))))

    def _quiet(self, age: float) -> bool:
        """Whether a node agent's beat this old means it missed its beats (it beats twice per heartbeat interval)."""
        return age > 2 * self.config.heartbeat_interval_s

    def _check_nodes(self) -> None:
        """A node whose agent stopped heartbeating is lost with every process on it."""
        now = time.time()
        if now - self._last_node_scan < self.config.heartbeat_interval_s:
            return
        self._last_node_scan = now
        watched = [n for n in range(self.spec.nnodes) if n != self.node and n not in self.nodes_lost]
        self.node_heartbeat_ages = self._node_heartbeats(watched)
        for node, age in self.node_heartbeat_ages.items():
            if age <= self.config.heartbeat_timeout_s:
                continue
            self.nodes_lost.add(node)
            # Its agent may only be stopped or cut off: when it runs again it must kill
            # what is left of its workers (their ranks are given away) and exit.
            self.store.set(Keys.node_lost(node), f"declared lost after {age:.1f} s without a heartbeat")
            for w in [w for w, n in self.spares.items() if n == node]:
                del self.spares[w]
                self.lost_wids.add(w)
                self._set_role(w, "lost")
            # Spares the migration in progress already gave a rank have left the pool: they go with the node
            # too, so that the plan counting on one is voided at the next tick (see _joining) instead of
            # waiting out rebuild_timeout_s for a process that is gone.
            for w in [w for w in self.sticky.values() if self.node_of.get(w) == node]:
                self.lost_wids.add(w)
                self._set_role(w, "lost")
            lost = {r for r, w in self.members.items() if self.node_of.get(w) == node and r not in self.finished}
            for r in lost:
                self.lost_wids.add(self.members[r])
                self._set_role(self.members[r], "lost")
            self._write_workers_json()
            if lost:
                self._failure(lost, "node", f"node {node}'s launcher stopped heartbeating; ranks {sorted(lost)} lost", now - age)

    def _node_heartbeats(self, nodes: list[int]) -> dict[int, float]:
        """Seconds each node's agent has gone without a new beat (nodes whose agent has not beaten yet are left out).

        One read for all nodes once every agent has started: a scan per heartbeat
        interval must not cost two store round trips per node in a large job.
        """
        keys = [Keys.node_beat(n) for n in nodes]
        if not keys:
            return {}
        if check_all(self.store, keys):
            beats = dict(zip(nodes, multi_get(self.store, keys)))
        else:
            found = {n: get_if_present(self.store, k) for n, k in zip(nodes, keys)}
            beats = {n: beat for n, beat in found.items() if beat is not None}
        return {n: self._beats.age(("node", n), int(beat)) for n, beat in beats.items()}

    def _check_progress(self, now: float) -> None:
        if now - self._last_progress_scan < max(0.5, self.config.hang_timeout_s / 20):
            return
        self._last_progress_scan = now
        keys = [Keys.heartbeat(w) for w in self.members.values()]
        if not check_all(self.store, keys):
            return
        beats = gather(self.store, keys, Heartbeat)
        for wid, hb in zip(self.members.values(), beats):
            # A baseline for the heartbeat ages a migration needs at once (_heartbeat_ages).
            self._beats.age(wid, hb.seq)
        # (generation, step): a migration that rolls back a step still moves the job on,
        # and a stranger replaying old heartbeats does not.
        top = max(((hb.generation, hb.step) for hb in beats), default=(0, 0))
        if self._beats.age(_PROGRESS, top) > self.config.hang_timeout_s:
            self._beats.forget(_PROGRESS)
            self._failure(set(), "progress", f"no step finished for {self.config.hang_timeout_s:.0f} s (stuck collective?)", now)

    def _completed_message(self) -> str:
        if not self.lost_after_training:
            return "training completed"
        return f"training completed; rank(s) {sorted(self.lost_after_training)} were lost after it ended"

    def _failure(self, ranks: set[int], cause: str, message: str, t_fault: float) -> None:
        if ranks and self.finished and self.migration is None:
            # Ranks that finished have run the last step: so have the lost ones (its collectives
            # completed everywhere), and a spare would have no step to run. What is lost is only
            # what those processes did after the loop.
            self.lost_after_training |= ranks
            self.say(f"{message}, after rank(s) {sorted(self.finished)} finished training: nothing to migrate")
            self.ledger.append(JobEvent("lost_after_training", message, {"ranks": sorted(ranks), "finished": sorted(self.finished)}))
            if len(self.finished | self.lost_after_training) == self.spec.world_size:
                self._finish(0, self._completed_message())
            return
        m = self.migration
        if m is not None and m.phase == "resuming":
            # The new generation went live and then lost a member: a new incident.
            self._ledger_migration(m, "superseded", m.classification, message)
            self.migration = None
        elif m is not None:
            # A further fault while migrating: fold it into the running attempt. A
            # collective error is a symptom; the process exit behind it is the cause.
            if m.cause in ("comm", "progress") and ranks:
                m.cause, m.message, m.t_fault = cause, message, min(m.t_fault, t_fault)
            # While joining, a lost process of the plan voids it (see _joining).
            m.failed |= ranks
            return
        self.migration_start(cause, QUALIFYING, ranks, set(), message, t_fault)

    def migration_start(
        self,
        cause: str,
        classification: str,
        failed: set[int],
        draining: set[int],
        message: str,
        t_fault: float,
        trigger: dict[str, Any] | None = None,
    ) -> None:
        now = time.time()
        draining = set(draining) | self._take_deferred_drains()[0]
        self.store.compare_set(Keys.end(self.generation), "", message[:500])
        self.migration = _Migration(
            generation=self.generation + 1,
            cause=cause,
            classification=classification,
            t_fault=t_fault,
            t_detect=now,
            failed=set(failed),
            draining=set(draining),
            deadline=now + self.config.report_timeout_s,
            message=message,
            trigger=dict(trigger or {}),
            # Right after the failure nobody has reported yet: the first look for silent members (a read of every
            # member's heartbeat) waits its interval instead of delaying the plan in large jobs.
            last_scan=now,
        )
        self.say(f"generation {self.generation} ended: {message}")

    # ---- collecting --------------------------------------------------------------
    def _advance_migration(self) -> None:
        m = self.migration
        assert m is not None
        if m.phase == "collecting":
            self._collect(m)
        elif m.phase == "joining":
            self._joining(m)
        elif m.phase == "resuming":
            self._resuming(m)

    def _heartbeat_ages(self, ranks: list[int]) -> dict[int, float]:
        """Seconds each member's heartbeat has gone unchanged (infinite if it never beat), in one read when all exist."""
        keys = [Keys.heartbeat(self.members[r]) for r in ranks]
        if check_all(self.store, keys):
            beats: dict[int, Heartbeat | None] = dict(zip(ranks, gather(self.store, keys, Heartbeat)))
        else:
            beats = {r: try_get(self.store, k, Heartbeat) for r, k in zip(ranks, keys)}
        return {r: float("inf") if hb is None else self._beats.age(self.members[r], hb.seq) for r, hb in beats.items()}

    def _collect(self, m: _Migration) -> None:
        ended = m.generation - 1
        expected = [r for r in self.members if r not in m.failed]
        keys = [Keys.status(ended, r) for r in expected]
        now = time.time()
        if not present(self.store, ended, "status", keys):
            # Look for dead or silent members only now and then.
            if now - m.last_scan < 1.0 and now < m.deadline:
                return
            m.last_scan = now
            # Only a member with a stale heartbeat (or any, past the deadline) can be lost: check
            # those members' statuses one by one, and nobody else's.
            ages = self._heartbeat_ages(expected)
            late = now >= m.deadline
            suspects = [r for r in expected if late or ages[r] > self.config.heartbeat_timeout_s]
            missing = [r for r in suspects if not self.store.check([Keys.status(ended, r)])]
            for rank in missing:
                wid = self.members[rank]
                if ages[rank] > self.config.heartbeat_timeout_s:
                    self._lose(rank, wid, "stopped heartbeating during the migration")
                    m.failed.add(rank)
                    if m.cause in ("comm", "progress"):
                        # The collective error was the symptom; a silent process is the cause.
                        m.cause = "node" if self._node_silent(self.node_of.get(wid, 0)) else "hang"
                elif now >= m.deadline:
                    hb = try_get(self.store, Keys.heartbeat(wid), Heartbeat)
                    seen = f"; alive, last seen in phase {hb.phase!r} at step {hb.step}" if hb is not None else ""
                    self._lose(rank, wid, f"did not report within {self.config.report_timeout_s:.0f} s{seen}")
                    m.failed.add(rank)
            expected = [r for r in expected if r not in m.failed]
            keys = [Keys.status(ended, r) for r in expected]
            if not check_all(self.store, keys):
                return
        statuses = dict(zip(expected, gather(self.store, keys, Status)))
        stale = [r for r, st in statuses.items() if st.wid != self.members[r]]
        if stale:
            for r in stale:
                self._on_bad_record(
                    Keys.status(ended, r), f"written by {statuses[r].wid}, not by rank {r}'s member {self.members[r]} (a stale process)"
                )
                self.store.delete_key(Keys.status(ended, r))
            return
        for rank, st in statuses.items():
            if st.draining:
                m.draining.add(rank)
        self._plan(m, statuses)

    def _lose(self, rank: int, wid: str, why: str) -> None:
        """Fence a member that went silent during the current migration.

        When the fault was another rank's (a process lost, a drain), this one is a
        survivor the migration cost as well, and the ledger says so.
        """
        self.say(f"rank {rank} ({wid}) {why}: fencing it")
        m = self.migration
        if m is not None:
            m.silent.add(rank)
            if (m.failed | m.draining) - m.silent:
                m.fenced[rank] = f"{wid} {why}"
        self.lost_wids.add(wid)
        self._set_role(wid, "lost")
        self._order(self.node_of.get(wid, -1), {"fence": wid, "why": "fenced by the controller"})

    def _plan(self, m: _Migration, statuses: dict[int, Status]) -> None:
        if self.layout is None:
            self._stop(4, f"a failure before every rank reached its first step ({m.message}); nothing to migrate yet", DISQUALIFYING)
            return
        inp = PlanInput(
            layout=self.layout,
            generation=m.generation,
            members=dict(self.members),
            statuses=statuses,
            lost=set(m.failed),
            draining=set(m.draining) - m.failed,
            spares=[SpareInfo(w, n) for w, n in sorted(self.spares.items())]
            + [SpareInfo(w, self.node_of[w]) for w in sorted(self.sticky.values()) if w not in self.lost_wids],
            node_of=self.node_of,
            mirrors=_StoreMirrors(self.store, self.spec.world_size, self._on_bad_record),
            sticky=self.sticky,
            cause=m.cause,
            silent_nodes=frozenset(n for n, age in self.node_heartbeat_ages.items() if self._quiet(age)),
        )
        written = try_get(self.store, Keys.plan(m.generation), Plan)
        if written is not None:
            # A predecessor made this plan and was lost before it recorded doing so: members may be acting on it.
            self._adopt_plan(m, written)
            return
        result = plan_migration(inp)
        if isinstance(result, Disqualified) and result.reason == "no_spare" and self._await_starting_spares(m, result.message):
            return
        if isinstance(result, Disqualified) and result.reason == "no_spare" and m.is_planned() and not m.failed:
            # Nobody failed: without a spare the drain cannot be honoured, but training can go on.
            self.say(f"cannot honour the drain ({result.message}); training continues on the same processes")
            self.ledger.append(JobEvent("drain_refused", result.message, {"ranks": sorted(m.draining)}))
            m.classification = DISQUALIFYING
            m.draining = set()
            inp.draining = set()
            result = plan_migration(inp)
        m.t_plan = time.time()
        if isinstance(result, Disqualified):
            self._ledger_migration(m, "failed", DISQUALIFYING, result.message)
            self._stop(2, f"cannot migrate: {result.message}; restart the job from your last checkpoint", DISQUALIFYING, ledger=False)
            return
        if self._repeats_without_loss(m, result.target_version + 1):
            return
        result.moved = self._moved({**self.members, **{int(r): w for r, w in result.joins.items()}})
        self._adopt_plan(m, result)

    def _adopt_plan(self, m: _Migration, result: Plan) -> None:
        """Publish ``result`` (again, when a predecessor wrote it: the same bytes) and wait for its members."""
        m.plan = result
        m.t_plan = m.t_plan or time.time()
        m.members = {**self.members, **{int(r): w for r, w in result.joins.items()}}
        for rank_s, new in result.joins.items():
            self.sticky[int(rank_s)] = new
            self.spares.pop(new, None)
            if not self.store.check([Keys.assign(new)]):
                put(self.store, Keys.assign(new), {"rank": int(rank_s), "generation": m.generation})
        put(self.store, Keys.plan(m.generation), result)
        put(self.store, Keys.gen, m.generation)
        m.phase = "joining"
        m.deadline = time.time() + (self.config.spare_join_timeout_s if result.replaced else self.config.rebuild_timeout_s)
        moves = ", ".join(f"rank {r} -> {result.joins[r]}" for r in sorted(result.joins, key=int)) or "no process replaced"
        fetching = sorted(int(r) for r in result.ranks if result.rank_plan(int(r)).fetch)
        self.say(f"plan for generation {m.generation}: resume at step {result.target_version + 1}; {moves}; ranks {fetching} fetch state")

    def _moved(self, members: dict[int, str]) -> dict[str, int]:
        """Rank -> node of each member not on its rank's launch node (``Plan.moved``: the members' buddy placement)."""
        launch = Placement.contiguous(self.spec.world_size, self.spec.nproc_per_node).node_of
        return {str(r): self.node_of[w] for r, w in sorted(members.items()) if self.node_of[w] != launch[r]}

    def _repeats_without_loss(self, m: _Migration, step: int) -> bool:
        """Stop the job when collectives keep failing at ``step`` with every process alive (True: stopped).

        Nobody lost and the same step again means the error comes with the step, not with a
        process: a spare would repeat it, and re-planning would go on forever.
        """
        if m.cause != "comm" or m.failed or m.draining:
            self._no_loss_repeats = None
            return False
        last = self._no_loss_repeats
        count = last[1] + 1 if last is not None and last[0] == step else 1
        self._no_loss_repeats = (step, count)
        if count <= self.config.comm_failures_per_step:
            return False
        message = (
            f"step {step} failed {count} times in a row with every process alive (last: {m.message}); an error that "
            "repeats at the same step looks like a bug in the training script (mismatched collective shapes, an "
            "exception raised inside the step), not a failure a spare can fix"
        )
        self._ledger_migration(m, "failed", DISQUALIFYING, message)
        self._stop(3, message, DISQUALIFYING, ledger=False)
        return True

    def _await_starting_spares(self, m: _Migration, why: str) -> bool:
        """Whether to plan again later because spares that are still starting may be ready soon.

        A spare is coming once it is spawned: it imports the framework before it reports
        ready (tens of seconds on a cold machine), and a fault in that window should wait
        for it, bounded by ``spare_start_timeout_s`` from the first time planning found none.
        """
        starting = sorted(
            w for w, rec in self.records.items()
            if rec.role == "spare" and w not in self.spares and w not in self.lost_wids and w not in self.sticky.values()
        )  # fmt: skip
        if not starting:
            return False
        now = time.time()
        if not m.awaiting_spares:
            m.awaiting_spares = now
            self.say(
                f"{why}; waiting up to {self.config.spare_start_timeout_s:g} s for {len(starting)} spare(s) still "
                f"starting ({', '.join(starting)})"
            )
        if now - m.awaiting_spares < self.config.spare_start_timeout_s:
            return True
        self.say(f"spare(s) {', '.join(starting)} did not start within {self.config.spare_start_timeout_s:g} s")
        return False

    # ---- joining -------------------------------------------------------------------
    def _joining(self, m: _Migration) -> None:
        assert m.plan is not None
        lost = self.lost_wids.intersection(m.members.values())
        if lost:
            self._abort_joining(f"process(es) {sorted(lost)} lost while joining")
            return
        keys = [Keys.ready(m.generation, r) for r in sorted(m.members)]
        if not present(self.store, m.generation, "ready", keys):
            if time.time() > m.deadline:
                missing = [r for r in sorted(m.members) if not self.store.check([Keys.ready(m.generation, r)])]
                for rank in missing:
                    self._lose(rank, m.members[rank], "did not become ready in time")
                self._abort_joining(f"rank(s) {missing} did not become ready in time")
            return
        answers = dict(zip(sorted(m.members), gather(self.store, keys, Ready)))
        stale = [r for r, a in answers.items() if a.wid != m.members[r] or a.generation != m.generation]
        if stale:
            for r in stale:
                self._on_bad_record(
                    Keys.ready(m.generation, r), f"written by {answers[r].wid}, not by rank {r}'s member {m.members[r]} (a stale process)"
                )
                self.store.delete_key(Keys.ready(m.generation, r))
            return
        failures = [a.failure for a in answers.values() if a.failure]
        if failures:
            if m.attempts >= self.config.transfer_retries + 2:
                self._ledger_migration(m, "failed", m.classification, failures[0])
                self._stop(2, f"cannot migrate: {failures[0]} (after {m.attempts} attempts)", m.classification, ledger=False)
            else:
                self._abort_joining(failures[0])
            return
        self.store.set(Keys.go(m.generation), "go")
        m.t_go = time.time()
        self.generation = m.generation
        for wid in m.plan.retire:
            self._set_role(wid, "retired")
        for rank_s, wid in m.plan.joins.items():
            self._set_role(wid, "active", int(rank_s))
        self.members = dict(m.members)
        self.sticky = {}
        self._write_workers_json()
        m.phase = "resuming"
        m.deadline = time.time() + self.config.report_timeout_s + self.config.hang_timeout_s
        self.say(f"generation {m.generation} is live")

    def _abort_joining(self, why: str) -> None:
        m = self.migration
        assert m is not None and m.plan is not None
        self.store.set(Keys.go(m.generation), f"abort: {why}")
        self._ledger_migration(m, "superseded", m.classification, why)
        self.say(f"migration to generation {m.generation} interrupted: {why}; planning again")
        # Survivors report again at the aborted generation; spares already assigned
        # keep their rank (sticky) unless they were lost too.
        failed = set(m.failed) | {r for r, w in m.members.items() if w in self.lost_wids}
        self.generation = m.generation
        put(self.store, Keys.gen, self.generation)
        self.migration = _Migration(
            generation=m.generation + 1,
            cause=m.cause,
            classification=m.classification,
            t_fault=m.t_fault,
            t_detect=m.t_detect,
            failed=failed,
            draining=set(m.draining) | self._take_deferred_drains()[0],
            deadline=time.time() + self.config.report_timeout_s,
            message=f"{m.message}; then {why}",
            attempts=m.attempts + 1,
        )
        self.store.compare_set(Keys.end(self.generation), "", why[:500])

    # ---- resuming -----------------------------------------------------------------
    def _resuming(self, m: _Migration) -> None:
        assert m.plan is not None
        end = try_get_text(self.store, Keys.end(self.generation))
        if end is not None:
            self._failure(set(), "comm", end, time.time())
            return
        keys = [Keys.done(m.generation, r) for r in sorted(m.members)]
        if not present(self.store, m.generation, "done", keys) and time.time() < m.deadline:
            return
        self._close_resumed(m)
        self._beats.forget(_PROGRESS)

    def _close_resumed(self, m: _Migration, follow_up: bool = True) -> None:
        """Record a resumed migration as a success, with the done reports of the members that sent one.

        With ``follow_up``, drains asked for while it ran start now (not when training just completed).
        """
        keys = [Keys.done(m.generation, r) for r in sorted(m.members)]
        if present(self.store, m.generation, "done", keys):
            done = dict(zip(sorted(m.members), gather(self.store, keys, dict)))
        else:
            done = {r: d for r, k in zip(sorted(m.members), keys) if (d := try_get(self.store, k, dict)) is not None}
        self._ledger_migration(m, "success", m.classification, m.message, done)
        self.migration = None
        ranks, what = self._take_deferred_drains()
        if ranks and follow_up:
            self.migration_start(PLANNED, QUALIFYING, set(), ranks, what, time.time())

    def _ledger_migration(
        self, m: _Migration, outcome: str, classification: str, message: str, done: dict[int, dict[str, Any]] | None = None
    ) -> None:
        done = done or {}
        plan = m.plan
        timings = {"detect": m.t_detect - m.t_fault}
        if m.t_plan:
            timings["report_and_plan"] = m.t_plan - m.t_detect
        for key in ("spare_setup", "transfer", "fetch", "rebuild"):
            values = [d[key] for d in done.values() if key in d]
            if values:
                timings[key] = max(values)
        finished = [d["t_done"] for d in done.values() if "t_done" in d]
        if finished and m.t_go:
            timings["resume"] = max(finished) - m.t_go
            timings["total"] = max(finished) - m.t_fault
        sources: dict[str, Any] = {}
        if plan is not None and self.layout is not None:
            for rank_s in plan.ranks:
                fetch = plan.rank_plan(int(rank_s)).fetch
                if fetch:
                    sources[rank_s] = {
                        "at": self.layout.locate(int(rank_s)),
                        "from": {
                            cls: [{"rank": r, "copy": copy, "at": self.layout.locate(r)} for r, copy in src]
                            for cls, src in fetch.items()
                        },
                    }
        event = MigrationEvent(
            generation=m.generation,
            cause=m.cause,
            classification=classification,
            outcome=outcome,
            failed_ranks=sorted(m.failed | m.draining),
            replaced=dict(plan.joins) if plan is not None else {},
            target_step=plan.target_version + 1 if plan is not None else 0,
            steps_lost=plan.steps_lost if plan is not None else 0,
            sources=sources,
            bytes_moved=sum(int(d.get("bytes", 0)) for d in done.values()),
            timings={k: round(v, 4) for k, v in timings.items()},
            message=message,
            fenced={str(r): why for r, why in sorted(m.fenced.items())},
            trigger=m.trigger,
        )
        self.ledger.append(event)
        if outcome == "success":
            t = event.timings
            self.say(
                f"migration to generation {m.generation} succeeded: step {event.target_step} re-executed, "
                f"{event.bytes_moved / 1e6:.1f} MB moved, {t.get('total', 0.0):.2f} s from fault to the resumed step done "
                f"(detect {t.get('detect', 0):.2f} s, transfer {t.get('transfer', 0):.2f} s, rebuild {t.get('rebuild', 0):.2f} s)"
            )

    # ---- ending ---------------------------------------------------------------------
    def _finish(self, code: int, message: str) -> None:
        self.store.set(Keys.outcome, json.dumps({"code": code, "message": message}))
        self._shutdown_keys(message)
        self.ledger.append(
            JobEvent("job_end", message, {"exit_code": code, "generation": self.generation, "forged_records": self.forged_records})
        )
        self.outcome = (code, message)

    def _stop(self, code: int, message: str, classification: str, ledger: bool = True) -> None:
        if ledger:
            self.ledger.append(JobEvent("job_failed", message, {"classification": classification}))
        self._finish(code, message)

    def _shutdown_keys(self, reason: str) -> None:
        self.store.set(Keys.shutdown, reason)
        for wid in list(self.spares):
            if not self.store.check([Keys.assign(wid)]):
                put(self.store, Keys.assign(wid), {"exit": reason})
        g = self.generation
        self.store.compare_set(Keys.end(g), "", reason[:500])
        if self.migration is not None:
            mg = self.migration.generation
            if not self.store.check([Keys.plan(mg)]):
                put(self.store, Keys.plan(mg), {"shutdown": reason})
            self.store.compare_set(Keys.go(mg), "", f"abort: {reason}")

    def stop_on_request(self, message: str) -> None:
        """The launcher was told to stop (SIGINT) or lost a node it cannot replace."""
        self._stop(130, message, DISQUALIFYING)


def _migration_to_json(m: _Migration) -> dict[str, Any]:
    """A migration as JSON; its members are left out: they are the job's members with the plan's joins."""
    out = asdict(m)
    del out["members"]
    for name in ("failed", "draining", "silent"):
        out[name] = sorted(out[name])
    out["fenced"] = {str(r): why for r, why in m.fenced.items()}
    return out


def _migration_from_json(data: dict[str, Any], members: dict[int, str]) -> _Migration:
    m = _Migration(**data)
    for name in ("failed", "draining", "silent"):
        setattr(m, name, set(getattr(m, name)))
    m.fenced = {int(r): why for r, why in m.fenced.items()}
    if m.plan is not None:
        m.plan = Plan(**m.plan)  # type: ignore[arg-type]
        m.members = {**members, **{int(r): w for r, w in m.plan.joins.items()}}
    return m


class _StoreMirrors(Mapping[int, MirrorInfo]):
    """The ranks' small-state mirrors for the planner, read from the store on first use.

    The planner reads the mirrors of the ranks that must obtain their small state
    elsewhere and, only when such a rank has no record at the target, those of its
    replicas. Reading every rank's records up front cost three store reads and
    three digests per rank: seconds for one migration at 16,384 ranks.
    """

    def __init__(self, store: dist.Store, world_size: int, on_bad_record: Callable[[str, str], None]):
        self._store = store
        self._world_size = world_size
        self._on_bad_record = on_bad_record
        self._cache: dict[int, MirrorInfo | None] = {}

    def _load(self, rank: int) -> MirrorInfo | None:
        if rank not in self._cache:
            try:
                records = read_mirror(self._store, rank)
            except ForbiddenObject as exc:
                # A record the controller may not load (a type the provider put in its small state that
                # safe_pickle does not allow): that rank has no usable mirror, and the plan does without.
                self._on_bad_record(f"the small-state mirror of rank {rank}", str(exc))
                records = {}
            self._cache[rank] = MirrorInfo({v: rng_digest(rec["rng"]) for v, rec in records.items()}) if records else None
        return self._cache[rank]

    def __getitem__(self, rank: int) -> MirrorInfo:
        info = self._load(rank) if 0 <= rank < self._world_size else None
        if info is None:
            raise KeyError(rank)
        return info

    def __iter__(self) -> Iterator[int]:
        return (r for r in range(self._world_size) if self._load(r) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def try_get_text(store: dist.Store, key: str) -> str | None:
    raw = get_if_present(store, key)
    return None if raw is None else raw.decode()
