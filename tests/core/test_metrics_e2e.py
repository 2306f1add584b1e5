"""End to end with a real Prometheus scraping the job: a migration is seen as it happens, with its phases.

The job serves ``/metrics`` from node 0's launcher (``--set metrics.port=...``);
Prometheus 2.42 scrapes it every second. A SIGKILLed rank migrates (bitwise, as
everywhere) and Prometheus' own query API shows the migration by cause and
outcome, the success ratio, the recovery phases, the spares left and the step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torchpass.core.free_port import free_port

from tests.support.harness import JOBS, assert_migrated, fault_free, fault_rng, launch
from tests.support.prometheus import start_prometheus

pytestmark = pytest.mark.e2e

STEPS = 40
JOB = JOBS / "jobs_ddp.py"
ARGS = ["--steps", str(STEPS), "--workdir", ".", "--step-sleep", "0.2"]


def test_prometheus_sees_the_migration(tmp_path: Path) -> None:
    reference = fault_free(tmp_path / "reference", JOB, ARGS, nproc=2, spares=0)
    port = free_port()
    prometheus = start_prometheus(tmp_path / "prometheus", [f"127.0.0.1:{port}"])
    try:
        rng = fault_rng("metrics")
        rank, step = rng.randrange(2), rng.randint(4, 10)
        run = launch(tmp_path / "job", JOB, ARGS, nproc=2, spares=1, extra=["--set", f"metrics.port={port}"])
        prometheus.wait_value('up{job="torchpass"}', 1)
        prometheus.wait_value("torchpass_spares_free", 1)
        run.wait_step(rank, step)
        pids = run.active_pids()
        run.inject("kill", rank=rank)
        prometheus.wait_value('torchpass_migrations_total{cause="kill",classification="qualifying",outcome="success"}', 1)
        prometheus.wait_value("torchpass_migration_success_ratio", 1)
        prometheus.wait_value('torchpass_recovery_seconds_count{phase="total"}', 1)
        prometheus.wait_value("torchpass_spares_free", 0)
        prometheus.wait_value("torchpass_generation", 1)
        assert float(prometheus.query("torchpass_step")[0]["value"][1]) >= step
        assert_migrated(run, reference, pids, {rank}, "kill", max_steps_lost=0)
    finally:
        prometheus.stop()
