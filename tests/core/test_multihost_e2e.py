"""End to end across real network boundaries: 3 hosts in network namespaces, each with its own address,
one launcher each, 2 ranks + 1 spare per host, node 0's TCPStore on host 0.

Faults only a network produces: every process of a host killed (the machine lost power), a host's link taken
down (its NIC failed), and that link brought back after the migration (the cut-off host's processes must be
fenced, never rejoin as ranks spares took); and node 0's host lost, which must end every process on every
host within the store bound.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.harness import JOBS, assert_migrated, fault_free, launch
from tests.support.netns import Hosts, usable

why_not = usable()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(why_not is not None, reason=f"no network namespaces here: {why_not}")]

STEPS = 24
JOB = JOBS / "jobs_ddp.py"
ARGS = ["--steps", str(STEPS), "--workdir", ".", "--step-sleep", "0.3"]
STORE_TIMEOUT_S = 6.0
EXTRA = ["--set", f"store_timeout_s={STORE_TIMEOUT_S}"]
SHAPE = {"nproc": 2, "spares": 1, "nnodes": 3}


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    h = Hosts(3).up()
    yield h
    h.down()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    h = Hosts(3).up()
    try:
        return fault_free(tmp_path_factory.mktemp("reference"), JOB, ARGS, hosts=h, extra=EXTRA, **SHAPE)
    finally:
        h.down()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _ranks_on(run, node: int) -> dict[int, int]:
    return {w["rank"]: w["pid"] for w in run.workers()["workers"] if w["node"] == node and w["role"] == "active"}


def test_a_whole_host_lost_moves_its_ranks_to_spares_on_the_others(tmp_path: Path, hosts: Hosts, reference: dict) -> None:
    run = launch(tmp_path, JOB, ARGS, hosts=hosts, extra=EXTRA, **SHAPE)
    run.wait_step(4, 5)
    pids = run.active_pids()
    lost = _ranks_on(run, 2)
    hosts.kill_all(2)
    last = assert_migrated(run, reference, pids, set(lost), "node", 0)
    assert set(last["failed_ranks"]) == set(lost)


def test_a_host_cut_off_is_migrated_and_fenced_when_its_link_comes_back(tmp_path: Path, hosts: Hosts, reference: dict) -> None:
    run = launch(tmp_path, JOB, ARGS, hosts=hosts, extra=EXTRA, **SHAPE)
    run.wait_step(2, 5)
    pids = run.active_pids()
    cut = _ranks_on(run, 1)
    t0 = time.monotonic()
    hosts.link(1, up=False)
    # The migration completes without host 1: its ranks run in spares on hosts 0 and 2.
    deadline = time.monotonic() + 60
    while not any(m["outcome"] == "success" for m in run.migrations()):
        assert time.monotonic() < deadline, run.explain()
        time.sleep(0.2)
    print(f"[link-down] migrated {time.monotonic() - t0:.2f} s after the link went down")
    hosts.link(1, up=True)  # the partition heals: host 1's old processes must not come back as those ranks
    last = assert_migrated(run, reference, pids, set(cut), "node", 0)
    assert set(map(int, last["replaced"])) == set(cut)
    assert not any(_alive(p) for p in cut.values()), "a cut-off worker outlived the job"


def test_losing_node_0s_host_ends_every_process_on_every_host_within_the_bound(tmp_path: Path, hosts: Hosts) -> None:
    run = launch(tmp_path, JOB, ARGS, hosts=hosts, extra=EXTRA, **SHAPE)
    run.wait_step(2, 3)
    others = [p for i in (1, 2) for p in hosts.pids(i)]
    t0 = time.monotonic()
    hosts.kill_all(0)
    bound = STORE_TIMEOUT_S + 10.0
    while any(_alive(p) for p in others):
        if time.monotonic() - t0 > bound:
            raise AssertionError(f"{[p for p in others if _alive(p)]} alive {bound:.0f} s after host 0 was lost:\n{run.explain()}")
        time.sleep(0.1)
    print(f"[host0-lost] every process on hosts 1 and 2 gone {time.monotonic() - t0:.2f} s after the fault")
    for proc in run.procs[1:]:
        assert proc.wait(timeout=5) != 0
