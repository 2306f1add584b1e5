"""End to end: what node loss leaves behind. Node 0 gone: every process exits within the store bound. A
stopped node declared lost: its stale workers never join as ranks given away, and its agent fences itself.

Two launchers on this machine stand for two nodes (``--nnodes 2``), as in the
whole-node case of ``test_migration_e2e``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from torchpass.core.agent import NODE_LOST_EXIT
from torchpass.core.liveness import STORE_LOST_EXIT

from tests.support.harness import JOBS, assert_migrated, fault_free, launch

pytestmark = pytest.mark.e2e

STEPS = 30
JOB = JOBS / "jobs_ddp.py"
ARGS = ["--steps", str(STEPS), "--workdir", ".", "--step-sleep", "0.3"]
STORE_TIMEOUT_S = 6.0
"""Shorter than the default (30 s) so the test is quick; fast_detect's heartbeat timeout is 3 s."""
EXTRA = ["--set", f"store_timeout_s={STORE_TIMEOUT_S}"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_every_process_exits_within_the_bound_once_node_0_is_gone(tmp_path: Path, how: str) -> None:
    """SIGKILL node 0's launcher (store and controller), or SIGSTOP it with its workers (a frozen or cut-off host).

    Every process on node 1, and node 0's workers when their launcher died, exits
    within ``store_timeout_s`` (plus a few seconds of watchdog period and
    teardown): no worker is left holding its device for a job nobody runs.
    """
    run = launch(tmp_path, JOB, ARGS, nproc=2, nnodes=2, spares=1, extra=EXTRA)
    run.wait_step(2, 3)
    workers = run.workers()["workers"]
    node0 = [w["pid"] for w in workers if w["node"] == 0]
    node1 = [w["pid"] for w in workers if w["node"] == 1]
    launcher0, launcher1 = run.procs[0], run.procs[1]
    try:
        t0 = time.monotonic()
        if how == "sigkill":
            launcher0.kill()
            must_go = [*node0, *node1, launcher1.pid]
        else:
            _signal([launcher0.pid, *node0], signal.SIGSTOP)
            must_go = [*node1, launcher1.pid]
        bound = STORE_TIMEOUT_S + 10.0
        while any(_alive(p) for p in must_go) or launcher1.poll() is None:
            if time.monotonic() - t0 > bound:
                left = [p for p in must_go if _alive(p)]
                raise AssertionError(f"processes {left} still alive {bound:.0f} s after node 0 was lost:\n{run.explain()}")
            time.sleep(0.1)
        print(f"[node0-{how}] every process gone {time.monotonic() - t0:.2f} s after the fault")
        assert launcher1.returncode == STORE_LOST_EXIT, run.explain()
        assert "node 0 is gone" in run.output() or "lost the store" in run.output(), run.explain()
    finally:
        _signal([launcher0.pid, *node0], signal.SIGKILL)
        _signal([launcher0.pid, *node0], signal.SIGCONT)
        run.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fault_free(tmp_path_factory.mktemp("reference"), JOB, ARGS)


def test_a_stopped_node_declared_lost_fences_itself_when_it_runs_again(tmp_path: Path, reference: dict) -> None:
    """Node 1's launcher is SIGSTOPped (its workers run on): the controller declares the node lost.

    Its ranks go to node 0's spares; node 1's own workers, still alive, read the
    plan that gave their ranks away and exit instead of joining as those ranks
    (two processes as one gloo rank). Resumed, node 1's launcher finds the verdict,
    kills what it still has and exits. The job ends bitwise equal to the fault-free run.
    """
    run = launch(tmp_path, JOB, ARGS, nproc=2, nnodes=2, node_spares=[2, 1], extra=EXTRA)
    # Early: declaring the node lost takes the heartbeat timeout, and the job must still be training then.
    run.wait_step(2, 2)
    pids = run.active_pids()
    launcher1 = run.procs[1]
    node1 = [w["pid"] for w in run.workers()["workers"] if w["node"] == 1]
    os.kill(launcher1.pid, signal.SIGSTOP)
    try:
        run.wait_for_line("generation 1 is live", timeout=60)
        deadline = time.monotonic() + 30
        while any(_alive(pids[r]) for r in (2, 3)):
            assert time.monotonic() < deadline, f"node 1's replaced workers still run:\n{run.explain()}"
            time.sleep(0.1)
    finally:
        os.kill(launcher1.pid, signal.SIGCONT)
    assert launcher1.wait(30) == NODE_LOST_EXIT, run.explain()
    assert not any(_alive(p) for p in node1), "node 1's launcher left a worker behind"
    last = assert_migrated(run, reference, pids, {2, 3}, "node", max_steps_lost=0)
    assert sorted(last["failed_ranks"]) == [2, 3]
    assert "gave this rank to" in run.output(), run.explain()
    # Both launchers share the run dir: node 1's start must not have archived node 0's live ledger.
    assert not (run.run_dir / "previous").exists()
