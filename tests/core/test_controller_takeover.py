"""A controller taking over continues from exactly what its predecessor decided, read from a real store.

The mechanism behind the controller's fail-over (``Controller.snapshot``/``take_over``), without a cluster:
a predecessor runs against a real TCPStore (its writes are the same on etcd), a successor is built from the
store alone, and both must hold the same decisions. The state it rewrites stays small as the job grows.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from torchpass.core.config import TorchPassConfig
from torchpass.core.control import Keys, Mailbox, Report, worker_id
from torchpass.core.controller import Controller, JobSpec
from torchpass.core.free_port import free_port
from torchpass.core.ledger import read_ledger

ETCD_URL = "etcd://etcd1:2379/torchpass/job"
"""Names the job's store as etcd: the controller then writes its state for a successor (the store here is a TCPStore)."""


def _job(tmp_path: Path, nnodes: int, nproc: int) -> tuple[dist.Store, Controller, Mailbox]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    spec = JobSpec(nnodes * nproc, nnodes, nproc, 1, "t", ["train.py"])
    controller = Controller(store, spec, tmp_path, TorchPassConfig(), lambda _: None, lambda node, order: None, "h:1", ETCD_URL)
    events = Mailbox(store, Keys.events)
    for node in range(nnodes):
        for i in range(nproc):
            events.post(Report("spawned", worker_id(node, False, i), node, node * nproc + i, detail={"pid": 1000 + i, "role": "active"}))
        events.post(Report("spawned", worker_id(node, True, 0), node, detail={"pid": 2000 + node, "role": "spare"}))
        events.post(Report("spare_ready", worker_id(node, True, 0), node))
    controller.tick()
    return store, controller, events


def _successor(store: dist.Store, run_dir: Path, node: int) -> Controller:
    return Controller.take_over(store, run_dir, lambda _: None, lambda n, order: None, "h:1", ETCD_URL, node)


def test_a_successor_holds_the_decisions_of_a_controller_lost_mid_migration(tmp_path: Path) -> None:
    store, first, events = _job(tmp_path, nnodes=3, nproc=2)
    events.post(Report("exit", worker_id(1, False, 1), 1, 3, detail={"exitcode": -9, "how": "was killed by SIGKILL"}))
    events.post(Report("exit", worker_id(2, True, 0), 2, detail={"exitcode": -9}))  # a spare lost too
    first.tick()
    assert first.migration is not None and first.migration.failed == {3} and first.migration.phase == "collecting"
    second = _successor(store, tmp_path, node=2)
    assert second.snapshot() == first.snapshot()
    assert second.records == first.records and second.node_of == first.node_of and second.members == first.members
    assert second.spares == {worker_id(0, True, 0): 0, worker_id(1, True, 0): 1}
    assert second.node == 2
    # The successor reads the mailbox on from where the predecessor stopped: nothing is handled twice.
    events.post(Report("spare_ready", worker_id(0, True, 0), 0))
    second.tick()
    assert second.migration is not None and second.migration.failed == {3}
    takeover = [e for e in read_ledger(tmp_path) if e["type"] == "controller_takeover"]
    assert takeover[0]["message"] == "node 2 took over the controller at generation 0, migration to generation 1 collecting"


def test_a_line_the_lost_controller_left_half_written_is_cut_before_the_successor_appends(tmp_path: Path) -> None:
    store, _, _ = _job(tmp_path, nnodes=2, nproc=2)
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"type": "migration", "generat')  # killed mid-write
    _successor(store, tmp_path, node=1)
    events = list(read_ledger(tmp_path))
    assert [e["type"] for e in events] == ["job_start", "controller_takeover"]
    assert events[-1]["detail"]["torn_ledger_bytes"] == len('{"type": "migration", "generat')


def test_the_state_rewritten_for_a_successor_does_not_grow_with_the_ranks(tmp_path: Path) -> None:
    sizes = {}
    for nnodes in (8, 512):
        store, controller, events = _job(tmp_path / str(nnodes), nnodes=nnodes, nproc=8)
        events.post(Report("exit", worker_id(3, False, 5), 3, 29, detail={"exitcode": -9}))
        controller.tick()
        state = json.loads(store.get(Keys.controller_state))
        sizes[nnodes] = len(json.dumps({k: v for k, v in state.items() if k not in ("spares", "record_nodes")}))
        assert state["members_moved"] == {} and state["members_unknown"] == [] and state["attached"] == []
    # Only the per-node facts (a spare each, which nodes have records) grow with the job; the rest is the same.
    assert abs(sizes[512] - sizes[8]) < 200, sizes
