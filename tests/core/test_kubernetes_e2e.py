"""End to end: a cordon, a taint and a pod deletion in Kubernetes each move a node's ranks, planned.

Contract-tested: the launchers' official ``kubernetes`` client talks to the API
subset of ``tests/support/kube_api.py`` (list and watch with resource versions
and bookmarks), not to a cluster. Four launchers stand for four Kubernetes
nodes (``NODE_NAME``, as the downward API sets it), one rank each, node 0 with
three spares. The test cordons node 1, taints node 2 with the cluster
autoscaler's mark, and deletes the job's pod on node 3 with a grace period:
each node's rank moves to a spare on node 0 while the job trains on, bitwise
equal to the fault-free run, rank 0 keeps its process, each ledger entry has
the signal's cause.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("kubernetes")

from tests.support.harness import JOBS, JobRun, assert_migrated, fault_free, launch  # noqa: E402
from tests.support.kube_api import KubeApi  # noqa: E402

pytestmark = pytest.mark.e2e

STEPS = 36
JOB = JOBS / "jobs_ddp.py"
ARGS = ["--steps", str(STEPS), "--workdir", ".", "--step-sleep", "0.2"]
NODES = [f"k8s-node-{i}" for i in range(4)]


def _wait_migrations(run: JobRun, n: int, timeout: float = 90.0) -> None:
    deadline = time.time() + timeout
    while len([m for m in run.migrations() if m["outcome"] == "success"]) < n:
        assert time.time() < deadline and run.procs[0].poll() is None, run.explain()
        time.sleep(0.05)


def test_cordon_taint_and_pod_deletion_each_move_a_node(tmp_path: Path) -> None:
    reference = fault_free(tmp_path / "reference", JOB, ARGS, nproc=1, nnodes=4, spares=0)
    api = KubeApi()
    try:
        for i, node in enumerate(NODES):
            api.add_node(node)
            api.add_pod("training", f"llm-worker-{i}", node, {"job": "llm"})
        kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
        extra = ["--set", "signals.k8s=required", "--set", f"signals.k8s_kubeconfig={kubeconfig}", "--set", "signals.k8s_namespace=training",
                 "--set", "signals.k8s_pod_selector=job=llm", "--set", "signals.poll_interval_s=0.2"]  # fmt: skip
        run = launch(
            tmp_path / "job", JOB, ARGS, nproc=1, nnodes=4, node_spares=[3, 0, 0, 0], extra=extra,
            node_env=[{"NODE_NAME": node} for node in NODES],
        )  # fmt: skip
        run.wait_step(0, 4)
        pids = run.active_pids()
        api.cordon(NODES[1])
        _wait_migrations(run, 1)
        api.taint(NODES[2], "ToBeDeletedByClusterAutoscaler", "1796330000", "NoSchedule")
        _wait_migrations(run, 2)
        api.delete_pod("training", "llm-worker-3", 30)
        _wait_migrations(run, 3)
        assert_migrated(run, reference, pids, {1, 2, 3}, "k8s-pod-deletion", max_steps_lost=0)
    finally:
        api.stop()
    done = [m for m in run.migrations() if m["outcome"] == "success"]
    assert [(m["cause"], m["failed_ranks"]) for m in done] == [("k8s-cordon", [1]), ("k8s-taint", [2]), ("k8s-pod-deletion", [3])]
    assert done[1]["trigger"]["trigger"]["taint"] == "ToBeDeletedByClusterAutoscaler=1796330000:NoSchedule"
    assert done[2]["trigger"]["trigger"]["pod"] == "training/llm-worker-3"
    assert run.output().count("node drained") == 3, run.explain()
