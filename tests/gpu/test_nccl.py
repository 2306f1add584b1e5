"""NCCL inner groups on a real GPU: released by abort, rebuilt under the same Python group object.

Each check runs :mod:`tests.gpu.nccl_probe` in fresh processes (``comms.install`` patches c10d for the whole
process) and records its figures in ``$TORCHPASS_GPU_OUT`` when set (``tests/gpu/run.sh`` sets it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchpass.core.free_port import free_port

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs a CUDA device and a torch build with NCCL"
)

PROBE = Path(__file__).with_name("nccl_probe.py")
REPO = Path(__file__).resolve().parents[2]


def _record(name: str, figures: dict) -> None:
    print(name, json.dumps(figures))
    folder = os.environ.get("TORCHPASS_GPU_OUT")
    if folder:
        Path(folder, f"{name}.json").write_text(json.dumps(figures, indent=1))


def _probe(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(PROBE), *args], cwd=REPO, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("monitoring", ["default", "off"])
def test_world_of_one_aborts_and_rebuilds_under_the_same_group_object(tmp_path: Path, monitoring: str) -> None:
    """Timed twice: as torch starts it, and without the heartbeat monitor thread that abort joins."""
    out = tmp_path / "rebuild.json"
    proc = _probe("rebuild", str(free_port()), str(out), env={"TORCH_NCCL_ENABLE_MONITORING": "0"} if monitoring == "off" else {})
    assert proc.wait(timeout=240) == 0
    report = json.loads(out.read_text())
    _record(f"nccl_rebuild_monitoring_{monitoring}", report)
    assert report["same_group_object"] and report["new_inner_backend"]
    assert "aborted" in report["refused_after_release"]
    assert report["value_after_rebuild"] == 3.0
    assert report["generation"] == 1
    assert report["backend_name"] == "torchpass_nccl" and report["group_backend_name"] == "nccl"


def test_ddp_fsdp2_and_functional_collectives_run_on_across_a_rebuild(tmp_path: Path) -> None:
    out = tmp_path / "frameworks.json"
    proc = _probe("frameworks", str(free_port()), str(out))
    assert proc.wait(timeout=240) == 0
    report = json.loads(out.read_text())
    _record("nccl_frameworks", report)
    assert report["generation"] == 1 and report["mesh_group_is_rebuildable"]
    assert report["functional"] == [0.0, 1.0, 2.0, 3.0]
    digests = report["digests"]
    assert digests["ddp"] == digests["plain"] and digests["fsdp2"] == digests["plain"], digests


def _nccl_version() -> tuple[int, ...]:
    return tuple(torch.cuda.nccl.version()) if torch.cuda.is_available() and dist.is_nccl_available() else (0,)


@pytest.mark.skipif(_nccl_version() < (2, 30), reason=f"NCCL {_nccl_version()} has no NCCL_MULTI_RANK_GPU_ENABLE (2.30+)")
def test_a_sigstopped_peer_is_released_by_abort(tmp_path: Path) -> None:
    port = free_port()
    env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    out = [tmp_path / f"stuck{r}.json" for r in (0, 1)]
    procs = [_probe("stuck", str(port), str(out[r]), str(r), env=env) for r in (0, 1)]
    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=timedelta(seconds=120))
    try:
        store.wait(["ready/0", "ready/1"])
        os.kill(procs[1].pid, signal.SIGSTOP)
        time.sleep(0.2)
        store.set("stopped", "1")
        assert procs[0].wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    report = json.loads(out[0].read_text())
    _record("nccl_stuck_peer", report)
    assert report["freed_after_release_s"] < 30.0, report  # freed by the abort, not by NCCL's own timeout (60 s)
