"""The runtime's timers: per-section time over counted step periods only."""

from __future__ import annotations

from pathlib import Path

from torchpass.core.critical_path import CriticalPathTimers, read_summaries

from tests.support.clock import ManualClock


def test_sections_are_averaged_over_the_periods_that_follow_each_other() -> None:
    clock = ManualClock()
    timers = CriticalPathTimers(clock)
    for step in (1, 2, 3):
        timers.step_started(0, step, clock.now)
        started = clock.now
        clock.now += 0.001
        timers.add("step_begin", started)
        clock.now += 0.099
    # A migration: generation 1 resumes at step 3; the recovery is not a step period.
    clock.now += 5.0
    timers.step_started(1, 3, clock.now)
    summary = timers.summary(rank=2)
    assert summary.steps == 2
    assert abs(summary.step_s - 0.1) < 1e-9
    assert abs(summary.per_step_us["step_begin"] - 1000) < 1e-6
    assert abs(summary.fraction - 0.01) < 1e-9


def test_summaries_are_written_whole_and_read_back(tmp_path: Path) -> None:
    timers = CriticalPathTimers()
    timers.step_started(0, 1, 0.0)
    timers.step_started(0, 2, 0.5)
    timers.write(tmp_path, 3, extra={"buddy": {"copied_bytes": 10}})
    timers.write(tmp_path, 0)
    read = read_summaries(tmp_path)
    assert [s.rank for s in read] == [0, 3] and read[1].extra == {"buddy": {"copied_bytes": 10}}
    assert not list((tmp_path / "timers").glob("*.tmp"))
