"""End to end across real network boundaries: 3 hosts in network namespaces, each with its own address,
one launcher each, 2 ranks + 1 spare per host, node 0's TCPStore on host 0.

Faults only a network produces: every process of a host killed (the machine lost power), a host's link taken
down (its NIC failed), and that link brought back after the migration (the cut-off host's processes must be
fenced, never rejoin as ranks spares took); and node 0's host lost, which must end every process on every
host within the store bound.

On a 3-member etcd cluster on a fourth host of its own, node 0's host lost is a failure like any other: another
launcher takes the controller over and migrates node 0's ranks.
"""

from __future__ import annotations

import re
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from torchpass.core.etcd_store import EtcdStore, job_url, parse_etcd_url
from torchpass.core.ledger import read_ledger

from tests.support.etcd import ETCD, EtcdCluster
from tests.support.harness import JOBS, assert_bitwise, assert_migrated, fault_free, launch
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


@pytest.fixture(params=["tcp", "etcd"])
def cluster_hosts(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Hosts, list[str]]]:
    """Hosts 0-2 for the job and the launch options naming its store: node 0's TCPStore, or a 3-member etcd
    cluster on a host of its own (host 3)."""
    if request.param == "tcp":
        h = Hosts(3).up()
        try:
            yield h, EXTRA
        finally:
            h.down()
        return
    h, c = request.getfixturevalue("hosts_and_etcd")
    yield h, [*EXTRA, "--store", c.url, "--rdzv-id", f"ha-{uuid.uuid4().hex[:8]}", "--set", "controller_lease_s=2"]


def test_a_host_cut_off_is_migrated_and_fenced_when_its_link_comes_back(
    tmp_path: Path, cluster_hosts: tuple[Hosts, list[str]], reference: dict
) -> None:
    hosts, extra = cluster_hosts
    run = launch(tmp_path / "job", JOB, ARGS, hosts=hosts, extra=extra, **SHAPE)
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


METRICS_PORT = 9400
"""Every host has its own network stack, so the same port serves on whichever host runs the controller."""


def _metrics(addr: str) -> str:
    with urllib.request.urlopen(f"http://{addr}:{METRICS_PORT}/metrics", timeout=5) as r:
        return r.read().decode()


@pytest.fixture
def hosts_and_etcd(tmp_path: Path) -> Iterator[tuple[Hosts, EtcdCluster]]:
    """Hosts 0-2 for the job, host 3 for a 3-member etcd cluster."""
    if ETCD is None:
        pytest.skip("etcd is not installed here (.ci/run installs etcd-server)")
    h = Hosts(4).up()
    (tmp_path / "etcd").mkdir()
    c = EtcdCluster(tmp_path / "etcd", host=h.addrs[3], on_host=h.prefix(3))
    try:
        c.start()
        yield h, c
    finally:
        c.stop()
        h.down()


def test_on_etcd_the_controllers_host_lost_is_migrated_by_a_launcher_that_takes_over(
    tmp_path: Path, hosts_and_etcd: tuple[Hosts, EtcdCluster], reference: dict
) -> None:
    hosts, etcd = hosts_and_etcd
    job = f"ha-{uuid.uuid4().hex[:8]}"
    extra = [
        *EXTRA, "--store", etcd.url, "--rdzv-id", job, "--set", "controller_lease_s=2", "--set", f"metrics.port={METRICS_PORT}",
    ]  # fmt: skip
    run = launch(tmp_path / "job", JOB, ARGS, hosts=hosts, extra=extra, **SHAPE)
    run.wait_step(4, 5)
    assert "torchpass_" in _metrics(hosts.addrs[0])
    pids = run.active_pids()
    lost = _ranks_on(run, 0)
    t0 = time.monotonic()
    hosts.kill_all(0)  # node 0's launcher (the controller), its ranks and its spare
    run.lost_nodes.add(0)
    run.wait_for_line("takes the controller over", timeout=30)
    print(f"[controller-failover] a launcher took the controller over {time.monotonic() - t0:.2f} s after host 0 was lost")
    successor = int(re.search(r"node (\d) takes the controller over", run.output()).group(1))
    run.wait_for_line("metrics for Prometheus now at", timeout=10)
    assert "torchpass_migration" in _metrics(hosts.addrs[successor])  # the metrics moved with the controller
    last = assert_migrated(run, reference, pids, set(lost), "node", 0)
    assert set(last["failed_ranks"]) == set(lost)
    ledger = list(read_ledger(run.run_dir))
    assert len([e for e in ledger if "outcome" in e]) == 1, "one incident, one ledger entry"
    takeovers = [e for e in ledger if e.get("type") == "controller_takeover"]
    assert len(takeovers) == 1 and takeovers[0]["detail"]["node"] in (1, 2), takeovers
    assert EtcdStore(parse_etcd_url(job_url(etcd.url, job))).num_keys() == 0, "the last controller deletes the job's keys"
    print(f"[controller-failover] migration timings {last['timings']}")


