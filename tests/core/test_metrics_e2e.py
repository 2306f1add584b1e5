"""End to end with a real Prometheus scraping the job: a migration is seen as it happens, with its phases.

The job serves ``/metrics`` from node 0's launcher (``--set metrics.port=...``);
Prometheus 2.42 scrapes it every second. SIGKILLed ranks migrate (bitwise, as
everywhere) and Prometheus' own query API shows each migration by cause and
outcome, the success ratio, the recovery phases, the spares left and the step, after each of two migrations.
``torchpass report --plot`` then draws the run, and the picture is read back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torchpass.core.free_port import free_port

from tests.support.harness import JOBS, assert_migrated, fault_free, fault_rng, launch
from tests.support.prometheus import start_prometheus

pytestmark = pytest.mark.e2e

STEPS = 40
JOB = JOBS / "jobs_ddp.py"
ARGS = ["--steps", str(STEPS), "--workdir", ".", "--step-sleep", "0.2"]


def test_prometheus_sees_the_migrations(tmp_path: Path) -> None:
    reference = fault_free(tmp_path / "reference", JOB, ARGS, nproc=2, spares=0)
    port = free_port()
    prometheus = start_prometheus(tmp_path / "prometheus", [f"127.0.0.1:{port}"])
    try:
        rng = fault_rng("metrics")
        faults = [(rng.randrange(2), rng.randint(4, 8)), (rng.randrange(2), rng.randint(16, 22))]
        run = launch(tmp_path / "job", JOB, ARGS, nproc=2, spares=2, extra=["--set", f"metrics.port={port}"])
        prometheus.wait_value('up{job="torchpass"}', 1)
        prometheus.wait_value("torchpass_spares_free", 2)
        pids = None
        for n, (rank, step) in enumerate(faults, 1):
            run.wait_step(rank, step)
            pids = pids or run.active_pids()
            run.inject("kill", rank=rank)
            # Seen by Prometheus while the job runs: the counts, the success rate, the phase histogram, the spares.
            prometheus.wait_value('torchpass_migrations_total{cause="kill",classification="qualifying",outcome="success"}', n)
            prometheus.wait_value("torchpass_migration_success_ratio", 1)
            prometheus.wait_value('torchpass_recovery_seconds_count{phase="total"}', n)
            prometheus.wait_any(f'torchpass_recovery_seconds_bucket{{phase="total",le="+Inf"}} == {n}')
            prometheus.wait_value("torchpass_spares_free", 2 - n)
            prometheus.wait_value("torchpass_generation", n)
            prometheus.wait_any(f"torchpass_step >= {step}")
        assert_migrated(run, reference, pids, {rank for rank, _ in faults}, "kill", max_steps_lost=0)
    finally:
        prometheus.stop()
    _check_plot(run.run_dir, tmp_path / "timeline.png", faults[-1][1])


def _check_plot(run_dir: Path, png: Path, last_fault_step: int) -> None:
    """``torchpass report --plot``: a PNG of the expected size, read back, showing the migration's phase bands."""
    import matplotlib.image

    from torchpass.core.report_plot import PHASE_COLORS

    done = subprocess.run(
        [sys.executable, "-m", "torchpass.core.cli", "report", "--run-dir", str(run_dir), "--plot", str(png)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert png.stat().st_size > 20_000
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[:2] == (550, 1000)  # figsize 10 x 5.5 in at 100 dpi
    colors = {tuple((pixels[y, x, :3] * 255).round().astype(int)) for y in range(0, 550, 2) for x in range(0, 1000, 2)}
    # The migration's longest phase is a band drawn at alpha 0.6 over white (the legend's patches are opaque):
    # that blend must be in the picture.
    migration = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if '"migration"' in line][0]
    phase = max(PHASE_COLORS, key=lambda p: migration["timings"].get(p, 0.0))
    band = tuple(int(round(0.6 * int(PHASE_COLORS[phase][i : i + 2], 16) + 0.4 * 255)) for i in (1, 3, 5))
    assert any(all(abs(a - b) <= 2 for a, b in zip(c, band)) for c in colors), f"no {phase} band ({band}) in the plot"
    samples = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    # The last sample is taken as the job ends, from rank 0's last heartbeat (which may trail the last step by
    # a heartbeat interval): after both migrations, at least at the second fault's step.
    assert samples[-1]["generation"] == 2 and samples[-1]["step"] >= last_fault_step, samples
