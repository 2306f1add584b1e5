"""Control-plane scaling: one migration's planning and coordination cost as the job grows.

    python bench/control_plane.py [--sizes 64 256 1024 4096 16384]

The real controller (``core/controller.py``) runs against a real TCPStore; the
ranks are simulated: a second store client writes, in batches, exactly the
records N workers would write (registration, heartbeats, small-state mirrors,
statuses, ready and done reports), so the store holds the same keys and the
controller does the same work as in a job of N ranks.

Measured per size, for one SIGKILLed rank replaced by a spare:

* the controller's busy time (the sum of its ``tick()`` calls) from the failure
  report to the migration's start, from the statuses to the published plan
  (reading statuses and mirrors, planning), from the last ready report to
  ``go``, and from ``go`` to the closed ledger entry;
* the critical path: the part of the first three phases before the write the
  members wait for (``end``, the plan, ``go``);
* the store operations the controller issued in those phases;
* the size of the plan every member reads, and the store operations one
  surviving worker issues for the protocol (constant by design);
* what a member does after ``go`` before its first step, each part run for real
  against the same store through the same layers a worker uses (sealed values,
  prefixes, the rendezvous store that gives up with its generation), by sample ranks:
  the rendezvous of the rebuilt group (``comms.rebuild_all``, then the barrier
  ``Migration._go_live`` runs: gloo connects each pair lazily in the workers'
  environment, so a member writes its address record, at gloo's size, and reads the
  records of the peers the dissemination barrier needs, in gloo's order:
  :func:`barrier_peers`, 2 log2 N of them; the first step's ring allreduce needs
  rank +- 1, already among them), and the buddy routing (``BuddyRouting.target``:
  the plan and the target's address record); their store operations per rank and
  their time. Connecting the sockets is the network's part, not the store's, and
  is left out.

The critical path adds the controller's time until it writes ``end``, the
plan and ``go`` to one member's rendezvous and routing after ``go``. The
simulated workers' own writes are excluded: in a real job N processes make
them in parallel (the store serves them one at a time, though: the table also
gives the requests of all members after ``go``). The simulated job is data
parallel, so the world group is the one group rebuilt; a job with more groups
rebuilds each, its ranks paying each group's rendezvous in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from torchpass.core import safe_pickle
from torchpass.core.buddy_routing import BuddyRouting
from torchpass.core.config import TorchPassConfig
from torchpass.core.control import MIRROR_SLOTS, Heartbeat, Keys, Mailbox, Ready, Report, Status, signed
from torchpass.core.controller import Controller, JobSpec
from torchpass.core.rendezvous_store import LAZY_CONNECT_ENV, RANK_AS_SEQUENCE_ENV, InterruptibleStore, worker_environment
from torchpass.core.rng import capture_rng
from torchpass.core.signed_store import SignedStore
from torchpass.core.topology import ddp_layout, layout_to_dict

PER_NODE = 8
"""Simulated ranks per node (one spare per node)."""
VERSION = 5
"""Optimizer steps every survivor's state reflects when the fault hits."""
WORKER_OPS = {"status": 2, "plan": 2, "ready": 2, "go": 2, "done": 2}
"""Store operations one surviving worker issues per migration (``Runtime.recover``): write + count, wait + read, ..."""
ROUTING_SAMPLE = 8
"""Members whose buddy routing is run for real (the replaced rank and others spread over the job)."""
WORLD_GROUP = "0"
"""The default group's name, as c10d names it: the group the data-parallel job rebuilds."""
BATCH_BYTES = 64 << 10
"""Bytes per ``multi_set`` when the simulated workers write their records (the store parses a request as a
whole: megabyte-sized batches slow it down far more than many small ones)."""


class CountingStore:
    """Delegates to a store, counts the operations issued through it and notes when each key was written."""

    def __init__(self, store: dist.Store):
        self._store = store
        self.ops = 0
        self.written: dict[str, float] = {}
        """Key -> ``perf_counter()`` after its last ``set`` / ``compare_set`` returned."""

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.ops += 1
            result = attr(*args, **kwargs)
            if name in ("set", "compare_set"):
                self.written[args[0]] = time.perf_counter()
            return result

        return counted


@dataclass
class PhaseCost:
    """The controller's cost for one phase of the migration."""

    busy_s: float = 0.0
    """Sum of the controller's ``tick()`` wall times in the phase."""
    ticks: int = 0
    """``tick()`` calls until the phase's outcome appeared."""
    store_ops: int = 0
    """Store operations the controller issued in the phase."""
    published_s: float = 0.0
    """From the phase's first tick to the write the members wait for (the rest of the tick overlaps their work)."""


