"""bench/goals.py: a goal is met, missed, or not measured, never met by default."""

from __future__ import annotations

from bench.goals import _recovery_row, control_rows, page, step_cost_rows, transfer_rows


def test_a_benchmark_that_did_not_run_is_not_measured() -> None:
    rows = [*step_cost_rows(None), *transfer_rows(None), *control_rows(None)]
    assert rows and all(r.met is None for r in rows)
    assert "0 of 0 measured goals met" in page(rows)


def test_the_recovery_bound_is_bytes_over_loopback_plus_a_step_plus_half_a_second() -> None:
    assert _recovery_row("job", 1.49, 2_000_000_000, 2.0, 0.0).met  # 1.0 + 0 + 0.5
    assert not _recovery_row("job", 1.51, 2_000_000_000, 2.0, 0.0).met


def test_transfer_goal_uses_the_migration_path_ratio() -> None:
    rows = transfer_rows({"30": {"fetch_GBps": 2.0, "loopback_tcp_GBps": 2.6, "ratio": 0.77, "cold_ratio": 0.9}})
    assert rows[0].met is False
