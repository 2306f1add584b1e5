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


def _step_cost(warm: dict[str, float] | None) -> dict:
    run = {
        "median_period_s": {"torchpass": 0.050, "torchrun": 0.040},
        "period_ratio": 1.25,
        "median_period_s_warm": warm,
        "period_ratio_warm": warm and warm["torchpass"] / warm["torchrun"],
        "first_step_spares_ready": [160],
        "critical_path_us": 900,
        "critical_path_sections_us": {"step_begin": 500, "backward": 400},
    }
    return {"steps": 500, "rounds": 1, "runs": {"tutorial zero0": run}}


def test_the_per_step_cost_is_judged_on_the_steps_after_the_spare_was_ready_with_the_whole_run_beside_it() -> None:
    met = step_cost_rows(_step_cost({"torchpass": 0.0401, "torchrun": 0.040}))[0]
    assert met.met and "ready (160)" in met.measured and "all steps" in met.measured and "1.250 x" in met.measured
    missed = step_cost_rows(_step_cost({"torchpass": 0.045, "torchrun": 0.040}))[0]
    assert missed.met is False


def test_without_a_step_run_with_the_spare_ready_the_whole_run_decides() -> None:
    row = step_cost_rows(_step_cost(None))[0]
    assert row.met is False and "no step ran with the spare ready" in row.measured
