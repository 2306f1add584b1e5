"""The control-plane benchmark's smallest configuration runs end to end (no timing asserted)."""

from __future__ import annotations

import socket

from bench.control_plane import markdown, measure


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_migration_at_64_ranks() -> None:
    row = measure(64, _free_port())
    assert row["ranks"] == 64
    assert row["plan_bytes"] > 0
    assert 0 < row["critical_s"] <= row["detect_s"] + row["plan_s"] + row["go_s"]
    # Reading whole generations goes through batched requests: a handful of operations per phase.
    assert row["total_ops"] < 100
    assert "| 64 |" in markdown([row])