def _multi_set(store: dist.Store, items: dict[str, bytes]) -> None:
    keys: list[str] = []
    size = 0
    for key, value in items.items():
        keys.append(key)
        size += len(value)
        if size >= BATCH_BYTES:
            store.multi_set(keys, [items[k] for k in keys])
            keys, size = [], 0
    if keys:
        store.multi_set(keys, [items[k] for k in keys])


def _json(record: Any) -> bytes:
    return json.dumps(asdict(record)).encode()


class SimulatedJob:
    """Writes the store records of ``size`` workers and one spare per node, as real ones would."""

    def __init__(self, store: dist.Store, size: int):
        self.store = store
        self.size = size
        self.nodes = max(1, size // PER_NODE)
        self.wid = {r: f"n{r // PER_NODE}-a{r % PER_NODE}" for r in range(size)}
        self.spares = {f"n{n}-s0": n for n in range(self.nodes)}
        """Spare -> its node."""
        self.mail = Mailbox(store, Keys.events)

    def start(self, config: TorchPassConfig) -> None:
        """Registration, spares, heartbeats, mirrors at versions VERSION-2..VERSION, attachment."""
        for r in range(self.size):
            self.mail.post(Report("spawned", self.wid[r], r // PER_NODE, r, detail={"pid": 1000 + r, "role": "active"}))
        for wid, n in self.spares.items():
            self.mail.post(Report("spawned", wid, n, None, detail={"pid": 900000 + n, "role": "spare"}))
            self.mail.post(Report("spare_ready", wid, n))
        now = time.time()
        _multi_set(self.store, {Keys.heartbeat(w): _json(Heartbeat(now, VERSION, 0, "train")) for w in self.wid.values()})
        _multi_set(self.store, {Keys.node_beat(n): b"1" for n in range(self.nodes)})
        info = {n: json.dumps({"pid": 800000 + n, "host": f"node{n}"}).encode() for n in range(self.nodes)}
        _multi_set(self.store, {f"{Keys.node_mail(n)}/info": raw for n, raw in info.items()})
        # Data-parallel replicas seeded alike share their RNG streams: one record serves every rank.
        rng = capture_rng()
        mirrors = {}
        for version in range(VERSION - MIRROR_SLOTS + 1, VERSION + 1):
            record = safe_pickle.dumps({"kind": "backward", "version": version, "rng": rng, "data": None})
            mirrors.update({Keys.mirror(r, version % MIRROR_SLOTS): record for r in range(self.size)})
        _multi_set(self.store, mirrors)
        layout = layout_to_dict(ddp_layout(self.size))
        for r in range(self.size):
            # Only rank 0's layout and config are read; the others attach with the same small detail.
            detail: dict[str, Any] = {"state_bytes": 1 << 20, "version": VERSION}
            if r == 0:
                detail.update(layout=layout, groups=[], config=config.to_dict())
            self.mail.post(Report("attached", self.wid[r], r // PER_NODE, r, detail=detail))

    def kill(self, rank: int) -> None:
        self.mail.post(Report("exit", self.wid[rank], rank // PER_NODE, rank, detail={"exitcode": -9, "how": "was killed by SIGKILL"}))

    def report_statuses(self, generation: int, failed: int) -> None:
        statuses = {
            Keys.status(generation, r): _json(Status(r, self.wid[r], VERSION, True, VERSION + 1, ["127.0.0.1", 20000 + r]))
            for r in range(self.size)
            if r != failed
        }
        _multi_set(self.store, statuses)
        self.store.add(Keys.count(generation, "status"), len(statuses))

    def publish_addresses(self, generation: int, joins: dict[str, str]) -> None:
        """Every member's ``rankinfo`` record for ``generation`` (``BuddyRouting.publish``), a joined spare's on its node."""
        records = {}
        for r in range(self.size):
            wid = joins.get(str(r), self.wid[r])
            node = self.spares[wid] if wid in self.spares else r // PER_NODE
            info = {"node": node, "addr": ["127.0.0.1", 20000 + r], "wid": wid, "generation": generation}
            records[Keys.rankinfo(r)] = json.dumps(info).encode()
        _multi_set(self.store, records)

    def report(self, generation: int, what: str, payload: Callable[[int], bytes]) -> None:
        keys = {"ready": Keys.ready, "done": Keys.done}[what]
        _multi_set(self.store, {keys(generation, r): payload(r) for r in range(self.size)})
        self.store.add(Keys.count(generation, what), self.size)


class _Holdings:
    """Stands in for a member's buddy keeper: the bench keeps no copies, so there is nothing to forget."""

    def forget_holdings_except(self, sources: set[int]) -> None:
        del sources


def gloo_record_bytes(size: int, env: Mapping[str, str]) -> int:
    """Bytes of the address record a rank of a ``size``-rank gloo group writes (gloo's tcp ``Rank``): the host name
    and the device's socket address (``sockaddr_storage`` and a sequence number), each after its length, then one
    8-byte pair identifier per rank of the group, unless ``env`` has gloo use ranks as sequence numbers or connect
    lazily (a worker of ``torchpass launch`` does both: ``rendezvous_store.worker_environment``)."""
    on = ("1", "true", "True")
    per_rank = 0 if env.get(RANK_AS_SEQUENCE_ENV) in on or env.get(LAZY_CONNECT_ENV) in on else 8
    return 8 + len(socket.gethostname()) + 8 + 136 + per_rank * size


def barrier_peers(rank: int, size: int) -> list[int]:
    """The peers whose address records ``rank`` of a lazily connected gloo group reads for a barrier, in gloo's
    order: ``gloo::barrier`` is a dissemination barrier, receiving from the rank ``d`` below and sending to the
    rank ``d`` above for ``d`` = 1, 2, 4, ... below ``size``."""
    peers: list[int] = []
    d = 1
    while d < size:
        for peer in ((rank - d) % size, (rank + d) % size):
            if peer != rank and peer not in peers:
                peers.append(peer)
        d <<= 1
    return peers


def rendezvous_store(store: SignedStore, generation: int) -> dist.Store:
    """The store a member's gloo rendezvous of the world group goes through (``comms.rebuild_all``'s)."""
    prefix = dist.PrefixStore(f"torchpass/pg/{generation}/{WORLD_GROUP}/", store)
    return InterruptibleStore(prefix, lambda: False, f"the bench's rendezvous of generation {generation}", timedelta(seconds=120))


def rendezvous_key(rank: int) -> str:
    """The key of ``rank``'s address record, under gloo's own prefix for its first device."""
    return f"0/{rank}"


def measure_rendezvous(
    member: SignedStore, counting: CountingStore, writer: SignedStore, size: int, generation: int, rank: int
) -> tuple[int, float]:
    """One member's rendezvous of the world group rebuilt for ``generation``: (store operations, seconds).

    As a lazily connected ``ProcessGroupGloo`` does it: write the rank's record when
    the group is built, then read each peer's record the first time the barrier
    after the rebuild needs it (a wait and a get, on gloo's thread).
    """
    record = bytes(gloo_record_bytes(size, {**os.environ, **worker_environment(os.environ)}))
    peers = barrier_peers(rank, size)
    others = rendezvous_store(writer, generation)
    for r in peers:
        others.set(rendezvous_key(r), record)  # the other members' writes: not this member's cost
    store = rendezvous_store(member, generation)
    counting.ops = 0
    t0 = time.perf_counter()
    store.set(rendezvous_key(rank), record)
    for r in peers:
        store.wait([rendezvous_key(r)])
        store.get(rendezvous_key(r))
    return counting.ops, time.perf_counter() - t0


def measure_routing(member: SignedStore, counting: CountingStore, size: int, generation: int, replaced: int) -> tuple[int, float]:
    """The buddy routing of sample members in ``generation``: the most store operations and seconds of one of them.

    Each sample is a process's first resolution (a spare's case: it reads the job record too).
    """
    sample = sorted({replaced} | {i * size // ROUTING_SAMPLE for i in range(ROUTING_SAMPLE)})
    most_ops, most_s = 0, 0.0
    for rank in sample:
        routing = BuddyRouting(member, rank, size)
        counting.ops = 0
        t0 = time.perf_counter()
        routing.target(generation, threading.Event(), _Holdings())  # type: ignore[arg-type]
        most_s = max(most_s, time.perf_counter() - t0)
        most_ops = max(most_ops, counting.ops)
    return most_ops, most_s


def _drive(
    controller: Controller, counting: CountingStore, until: Callable[[], bool], publishes: str | None = None, max_ticks: int = 1000
) -> PhaseCost:
    """Tick the controller until ``until()``; fail loudly if it stops the job or never gets there.

    ``publishes``: the key whose write ends the phase for the members (its time goes to ``published_s``).
    """
    cost = PhaseCost()
    start_ops = counting.ops
    t_first = time.perf_counter()
    while not until():
        if controller.outcome is not None:
            raise RuntimeError(f"the controller stopped the simulated job: {controller.outcome[1]}")
        if cost.ticks >= max_ticks:
            raise RuntimeError(f"the controller did not get there in {max_ticks} ticks (phase {controller.migration})")
        t0 = time.perf_counter()
        controller.tick()
        cost.busy_s += time.perf_counter() - t0
        cost.ticks += 1
    cost.store_ops = counting.ops - start_ops
    if publishes is not None:
        cost.published_s = counting.written[publishes] - t_first
    return cost


def measure(size: int, port: int) -> dict[str, Any]:
    """One migration in a simulated job of ``size`` ranks; the controller's cost per phase."""
    timeout = timedelta(seconds=120)
    # Both ends through the job secret, as in a real job: every value sealed and opened.
    secret = secrets.token_hex(16).encode()
    server = signed(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timeout), secret, timeout)
    workers = signed(dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timeout), secret, timeout)
    counting = CountingStore(server)
    # One member's own connection, counted beneath the seal: what reaches the store.
    member_counting = CountingStore(dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timeout))
    member = signed(member_counting, secret, timeout)  # type: ignore[arg-type]
    job = SimulatedJob(workers, size)
    spec = JobSpec(size, job.nodes, min(size, PER_NODE), 1, "bench", ["bench"])
    # Simulated ranks do not heartbeat on their own: keep every liveness timeout out of the way.
    config = TorchPassConfig(report_timeout_s=600.0, hang_timeout_s=3600.0, heartbeat_timeout_s=3600.0)
    with tempfile.TemporaryDirectory(prefix="torchpass-cp-") as run_dir:
        controller = Controller(counting, spec, Path(run_dir), config, lambda msg: None, lambda node, order: None, f"127.0.0.1:{port}")
        job.start(config)
        _drive(controller, counting, lambda: len(controller.attached) == size)

        failed = size // 2
        job.kill(failed)
        detect = _drive(controller, counting, lambda: controller.migration is not None, publishes=Keys.end(0))
        job.report_statuses(0, failed)
        plan = _drive(controller, counting, lambda: workers.check([Keys.plan(1)]), publishes=Keys.plan(1))
        plan_bytes = len(workers.get(Keys.plan(1)))
        joins = json.loads(workers.get(Keys.plan(1)))["joins"]
        job.publish_addresses(1, joins)
        job.report(1, "ready", lambda r: _json(Ready(joins.get(str(r), job.wid[r]), 1)))
        go = _drive(controller, counting, lambda: workers.check([Keys.go(1)]), publishes=Keys.go(1))
        if workers.get(Keys.go(1)) != b"go":
            raise RuntimeError(f"generation 1 was aborted: {workers.get(Keys.go(1)).decode()}")
        # After go, each member: the rendezvous of the rebuilt group, then its buddy routing (Migration._go_live).
        rendezvous_ops, rendezvous_s = measure_rendezvous(member, member_counting, workers, size, 1, failed)
        routing_ops, routing_s = measure_routing(member, member_counting, size, 1, failed)
        job.report(1, "done", lambda r: json.dumps({"t_done": time.time(), "bytes": 1 << 20}).encode())
        close = _drive(controller, counting, lambda: controller.migration is None)
    phases = {"detect": detect, "plan": plan, "go": go, "close": close}
    # What the members wait for: the controller's time until it writes ``end``, the plan and ``go``. The
    # rest of those ticks (workers.json) and closing the ledger entry overlap their work.
    controller_s = detect.published_s + plan.published_s + go.published_s
    return {
        "ranks": size,
        **{f"{name}_s": cost.busy_s for name, cost in phases.items()},
        **{f"{name}_ops": cost.store_ops for name, cost in phases.items()},
        "controller_critical_s": controller_s,
        "rendezvous_ops": rendezvous_ops,
        "rendezvous_s": rendezvous_s,
        "routing_ops": routing_ops,
        "routing_s": routing_s,
        # Then each member: the rendezvous of the rebuilt group and its buddy routing, before its first step.
        "critical_s": controller_s + rendezvous_s + routing_s,
        "total_s": sum(cost.busy_s for cost in phases.values()),
        "total_ops": sum(cost.store_ops for cost in phases.values()),
        "plan_bytes": plan_bytes,
        "worker_store_ops": sum(WORKER_OPS.values()),
        "after_go_requests": size * (rendezvous_ops + routing_ops),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    """The results as a Markdown table (critical path: what the members wait for, failure to their first step)."""
    lines = [
        "| ranks | failure -> migration (s) | statuses -> plan (s) | ready -> go (s) | rendezvous ops per rank "
        "| rendezvous (s) | routing ops per rank | routing (s) | critical path (s) | go -> ledger (s) "
        "| controller store ops | plan bytes | protocol ops per worker | requests after go, all ranks |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['detect_s']:.4f} | {r['plan_s']:.4f} | {r['go_s']:.4f} | {r['rendezvous_ops']} "
            f"| {r['rendezvous_s']:.4f} | {r['routing_ops']} | {r['routing_s']:.4f} | **{r['critical_s']:.4f}** "
            f"| {r['close_s']:.4f} | {r['total_ops']} | {r['plan_bytes']} | {r['worker_store_ops']} | {r['after_go_requests']} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384])
    p.add_argument("--port", type=int, default=29900, help="first store port (one per size)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "control_plane.json"))
    args = p.parse_args()
    rows = [measure(size, args.port + i) for i, size in enumerate(args.sizes)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(markdown(rows))


if __name__ == "__main__":
    main()
