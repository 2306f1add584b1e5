"""End to end against a real Slurm (slurmctld, two slurmd, munge): a drained node's ranks migrate, planned.

The job runs the way a Slurm user starts it: one ``srun`` over two Slurm nodes
starts ``torchpass launch`` on each, and each launcher takes its node count,
node rank and node 0's address from the step. An administrator's
``scontrol update nodename=... state=drain reason=...`` on the second node must
move its ranks to spares on the first while the job trains on: bitwise equal to
the fault-free run, survivors' PIDs unchanged, the ledger's cause
``slurm-drain`` with Slurm's reason, the drained node's spares retired and its
launcher gone with exit code 0.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Iterator

import pytest

from torchpass.core.node_signals import NodeSignal
from torchpass.core.slurm import SlurmDrainSource, node_address, slurm_placement

from tests.support.harness import JOBS, assert_migrated, fault_free, fault_rng, launch
from tests.support.slurm import SlurmCluster, start_cluster

pytestmark = pytest.mark.e2e

NODES = ["tpnode-a", "tpnode-b"]
STEPS = 24
JOB = JOBS / "jobs_ddp.py"
ARGS = ["--steps", str(STEPS), "--workdir", ".", "--step-sleep", "0.2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    c = start_cluster(tmp_path_factory.mktemp("slurm"), NODES)
    yield c
    c.stop()


@pytest.fixture
def clean(cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """The cluster with every node in service, and this process a client of it."""
    cluster.resume_all()
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    return cluster


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fault_free(tmp_path_factory.mktemp("reference"), JOB, ARGS, nproc=2, nnodes=2, spares=0)


def test_the_source_reads_drain_fail_and_an_upcoming_maintenance_from_slurmctld(clean: SlurmCluster) -> None:
    a, b = (SlurmDrainSource(n, maint_lead_s=900) for n in NODES)
    assert a.poll() == [] and b.poll() == []
    clean.run("scontrol", "update", f"nodename={NODES[1]}", "state=drain", "reason=ECC errors on DIMM 3")
    assert b.poll() == [NodeSignal("slurm-drain", "ECC errors on DIMM 3", {"node": NODES[1], "state": "drain+idle"})]
    assert a.poll() == []
    clean.run("scontrol", "update", f"nodename={NODES[0]}", "state=fail", "reason=fan failure")
    ((cause, reason),) = [(s.cause, s.reason) for s in a.poll()]
    assert (cause, reason) == ("slurm-fail", "fan failure")
    clean.resume_all()
    start = (datetime.now() + timedelta(minutes=10)).strftime("%Y-%m-%dT%H:%M:%S")
    clean.run(
        "scontrol", "create", "reservation", "reservationname=firmware", "flags=maint", f"nodes={NODES[0]}",
        f"starttime={start}", "duration=30", "user=root",
    )  # fmt: skip
    (found,) = a.poll()
    assert found.cause == "slurm-maint" and found.detail["reservation"] == "firmware", found
    assert SlurmDrainSource(NODES[0], maint_lead_s=60).poll() == []  # ten minutes away: not yet for a 1-minute lead
    assert b.poll() == []


def test_a_node_slurm_does_not_know_is_an_error_naming_it(clean: SlurmCluster) -> None:
    with pytest.raises(RuntimeError, match="does not know node 'no-such-node'"):
        SlurmDrainSource("no-such-node", maint_lead_s=0).poll()


def test_srun_gives_every_launcher_its_placement(clean: SlurmCluster) -> None:
    code = "from torchpass.core.slurm import slurm_placement as p; print(p())"
    out = clean.run("srun", "--nodes=2", "--ntasks-per-node=1", "--label", "python3", "-c", code, timeout=60)
    lines = sorted(line.split(": ", 1) for line in out.splitlines())
    addr = node_address(NODES[0])
    assert [text for _, text in lines] == [
        f"SlurmPlacement(nnodes=2, node_rank={i}, master_addr='{addr}')" for i in range(2)
    ], out
    assert slurm_placement({}) is None  # outside a step (or in sbatch's batch script alone): the flags decide


def test_drained_node_migrates_its_ranks_planned(tmp_path: Path, clean: SlurmCluster, reference: dict) -> None:
    step = fault_rng("slurm-drain").randint(4, STEPS - 8)
    srun = ["srun", "--nodes=2", "--ntasks-per-node=1", f"--nodelist={','.join(NODES)}", "--kill-on-bad-exit=0"]
    run = launch(
        tmp_path, JOB, ARGS, nproc=2, nnodes=2, spares=2, srun=srun, env=clean.env,
        extra=["--set", "signals.poll_interval_s=0.5"],
    )  # fmt: skip
    run.wait_step(2, step)
    pids = run.active_pids()
    spares_b = [w["wid"] for w in run.workers()["workers"] if w["role"] == "spare" and w["node"] == 1]
    clean.run("scontrol", "update", f"nodename={NODES[1]}", "state=drain", "reason=torchpass test: bad DIMM")
    last = assert_migrated(run, reference, pids, {2, 3}, "slurm-drain", max_steps_lost=0)
    assert sorted(last["failed_ranks"]) == [2, 3]
    assert last["trigger"]["reason"] == "torchpass test: bad DIMM", last
    assert last["trigger"]["trigger"]["node"] == NODES[1]
    # The drained node's spares were retired (never given a rank), and its launcher left on its own, cleanly.
    roles = {w["wid"]: w["role"] for w in run.workers()["workers"]}
    assert spares_b and all(roles[w] == "retired" for w in spares_b), roles
    assert all(w.startswith("n0-") for w in last["replaced"].values()), last["replaced"]
    out = run.output()
    assert "slurm: torchpass test: bad DIMM: draining this node's ranks" in out and "node drained" in out, run.explain()
