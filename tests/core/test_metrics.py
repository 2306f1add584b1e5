"""The job's Prometheus metrics: ledger events counted as ``torchpass report`` counts them, served over HTTP."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from torchpass.core.free_port import free_port
from torchpass.core.ledger import DISQUALIFYING, QUALIFYING, JobEvent, MigrationEvent
from torchpass.core.metrics import JobMetrics


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text) for s in family.samples
    }


def _migration(outcome: str, cause: str = "kill", classification: str = QUALIFYING, **kw) -> MigrationEvent:
    return MigrationEvent(generation=1, cause=cause, classification=classification, outcome=outcome, **kw)


def test_ledger_events_become_counters_a_ratio_and_a_phase_histogram() -> None:
    metrics = JobMetrics()
    metrics.on_event(JobEvent("job_start", "4 ranks"))
    metrics.on_event(_migration("superseded"))
    metrics.on_event(_migration("success", timings={"detect": 0.02, "transfer": 0.3, "total": 0.7}, bytes_moved=1000, steps_lost=1))
    metrics.on_event(_migration("failed", cause="node"))
    metrics.on_event(_migration("failed", cause="kill", classification=DISQUALIFYING))
    port = free_port()
    metrics.serve("127.0.0.1", port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        got = _samples(resp.read().decode())
    kill = (("cause", "kill"), ("classification", QUALIFYING))
    assert got[("torchpass_migrations_total", (*kill, ("outcome", "superseded")))] == 1
    assert got[("torchpass_migrations_total", (*kill, ("outcome", "success")))] == 1
    assert got[("torchpass_migrations_total", (("cause", "node"), ("classification", QUALIFYING), ("outcome", "failed")))] == 1
    # One of two qualifying incidents succeeded (the superseded attempt is part of its incident; the
    # disqualifying one does not count), as `torchpass report` computes it.
    assert got[("torchpass_migration_success_ratio", ())] == 0.5
    assert got[("torchpass_recovery_seconds_count", (("phase", "total"),))] == 1
    assert got[("torchpass_recovery_seconds_sum", (("phase", "transfer"),))] == 0.3
    assert got[("torchpass_recovery_seconds_bucket", (("le", "0.5"), ("phase", "total")))] == 0
    assert got[("torchpass_recovery_seconds_bucket", (("le", "1.0"), ("phase", "total")))] == 1
    assert got[("torchpass_state_moved_bytes_total", ())] == 1000
    assert got[("torchpass_steps_lost_total", ())] == 1


def test_the_step_period_is_the_time_between_two_observed_steps_over_the_steps_between() -> None:
    metrics = JobMetrics()
    metrics._observe_step(10, 100.0)
    metrics._observe_step(10, 100.5)
    metrics._observe_step(14, 102.0)
    read = metrics.registry.get_sample_value
    assert read("torchpass_step") == 14 and read("torchpass_step_seconds") == 0.5
