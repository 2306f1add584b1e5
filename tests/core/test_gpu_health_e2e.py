"""End to end: NVML's signs of a failing GPU move the rank on it, planned, before it fails.

The launcher watches its slots' GPUs through the NVML-shaped stand-in
(``tests/support/nvml_shaped/pynvml.py``, first on its ``PYTHONPATH``), whose
state the test edits. One job of 3 ranks and 5 spares receives, in turn: new
uncorrectable ECC errors on rank 0's GPU, a critical XID on rank 1's, the
temperature near slowdown on the GPU rank 0 moved to, and the loss of the GPU
rank 1 moved to; and the loss of a spare's GPU. Each rank moves to a spare by a
planned migration (cause ``pre-emptive``, the sign and its value in the
ledger), the failing spare leaves the pool, rank 2 keeps its process, and the
job ends bitwise equal to its fault-free run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support.harness import REPO, JOBS, JobRun, assert_migrated, fault_free, launch

pytestmark = pytest.mark.e2e

STEPS = 36
JOB = JOBS / "jobs_ddp.py"
ARGS = ["--steps", str(STEPS), "--workdir", ".", "--step-sleep", "0.2"]
NPROC, SPARES = 3, 5
SHAPED = REPO / "tests" / "support" / "nvml_shaped"


def _slot(run: JobRun, rank: int, generation: int) -> int:
    """The slot (LOCAL_RANK, GPU) of the process holding ``rank`` in ``generation``: actives n0-a<i>, spares n0-s<j>.

    ``workers.json`` is rewritten at the end of the controller's tick that wrote the ledger: wait for it."""
    deadline = time.time() + 30
    while (data := run.workers())["generation"] < generation:
        assert time.time() < deadline, data
        time.sleep(0.02)
    wid = next(w["wid"] for w in data["workers"] if w["role"] == "active" and w["rank"] == rank)
    kind, index = wid.split("-")[1][0], int(wid.split("-")[1][1:])
    return index if kind == "a" else NPROC + index


def _wait_migrations(run: JobRun, n: int, timeout: float = 90.0) -> None:
    deadline = time.time() + timeout
    while len([m for m in run.migrations() if m["outcome"] == "success"]) < n:
        assert time.time() < deadline and all(p.poll() is None for p in run.procs), run.explain()
        time.sleep(0.05)


def test_failing_gpus_move_their_ranks_planned(tmp_path: Path) -> None:
    reference = fault_free(tmp_path / "reference", JOB, ARGS, nproc=NPROC, spares=0)
    state = tmp_path / "nvml.json"
    gpus = [{"ecc": 0, "retired_pending": False, "remap": [0, 0, False, False], "temp": 45, "slowdown": 90, "lost": False, "xids": []}
            for _ in range(NPROC + SPARES)]  # fmt: skip

    def write_state() -> None:
        # Whole or not at all: the launcher's NVML watch reads this file while the test changes it.
        partial = state.with_suffix(".tmp")
        partial.write_text(json.dumps({"gpus": gpus}))
        partial.replace(state)

    def set_gpu(slot: int, **change) -> None:
        gpus[slot].update(change)
        write_state()

    write_state()
    env = {"PYTHONPATH": str(SHAPED), "TORCHPASS_TEST_NVML_STATE": str(state)}
    run = launch(tmp_path / "job", JOB, ARGS, nproc=NPROC, spares=SPARES, env=env, extra=["--set", "signals.poll_interval_s=0.2"])
    run.wait_step(0, 4)
    pids = run.active_pids()
    signs = [("ecc", 0, {"ecc": 2}), ("xid", 1, {"xids": [79]}), ("thermal", 0, {"temp": 87}), ("gpu-lost", 1, {"lost": True})]
    for i, (sign, rank, change) in enumerate(signs):
        if i == 2:
            # A spare's GPU fails too: it leaves the pool (the last migration still finds one spare).
            free = sorted(set(range(NPROC, NPROC + SPARES)) - {_slot(run, r, i) for r in range(NPROC)})
            set_gpu(free[-1], lost=True)
        set_gpu(_slot(run, rank, i), **change)
        _wait_migrations(run, i + 1)
    last = assert_migrated(run, reference, pids, {0, 1}, "pre-emptive", max_steps_lost=0)
    migrations = [m for m in run.migrations() if m["outcome"] == "success"]
    assert [(m["trigger"]["trigger"]["signal"], m["failed_ranks"]) for m in migrations] == [
        (sign, [rank]) for sign, rank, _ in signs
    ], migrations
    assert [m["trigger"]["trigger"]["value"] for m in migrations] == [2, 79, 87, 1]
    assert all(m["cause"] == "pre-emptive" and m["classification"] == "qualifying" for m in migrations)
    retired = [e for e in run.ledger() if e["type"] == "spare_retired"]
    assert len(retired) == 1 and "the GPU is lost" in retired[0]["message"], retired
    assert last["replaced"]
    assert "GPU health signals off" not in run.output()
