"""The store contract the control plane relies on, run against both backends: the embedded TCPStore and etcd.

Every operation torchpass issues (``core/control.py``, ``core/signed_store.py``, the rendezvous of rebuilt
gloo groups) with the semantics it relies on: waits that see a later write, atomic ``add`` under concurrent
clients, c10d's ``compare_set`` answers, timeouts as ``DistStoreError``. The etcd backend runs against a real
3-member cluster (Debian's etcd-server); a member's loss must not be seen by its clients.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from torchpass.core.control import get, put, signed
from torchpass.core.etcd_store import EtcdStore, job_url, parse_etcd_url
from torchpass.core.free_port import free_port
from torchpass.core.rendezvous_store import InterruptibleStore

from tests.support.etcd import ETCD, USER, EtcdCluster, auth_cluster

TIMEOUT = timedelta(seconds=20)
Factory = Callable[[], dist.Store]


@pytest.fixture(scope="module")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    if ETCD is None:
        pytest.skip("etcd is not installed here (.ci/run installs Debian's etcd-server)")
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def etcd_auth_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """A cluster with authentication on (its folder holds the user's password file)."""
    if ETCD is None:
        pytest.skip("etcd is not installed here (.ci/run installs Debian's etcd-server)")
    cluster = auth_cluster(tmp_path_factory.mktemp("etcd-auth"))
    yield cluster
    cluster.stop()


@pytest.fixture(params=["tcp", "etcd", "etcd-auth"])
def clients(request: pytest.FixtureRequest) -> Iterator[Factory]:
    """A function making a new client of one store (one per thread: TCPStore clients are not thread-safe)."""
    if request.param == "tcp":
        port = free_port()
        server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        yield lambda: dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
        del server
    else:
        if request.param == "etcd":
            url = request.getfixturevalue("etcd_cluster").url
        else:
            cluster = request.getfixturevalue("etcd_auth_cluster")
            url = cluster.user_url(cluster.folder / "password")
        url = job_url(url, uuid.uuid4().hex)
        yield lambda: EtcdStore(parse_etcd_url(url), TIMEOUT)


def test_set_get_check_and_delete(clients: Factory) -> None:
    s = clients()
    s.set("a", b"\x00\xffbytes")
    s.set("b", "text")
    assert s.get("a") == b"\x00\xffbytes" and s.get("b") == b"text"
    assert s.check(["a", "b"]) and not s.check(["a", "missing"])
    assert s.delete_key("a") and not s.check(["a"])


def test_a_wait_sees_a_write_made_after_it_began(clients: Factory) -> None:
    reader, writer = clients(), clients()
    got: dict[str, bytes] = {}
    t = threading.Thread(target=lambda: got.update(v=reader.get("later")))
    t.start()
    time.sleep(0.3)
    writer.set("later", b"here")
    t.join(10)
    assert got == {"v": b"here"}


def test_a_wait_times_out_with_a_store_error(clients: Factory) -> None:
    s = clients()
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        s.wait(["never"], timedelta(seconds=0.5))
    assert time.monotonic() - start < 5


def test_add_is_atomic_under_concurrent_clients(clients: Factory) -> None:
    stores = [clients() for _ in range(4)]
    threads = [threading.Thread(target=lambda s=s: [s.add("n", 1) for _ in range(25)]) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert stores[0].add("n", 0) == 100 and stores[0].add("never-added", 0) == 0


def test_compare_set_gives_c10d_answers(clients: Factory) -> None:
    s = clients()
    assert s.compare_set("k", "", "first") == b"first"  # absent, expected empty: created
    assert s.compare_set("k", "", "second") == b"first"  # present: the current value, unchanged
    assert s.compare_set("k", "first", "third") == b"third"  # matched: replaced
    assert s.compare_set("absent", "x", "y") == b"x" and not s.check(["absent"])  # absent, expected set: not created


def test_multi_get_and_multi_set(clients: Factory) -> None:
    s = clients()
    s.multi_set(["m1", "m2", "m3"], [b"1", b"2", b"3"])
    assert s.multi_get(["m3", "m1", "m2"]) == [b"3", b"1", b"2"]


def test_requests_of_many_keys(clients: Factory) -> None:
    """More keys than one etcd transaction may hold (its default --max-txn-ops is 128): a job's statuses."""
    s = clients()
    keys = [f"many/{i}" for i in range(3 * 128 + 7)]
    s.multi_set(keys, [str(i).encode() for i in range(len(keys))])
    assert s.check(keys) and s.multi_get(keys) == [str(i).encode() for i in range(len(keys))]
    s.wait(keys, timedelta(seconds=5))
    assert not s.check([*keys, "many/missing"])


def test_the_control_plane_reads_and_writes_records_through_it_sealed(clients: Factory) -> None:
    secret = b"s" * 32
    s = signed(clients(), secret, TIMEOUT)
    put(s, "record", {"rank": 3, "step": 7})
    assert get(s, "record", dict) == {"rank": 3, "step": 7}
    assert clients().get("record") != b'{"rank": 3, "step": 7}'  # sealed: the backend holds no plain value


def test_gloo_groups_meet_through_it(clients: Factory) -> None:
    """What a rebuild does (``comms.rebuild_all``): each rank builds a gloo group on the generation's prefix of
    the sealed store, through an interruptible wait, then they all-reduce."""
    results: dict[int, float] = {}

    def rank(r: int) -> None:
        sealed = signed(clients(), b"s" * 32, TIMEOUT)
        store = InterruptibleStore(dist.PrefixStore("torchpass/pg/1/0/", sealed), lambda: False, "a test group", TIMEOUT)
        group = dist.ProcessGroupGloo(store, r, 2, TIMEOUT)
        t = torch.full((4,), float(r + 1))
        group.allreduce([t]).wait()
        results[r] = float(t[0])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: 3.0, 1: 3.0}


def test_etcd_clients_carry_on_when_their_member_dies(tmp_path: Path) -> None:
    if ETCD is None:
        pytest.skip("etcd is not installed here")
    cluster = EtcdCluster(tmp_path).start()
    try:
        store = EtcdStore(parse_etcd_url(cluster.url + "/failover"), TIMEOUT)
        store.set("before", b"1")
        cluster.kill(0)  # the member the client talks to first
        store.set("after", b"2")
        assert store.get("before") == b"1" and store.add("n", 5) == 5 and store.get("after") == b"2"
    finally:
        cluster.stop()


def test_etcd_urls_carry_endpoints_prefix_and_tls_and_name_what_is_wrong() -> None:
    target = parse_etcd_url("etcd://a:2379,b:2380")
    assert target.endpoints == (("a", 2379), ("b", 2380)) and target.prefix == "/torchpass" and target.protocol == "http"
    tls = parse_etcd_url(job_url("etcds://a:2379/jobs?cacert=/ca.pem&cert=/c.pem&key=/k.pem", "run7"))
    assert (tls.protocol, tls.prefix, tls.ca_cert, tls.cert_cert, tls.cert_key) == ("https", "/jobs/run7", "/ca.pem", "/c.pem", "/k.pem")
    for url, message in [
        ("http://a:2379", "expected etcd://HOST:PORT"),
        ("etcd://a", "endpoint 'a' is not HOST:PORT"),
        ("etcd://", "no endpoint given"),
        ("etcds://a:1?user=x", r"unknown option\(s\) \['user'\]; valid: \['cacert', 'cert', 'key', 'password-file'\]"),
        ("etcd://a:1?cacert=/ca.pem", "TLS options need etcds://"),
        ("etcd://bob:hunter2@a:1", "a password in the URL would show in `ps`"),
        ("etcd://bob@a:1", "a user .* and \\?password-file=FILE go together"),
        ("etcd://a:1?password-file=/pw", "a user .* and \\?password-file=FILE go together"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_etcd_url(url)
    user = parse_etcd_url(job_url("etcd://bob@a:1,b:2/jobs?password-file=/pw", "run7"))
    assert (user.endpoints, user.prefix, user.user, user.password_file) == ((("a", 1), ("b", 2)), "/jobs/run7", "bob", "/pw")


def test_etcd_with_authentication_refuses_a_wrong_password_by_user_and_keeps_other_prefixes_out(
    etcd_auth_cluster: EtcdCluster, tmp_path: Path
) -> None:
    cluster = etcd_auth_cluster
    wrong = tmp_path / "wrong"
    wrong.write_text("not it")
    with pytest.raises(dist.DistStoreError, match=f"user '{USER}' could not log in"):
        EtcdStore(parse_etcd_url(cluster.user_url(wrong)), TIMEOUT).set("k", b"v")
    with pytest.raises(dist.DistStoreError, match=f"cannot read the password of user '{USER}'"):
        EtcdStore(parse_etcd_url(cluster.user_url(tmp_path / "missing")), TIMEOUT)
    with pytest.raises(dist.DistStoreError, match="permission denied"):
        EtcdStore(parse_etcd_url(cluster.user_url(cluster.folder / "password", "/elsewhere")), TIMEOUT).set("k", b"v")
    with pytest.raises(dist.DistStoreError, match="user name is empty"):
        EtcdStore(parse_etcd_url(cluster.url), TIMEOUT).set("k", b"v")  # no user at all


def test_etcd_with_authentication_logs_in_again_on_the_member_it_moves_to(tmp_path: Path) -> None:
    if ETCD is None:
        pytest.skip("etcd is not installed here")
    cluster = auth_cluster(tmp_path)
    try:
        store = EtcdStore(parse_etcd_url(cluster.user_url(tmp_path / "password", "/torchpass/failover")), TIMEOUT)
        store.set("before", b"1")
        cluster.kill(0)  # simple tokens live on the member that issued them: the next one must give its own
        store.set("after", b"2")
        assert store.get("before") == b"1" and store.add("n", 5) == 5 and store.get("after") == b"2"
    finally:
        cluster.stop()
