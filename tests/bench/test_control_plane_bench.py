"""The control-plane benchmark's smallest configuration runs end to end (no timing asserted)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from bench.control_plane import barrier_peers, gloo_record_bytes, markdown, measure, rendezvous_key
from torchpass.core.free_port import free_port
from torchpass.core.rendezvous_store import worker_environment

from tests.support.recording_store import RecordingStore


def test_one_migration_at_64_ranks() -> None:
    row = measure(64, free_port())
    assert row["ranks"] == 64
    assert row["plan_bytes"] > 0
    assert 0 < row["controller_critical_s"] <= row["detect_s"] + row["plan_s"] + row["go_s"]
    assert row["critical_s"] == row["controller_critical_s"] + row["rendezvous_s"] + row["routing_s"]
    # Reading whole generations goes through batched requests: a handful of operations per phase.
    assert row["total_ops"] < 100
    # A member's buddy routing reads the job record, the plan and its target's record: no peer's but one.
    assert row["routing_ops"] < 10
    # One record written, and per peer of the barrier (11 at 64 ranks) the same few requests: gloo's wait
    # (the interruptible store's probe: a check and a read of the sealed value) and its read.
    assert row["rendezvous_ops"] == 1 + 3 * len(barrier_peers(0, 64))
    assert "| 64 |" in markdown([row])


def test_the_barrier_peers_are_those_of_gloos_dissemination_barrier() -> None:
    assert barrier_peers(4, 8) == [3, 5, 2, 6, 0]
    assert barrier_peers(0, 3) == [2, 1]
    assert len(barrier_peers(0, 16384)) == 27  # +-1 ... +-4096, and 8192 once


def test_the_simulated_rendezvous_is_the_one_gloo_does() -> None:
    """What the bench replays for a member (write its record, then wait for and read the records of the barrier's
    peers in gloo's order, at gloo's record size) is what a ``ProcessGroupGloo`` built in the workers' environment
    asks of its store, from its construction to the end of the barrier the migration runs after the rebuild."""
    size = 8
    env = worker_environment({})
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    stores = [RecordingStore(dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30))) for _ in range(size)]

    def member(r: int) -> None:
        ProcessGroupGloo(stores[r], r, size, timedelta(seconds=30)).barrier().wait()

    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    record = gloo_record_bytes(size, env)
    for r in range(size):
        reads = [step for p in barrier_peers(r, size) for step in (("wait", rendezvous_key(p), 0), ("get", rendezvous_key(p), record))]
        assert stores[r].log == [("set", rendezvous_key(r), record), *reads], r
