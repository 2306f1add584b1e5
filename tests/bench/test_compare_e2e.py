"""The comparison benchmark's smallest configuration runs end to end, so the driver and job scripts do not rot.

The quick comparison with torchpass only, and each framework mode, on tiny models; no timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_quick_comparison_smallest(tmp_path: Path) -> None:
    overrides = [
        "workload.steps=6", "workload.d_model=64", "workload.layers=1", "workload.heads=2", "workload.vocab=512",
        "schedule.checkpoint_every=1", "schedule.min_gap_k=3", "schedule.max_gap_k=3", "schedule.tail_steps=2",
        "strategies=[torchpass]", "control_plane_sizes=[64]", "docs=false", f"out={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "bench.compare", "--quick", *overrides], cwd=REPO, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "quick" / "results.json").read_text())
    run = results["runs"]["torchpass"]
    assert run["faults"]["faults"] == 1
    assert run["faults"]["steps_recomputed"] == 0 and run["faults"]["samples_skipped"] == 0
    assert run["faults"]["recoveries"][0]["phases"]["transfer"] > 0
    assert results["transfer"]["loopback_GBps"] > 0
    assert (tmp_path / "quick" / "benchmark_quick.png").exists()
    assert "## Against the goals" in (tmp_path / "quick" / "benchmarks.md").read_text()


@pytest.mark.e2e
@pytest.mark.timeout(420)
@pytest.mark.parametrize("framework", ["deepspeed", "torchtitan"])
def test_framework_mode_smallest(tmp_path: Path, framework: str) -> None:
    """torchpass and the framework's own checkpoint restart, one fault each, on the smallest job.

    The fault is due after step 3, between the checkpoints of steps 2 and 4; on a loaded runner it can land in
    the save of step 4, which the DeepSpeed job commits only once every rank has written it (``save_committed``)."""
    overrides = [
        "workload.steps=6", "schedule.checkpoint_every=2", "schedule.min_gap_k=1.5", "schedule.max_gap_k=1.5",
        "schedule.tail_steps=2", "strategies=[torchpass,checkpoint]", "docs=false", f"out={tmp_path}",
    ]  # fmt: skip
    if framework == "deepspeed":
        # 2 ranks: the driver's paths are those of 4, at half the CPU on a 2-core runner (TorchTitan's
        # layouts are defined over 4).
        overrides += ["world_size=2", "workload.d_model=64", "workload.layers=1", "workload.heads=2", "workload.vocab=512"]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--config", framework, *overrides], cwd=REPO, capture_output=True, text=True, timeout=410
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((tmp_path / framework / "results.json").read_text())["runs"]
    assert set(runs) == {"torchpass", "checkpoint"}
    for name in ("torchpass", "checkpoint"):
        (recovery,) = runs[name]["faults"]["recoveries"]
        assert recovery["total_s"] is not None, (name, recovery)
        assert runs[name]["faults"]["samples_skipped"] == 0
    assert runs["torchpass"]["faults"]["recoveries"][0]["phases"]["transfer"] > 0
