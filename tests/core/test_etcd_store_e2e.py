"""End to end on an etcd store: ``torchpass launch --store etcd://...`` runs the control plane on a real 3-member
etcd cluster; a SIGKILLed rank and an operator's planned migration (on a cluster with authentication on) end
bitwise identical to the fault-free run (on node 0's TCPStore), the job's keys are gone from etcd at its end, and
misuse is refused by name."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from torchpass.core import cli, launcher
from torchpass.core.etcd_store import EtcdStore, job_url, parse_etcd_url
from torchpass.core.inject import request_migration

from tests.support.etcd import ETCD, EtcdCluster, auth_cluster
from tests.support.harness import JOBS, assert_migrated, fault_free, fault_rng, launch

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(ETCD is None, reason="etcd is not installed here (.ci/run installs etcd-server)")]

STEPS = 16
JOB = JOBS / "jobs_ddp.py"
ARGS = ["--steps", str(STEPS), "--workdir", ".", "--step-sleep", "0.2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    c = EtcdCluster(tmp_path_factory.mktemp("etcd")).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fault_free(tmp_path_factory.mktemp("reference"), JOB, ARGS)


def _job_keys(cluster: EtcdCluster, job: str) -> int:
    return EtcdStore(parse_etcd_url(job_url(cluster.url, job))).num_keys()


def test_sigkill_on_an_etcd_control_plane(tmp_path: Path, cluster: EtcdCluster, reference: dict) -> None:
    rng = fault_rng("etcd-sigkill")
    rank, step = rng.randrange(4), rng.randint(3, STEPS - 4)
    job = f"e2e-{uuid.uuid4().hex[:8]}"
    run = launch(tmp_path, JOB, ARGS, extra=["--store", cluster.url, "--rdzv-id", job])
    run.wait_step(rank, step)
    assert _job_keys(cluster, job) > 0  # the control plane is in etcd
    assert json.loads((run.run_dir / "workers.json").read_text())["store_etcd"] == job_url(cluster.url, job)
    pids = run.active_pids()
    run.inject("kill", rank=rank)
    last = assert_migrated(run, reference, pids, {rank}, "kill", 0)
    assert last["failed_ranks"] == [rank]
    assert _job_keys(cluster, job) == 0  # node 0 deleted the job's keys at its end


def test_an_operators_planned_migration_goes_through_etcd_with_authentication(tmp_path: Path, reference: dict) -> None:
    """On a cluster that authenticates its users, the job's launchers, workers and the operator's tool log in as the
    URL's user with the password in its file."""
    job = f"e2e-{uuid.uuid4().hex[:8]}"
    (tmp_path / "etcd").mkdir()
    cluster = auth_cluster(tmp_path / "etcd")
    try:
        _planned_migration(tmp_path / "job", cluster.user_url(tmp_path / "etcd" / "password"), job, reference)
    finally:
        cluster.stop()


def _planned_migration(tmp_path: Path, url: str, job: str, reference: dict) -> None:
    run = launch(tmp_path, JOB, ARGS, extra=["--store", url, "--rdzv-id", job])
    run.wait_step(1, 5)
    pids = run.active_pids()
    request_migration(run.run_dir, 1)  # reads the store's URL from workers.json, like `torchpass migrate`
    assert_migrated(run, reference, pids, {1}, "planned", 0)


def test_a_job_id_whose_keys_are_still_there_is_refused(tmp_path: Path, cluster: EtcdCluster, capsys) -> None:
    job = f"stale-{uuid.uuid4().hex[:8]}"
    EtcdStore(parse_etcd_url(job_url(cluster.url, job))).set("left/behind", b"x")  # a crashed job's keys
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    args = cli._parser().parse_args(["launch", "--standalone", "--store", cluster.url, "--rdzv-id", job, "--run-dir", str(tmp_path / "run"), str(script)])
    assert launcher.launch(args) == 2
    err = capsys.readouterr().err
    assert "already holds a job's keys (--rdzv-id " + job in err and f"etcdctl del --prefix /torchpass/{job}/" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written
