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
  surviving worker issues (constant by design).

The simulated workers' own writes are excluded: in a real job N processes make
them in parallel. The gloo rendezvous of the rebuilt groups is not included
either: it is the transport's own (full-mesh for gloo).
"""

from __future__ import annotations

import argparse
import json
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from torchpass.core import safe_pickle
from torchpass.core.config import TorchPassConfig
from torchpass.core.control import MIRROR_SLOTS, Heartbeat, Keys, Mailbox, Ready, Report, Status, signed
from torchpass.core.controller import Controller, JobSpec
from torchpass.core.rng import capture_rng
from torchpass.core.topology import ddp_layout, layout_to_dict

PER_NODE = 8
"""Simulated ranks per node (one spare per node)."""
VERSION = 5
"""Optimizer steps every survivor's state reflects when the fault hits."""
WORKER_OPS = {"status": 2, "plan": 2, "ready": 2, "go": 2, "done": 2}
"""Store operations one surviving worker issues per migration (``Runtime.recover``): write + count, wait + read, ..."""
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
        self.mail = Mailbox(store, Keys.events)

    def start(self, config: TorchPassConfig) -> None:
        """Registration, spares, heartbeats, mirrors at versions VERSION-2..VERSION, attachment."""
        for r in range(self.size):
            self.mail.post(Report("spawned", self.wid[r], r // PER_NODE, r, detail={"pid": 1000 + r, "role": "active"}))
        for n in range(self.nodes):
            self.mail.post(Report("spawned", f"n{n}-s0", n, None, detail={"pid": 900000 + n, "role": "spare"}))
            self.mail.post(Report("spare_ready", f"n{n}-s0", n))
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

    def report(self, generation: int, what: str, payload: Callable[[int], bytes]) -> None:
        keys = {"ready": Keys.ready, "done": Keys.done}[what]
        _multi_set(self.store, {keys(generation, r): payload(r) for r in range(self.size)})
        self.store.add(Keys.count(generation, what), self.size)


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
    job = SimulatedJob(workers, size)
    spec = JobSpec(size, job.nodes, min(size, PER_NODE), 1, "bench", ["bench"])
    # Simulated ranks do not heartbeat on their own: keep every liveness timeout out of the way.
    config = TorchPassConfig(report_timeout_s=600.0, hang_timeout_s=3600.0, heartbeat_timeout_s=3600.0)
    with tempfile.TemporaryDirectory(prefix="torchpass-cp-") as run_dir:
        controller = Controller(counting, spec, Path(run_dir), config, lambda msg: None, lambda wid, node: None, f"127.0.0.1:{port}")
        job.start(config)
        _drive(controller, counting, lambda: len(controller.attached) == size)

        failed = size // 2
        job.kill(failed)
        detect = _drive(controller, counting, lambda: controller.migration is not None, publishes=Keys.end(0))
        job.report_statuses(0, failed)
        plan = _drive(controller, counting, lambda: workers.check([Keys.plan(1)]), publishes=Keys.plan(1))
        plan_bytes = len(workers.get(Keys.plan(1)))
        joins = json.loads(workers.get(Keys.plan(1)))["joins"]
        job.report(1, "ready", lambda r: _json(Ready(joins.get(str(r), job.wid[r]), 1)))
        go = _drive(controller, counting, lambda: workers.check([Keys.go(1)]), publishes=Keys.go(1))
        if workers.get(Keys.go(1)) != b"go":
            raise RuntimeError(f"generation 1 was aborted: {workers.get(Keys.go(1)).decode()}")
        job.report(1, "done", lambda r: json.dumps({"t_done": time.time(), "bytes": 1 << 20}).encode())
        close = _drive(controller, counting, lambda: controller.migration is None)
    del workers, server
    phases = {"detect": detect, "plan": plan, "go": go, "close": close}
    return {
        "ranks": size,
        **{f"{name}_s": cost.busy_s for name, cost in phases.items()},
        **{f"{name}_ops": cost.store_ops for name, cost in phases.items()},
        # What the members wait for: the controller's time until it writes ``end``, the plan and ``go``. The
        # rest of those ticks (workers.json) and closing the ledger entry overlap their work.
        "critical_s": detect.published_s + plan.published_s + go.published_s,
        "total_s": sum(cost.busy_s for cost in phases.values()),
        "total_ops": sum(cost.store_ops for cost in phases.values()),
        "plan_bytes": plan_bytes,
        "worker_store_ops": sum(WORKER_OPS.values()),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    """The results as a Markdown table (critical path: what the members wait for, failure to ``go``)."""
    lines = [
        "| ranks | failure -> migration (s) | statuses -> plan (s) | ready -> go (s) | critical path (s) "
        "| go -> ledger (s) | controller store ops | plan bytes | store ops per worker |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['detect_s']:.4f} | {r['plan_s']:.4f} | {r['go_s']:.4f} | **{r['critical_s']:.4f}** "
            f"| {r['close_s']:.4f} | {r['total_ops']} | {r['plan_bytes']} | {r['worker_store_ops']} |"
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