def test_on_etcd_the_controllers_host_cut_off_steps_down_and_is_fenced_when_it_comes_back(
    tmp_path: Path, hosts_and_etcd: tuple[Hosts, EtcdCluster], reference: dict
) -> None:
    hosts, etcd = hosts_and_etcd
    extra = [*EXTRA, "--store", etcd.url, "--rdzv-id", f"ha-{uuid.uuid4().hex[:8]}", "--set", "controller_lease_s=2"]
    run = launch(tmp_path / "job", JOB, ARGS, hosts=hosts, extra=extra, **SHAPE)
    run.wait_step(2, 5)
    pids = run.active_pids()
    cut = _ranks_on(run, 0)
    t0 = time.monotonic()
    hosts.link(0, up=False)  # the controller's host: alive, but neither etcd nor the other hosts reach it
    run.lost_nodes.add(0)
    deadline = time.monotonic() + 60
    while not any(m["outcome"] == "success" for m in run.migrations()):
        assert time.monotonic() < deadline, run.explain()
        time.sleep(0.2)
    print(f"[controller-cut-off] migrated {time.monotonic() - t0:.2f} s after the link went down")
    hosts.link(0, up=True)
    last = assert_migrated(run, reference, pids, set(cut), "node", 0)
    assert set(map(int, last["replaced"])) == set(cut)
    assert run.procs[0].wait(timeout=30) != 0, "the cut-off controller's launcher must not end as if the job were its own"
    assert not any(_alive(p) for p in cut.values()), "a cut-off worker outlived the job"
    ledger = list(read_ledger(run.run_dir))
    assert len([e for e in ledger if "outcome" in e]) == 1 and [e["type"] for e in ledger].count("controller_takeover") == 1


@pytest.mark.parametrize("phase", ["collecting", "joining"])
def test_on_etcd_a_migration_in_progress_continues_when_the_controller_is_lost(
    tmp_path: Path, hosts_and_etcd: tuple[Hosts, EtcdCluster], reference: dict, phase: str
) -> None:
    """A rank of host 2 is SIGKILLed; once node 0's controller has started that migration (``collecting``: it
    ended the generation; ``joining``: it published the plan), host 0 is lost too. The launcher that takes over
    continues from the state the lost controller wrote, and the job ends bitwise with every rank of host 0 and
    the killed one in spares (two spares on hosts 1 and 2: four ranks lost in all at worst)."""
    hosts, etcd = hosts_and_etcd
    extra = [*EXTRA, "--store", etcd.url, "--rdzv-id", f"ha-{uuid.uuid4().hex[:8]}", "--set", "controller_lease_s=2"]
    run = launch(tmp_path / "job", JOB, ARGS, hosts=hosts, extra=extra, node_spares=[1, 2, 2], **SHAPE)
    run.wait_step(4, 5)
    pids = run.active_pids()
    lost = {*_ranks_on(run, 0), 4}
    run.inject("kill", rank=4)
    run.wait_for_line("generation 0 ended" if phase == "collecting" else "plan for generation 1", timeout=30)
    hosts.kill_all(0)
    run.lost_nodes.add(0)
    assert run.wait() == 0, run.explain()
    results = run.results()
    assert_bitwise(results, reference)
    for rank, pid in pids.items():
        assert (results[rank]["pid"] != pid) if rank in lost else (results[rank]["pid"] == pid), (rank, pid, results[rank]["pid"])
    ledger = list(read_ledger(run.run_dir))
    takeovers = [e for e in ledger if e.get("type") == "controller_takeover"]
    assert len(takeovers) == 1, takeovers
    print(f"[failover-{phase}] {takeovers[0]['message']}")
    migrations = [e for e in ledger if e.get("type") == "migration"]
    assert migrations[-1]["outcome"] == "success" and {m["outcome"] for m in migrations[:-1]} <= {"superseded", "success"}, migrations
    assert {r for m in migrations if m["outcome"] == "success" for r in map(int, m["replaced"])} == lost, migrations
