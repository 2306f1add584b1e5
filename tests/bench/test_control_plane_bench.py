"""The control-plane benchmark's smallest configuration runs end to end (no timing asserted)."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from bench.control_plane import gloo_record_bytes, markdown, measure, rendezvous_key
from torchpass.core.free_port import free_port
from torchpass.core.rendezvous_store import RANK_AS_SEQUENCE_ENV

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
    assert row["rendezvous_ops"] > 64, "gloo's full-mesh rendezvous reads every member's record"
    assert "| 64 |" in markdown([row])


@pytest.mark.parametrize("rank_as_sequence", ["0", "1"])
def test_the_simulated_rendezvous_is_the_one_gloo_does(rank_as_sequence: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the bench replays for a member (write its record, then wait for and read every record in rank order,
    at gloo's record size) is what ``ProcessGroupGloo`` asks of its store, with or without the workers' environment."""
    monkeypatch.setenv(RANK_AS_SEQUENCE_ENV, rank_as_sequence)
    size = 3
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    stores = [RecordingStore(dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30))) for _ in range(size)]
    threads = [threading.Thread(target=ProcessGroupGloo, args=(stores[r], r, size, timedelta(seconds=30))) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    record = gloo_record_bytes(size, os.environ)
    reads = [step for r in range(size) for step in (("wait", rendezvous_key(r), 0), ("get", rendezvous_key(r), record))]
    assert stores[1].log == [("set", rendezvous_key(1), record), *reads]
