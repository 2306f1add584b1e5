"""RebuildableProcessGroup in local mode (a spare's set-up), and the backend rewrite, in one process."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp, ReduceScatterOptions

from torchpass.core import comms
from torchpass.core.comms import RebuildableProcessGroup
from torchpass.core.failures import ABANDONED_MARKER, is_comm_error

RANK, SIZE = 1, 4


@pytest.fixture
def group() -> RebuildableProcessGroup:
    g = RebuildableProcessGroup(RANK, SIZE, "unit", list(range(SIZE)), timedelta(seconds=5))
    g.go_local()
    return g


def allreduce_opts(op) -> AllreduceOptions:
    opts = AllreduceOptions()
    opts.reduceOp = op
    return opts


def test_identity_in_local_mode(group):
    assert group.is_local
    assert group.rank() == RANK and group.size() == SIZE
    assert group.group_name == "unit" and group.getGroupName() == "unit"
    assert group.global_ranks == [0, 1, 2, 3]
    assert group.getBackendName() == comms.BACKEND_NAME  # never live: not gloo yet
    assert "local" in repr(group)
    assert group in comms.groups()


def test_groups_are_listed_in_creation_order(group):
    later = RebuildableProcessGroup(0, 2, "later", [0, 1], timedelta(seconds=5))
    listed = comms.groups()
    assert listed.index(group) < listed.index(later)
    assert later.creation_index > group.creation_index


def test_allreduce_sum_multiplies_by_size(group):
    t = torch.tensor([1.0, -2.0])
    work = group.allreduce([t])  # default op: SUM
    assert work.wait()
    assert t.tolist() == [4.0, -8.0]
    group.allreduce([t], allreduce_opts(ReduceOp.SUM)).wait()
    assert t.tolist() == [16.0, -32.0]
    n = torch.tensor([3], dtype=torch.int64)
    group.allreduce([n], ReduceOp.SUM).wait()  # a bare ReduceOp, as some callers pass it
    assert n.item() == 12


@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG])
def test_allreduce_of_identical_values_is_unchanged_for_idempotent_ops(group, op):
    t = torch.tensor([1.5, -2.0])
    group.allreduce([t], allreduce_opts(op)).wait()
    assert t.tolist() == [1.5, -2.0]


def test_allreduce_sum_of_bools_is_an_or(group):
    t = torch.tensor([True, False])
    group.allreduce([t]).wait()
    assert t.tolist() == [True, False]


def test_allreduce_product_raises_to_the_power_of_size(group):
    t = torch.tensor([2.0])
    group.allreduce([t], allreduce_opts(ReduceOp.PRODUCT)).wait()
    assert t.item() == 2.0**SIZE


def test_allreduce_coalesced_and_reduce(group):
    a, b = torch.ones(2), torch.full((3,), 2.0)
    group.allreduce_coalesced([a, b]).wait()
    assert a.tolist() == [4.0, 4.0] and b.tolist() == [8.0] * 3
    c = torch.ones(1)
    group.reduce([c]).wait()
    assert c.item() == 4.0


def test_allgather_replicates_the_input(group):
    outputs = [[torch.zeros(2) for _ in range(SIZE)]]
    group.allgather(outputs, [torch.tensor([3.0, 4.0])]).wait()
    assert [o.tolist() for o in outputs[0]] == [[3.0, 4.0]] * SIZE


def test_allgather_coalesced_gathers_each_input_into_its_slot(group):
    inputs = [torch.tensor([1.0]), torch.tensor([2.0, 3.0])]
    outputs = [[torch.zeros(1), torch.zeros(2)] for _ in range(SIZE)]
    group.allgather_coalesced(outputs, inputs).wait()
    assert [[o.tolist() for o in outs] for outs in outputs] == [[[1.0], [2.0, 3.0]]] * SIZE


def test_all_gather_into_one_tensor_replicates_the_input(group):
    out = torch.zeros(SIZE * 2)
    group.all_gather_single(out, torch.tensor([5.0, 6.0])).wait()
    assert out.tolist() == [5.0, 6.0] * SIZE
    out2 = torch.zeros(SIZE, 3)
    group._allgather_base(out2, torch.arange(3.0)).wait()
    assert out2.tolist() == [[0.0, 1.0, 2.0]] * SIZE
    outs = [torch.zeros(SIZE), torch.zeros(2 * SIZE)]
    group.allgather_into_tensor_coalesced(outs, [torch.ones(1), torch.tensor([1.0, 2.0])]).wait()
    assert outs[0].tolist() == [1.0] * SIZE and outs[1].tolist() == [1.0, 2.0] * SIZE


def test_reduce_scatter_picks_this_ranks_chunk_times_size(group):
    outputs = [torch.zeros(2)]
    inputs = [[torch.full((2,), float(i)) for i in range(SIZE)]]
    group.reduce_scatter(outputs, inputs).wait()
    assert outputs[0].tolist() == [RANK * SIZE] * 2


def test_reduce_scatter_into_one_tensor(group):
    out = torch.zeros(2)
    group.reduce_scatter_single(out, torch.arange(2.0 * SIZE)).wait()
    assert out.tolist() == [2.0 * SIZE, 3.0 * SIZE]  # chunk RANK is [2, 3]
    out = torch.zeros(2)
    opts = ReduceScatterOptions()
    opts.reduceOp = ReduceOp.MAX
    group._reduce_scatter_base(out, torch.arange(2.0 * SIZE), opts).wait()
    assert out.tolist() == [2.0, 3.0]


def test_broadcast_leaves_the_tensor_unchanged(group):
    t = torch.tensor([7.0, 8.0])
    group.broadcast([t]).wait()
    assert t.tolist() == [7.0, 8.0]


def test_scripted_broadcasts_are_delivered_in_order_then_exhausted(group):
    group.script_broadcasts([torch.tensor([1.0, 1.0]), torch.tensor([[2.0], [3.0]])])
    t = torch.zeros(2)
    group.broadcast([t]).wait()
    assert t.tolist() == [1.0, 1.0]
    group.broadcast([t]).wait()
    assert t.tolist() == [2.0, 3.0]  # reshaped to the receiving tensor
    t.fill_(9.0)
    group.broadcast([t]).wait()
    assert t.tolist() == [9.0, 9.0]


def test_alltoall_in_local_mode(group):
    uneven = torch.ones(3)
    group.all_to_all_single(uneven, torch.arange(4.0), [1, 1, 1, 0], [1, 1, 1, 1]).wait()
    assert uneven.tolist() == [0.0, 0.0, 0.0]  # no sensible local answer: deterministic zeros
    outs = [torch.zeros(1) for _ in range(SIZE)]
    group.alltoall(outs, [torch.full((1,), float(i)) for i in range(SIZE)]).wait()
    assert [o.item() for o in outs] == [float(RANK)] * SIZE


def test_alltoall_base_even_split_receives_this_ranks_chunk_from_every_peer(group):
    out = torch.zeros(2 * SIZE)
    group.alltoall_base(out, torch.arange(2.0 * SIZE), [], []).wait()
    assert out.tolist() == [2.0, 3.0] * SIZE


def test_gather_and_scatter(group):
    outs = [[torch.zeros(1) for _ in range(SIZE)]]
    group.gather(outs, [torch.tensor([4.0])]).wait()
    assert [o.item() for o in outs[0]] == [4.0] * SIZE
    out = [torch.zeros(1)]
    group.scatter(out, [[torch.full((1,), float(i)) for i in range(SIZE)]]).wait()
    assert out[0].item() == float(RANK)


def test_barrier_send_recv_complete_at_once(group):
    t = torch.tensor([1.0])
    for work in (group.barrier(), group.send([t], 0), group.recv([t], 2), group.recv_anysource([t])):
        assert work.is_completed()
        assert work.wait()
    assert t.item() == 1.0
    group.monitored_barrier()  # a no-op in local mode
    group._start_coalescing(torch.device("cpu"))
    assert group._end_coalescing(torch.device("cpu")).wait()


def test_returned_work_has_a_completed_future(group):
    t = torch.ones(2)
    work = group.allreduce([t])
    future = work.get_future()
    assert future.done()
    assert torch.equal(future.value()[0], t)


def test_release_of_a_local_group_is_a_no_op(group):
    assert group.release() == 0
    group.go_local()  # idempotent
    assert group.is_local


class _Pending:
    def __init__(self) -> None:
        self.in_flight = True

    def quiet(self) -> bool:
        return not self.in_flight


class _Released:
    """A released transport as the graveyard sees it: gone once gloo has nothing of it in flight."""

    def __init__(self) -> None:
        self.pending = _Pending()
        self.reaps = 0

    def reap(self, sockets: list) -> int:
        self.reaps += 1
        return 0

    def settled(self) -> bool:
        return self.pending.quiet()


def test_the_graveyard_lets_a_transport_go_once_gloo_ends_its_last_operation_without_another_burial(monkeypatch):
    import weakref

    monkeypatch.setattr(comms._Graveyard, "FIRST_SWEEP_S", 0.005)
    monkeypatch.setattr(comms._Graveyard, "SWEEP_INTERVAL_S", 0.02)
    graveyard = comms._Graveyard()
    caught = _Released()  # an operation caught mid-message: it ends at gloo's timeout, long after the release
    quiet = _Released()
    quiet.pending.in_flight = False
    refs = [weakref.ref(caught), weakref.ref(quiet)]
    graveyard.bury(caught)  # type: ignore[arg-type]
    graveyard.bury(quiet)  # type: ignore[arg-type]
    pending = caught.pending
    del caught, quiet
    assert refs[1]() is None  # nothing in flight: never kept
    time.sleep(0.2)
    assert refs[0]() is not None  # destroying it now would block on gloo's running operation
    assert refs[0]().reaps >= 3  # its sockets are looked for again while it is kept
    pending.in_flight = False  # gloo's timeout ends it; no migration follows
    deadline = time.time() + 5
    while (refs[0]() is not None or graveyard._sweeper is not None) and time.time() < deadline:
        time.sleep(0.02)
    assert refs[0]() is None
    assert graveyard._sweeper is None  # the sweeper runs only while the graveyard holds something


def test_groups_created_under_the_local_default_start_local():
    """What a spare's ``new_group`` calls build while it runs the script's set-up (no store needed)."""
    from types import SimpleNamespace

    opts = SimpleNamespace(group_rank=2, group_size=4, group_id="spare_pg", global_ranks_in_group=[], timeout=30.0, store=None)
    comms.set_local_mode_default(True)
    try:
        created = comms._create(opts, None)
    finally:
        comms.set_local_mode_default(False)
    assert created.is_local
    assert created.global_ranks == [0, 1, 2, 3]
    assert created._op_timeout == timedelta(seconds=30)
    t = torch.ones(1)
    created.allreduce([t]).wait()
    assert t.item() == 4.0


# ---- lazy transports: what a release shuts down -----------------------------------------
# Two ranks of a group in one process: each connection's two ends are two sockets, one
# accepted by a listener (the listener's rank's), the other opened to it (the other rank's).


@pytest.fixture
def store_port():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    yield server.port
    del server


def _client(port: int, prefix: str) -> dist.Store:
    return dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=30)))


def _transport(port: int, prefix: str, rank: int, generation: int = 1) -> comms._Transport:
    return comms._Transport("t", _client(port, prefix), rank, 2, generation, timedelta(seconds=30), timedelta(seconds=30))


def _allreduce(transports: list[comms._Transport]) -> None:
    results: dict[int, list[float]] = {}

    def run(rank: int, transport: comms._Transport) -> None:
        t = torch.ones(2)
        transport.pending.run(lambda: transport.group.allreduce([t])).wait()
        results[rank] = t.tolist()

    threads = [threading.Thread(target=run, args=(r, t)) for r, t in enumerate(transports)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {r: [2.0, 2.0] for r in range(len(transports))}


def _owned(transport: comms._Transport) -> list[comms._TcpSocket]:
    with transport.endpoints.lock:
        peers = set(transport.endpoints.peers)
    return [s for s in comms._tcp_sockets() if transport.endpoints.owns(s, peers, set())]


def _established(links: set[str]) -> set[str]:
    """Those of ``links`` (``socket:[inode]``) whose connection is still established (state 01 in /proc/net/tcp)."""
    alive = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as table:
            for row in table.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "01" and f"socket:[{fields[9]}]" in links:
                    alive.add(f"socket:[{fields[9]}]")
    return alive


def _listening() -> set[comms.Endpoint]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with sock:
            if sock.family == socket.AF_INET and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                found.add(comms._endpoint(sock.getsockname()))
    return found


def _until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_building_connects_nothing_and_a_collective_connects_to_the_peer_it_read(store_port):
    ranks = [_transport(store_port, "a/", r) for r in range(2)]
    listeners = [t.endpoints.listener for t in ranks]
    assert set(listeners) <= _listening() and listeners[0] != listeners[1]
    assert [_owned(t) for t in ranks] == [[], []]  # a lazy device connects on first use
    _allreduce(ranks)
    assert [t.endpoints.peers for t in ranks] == [{listeners[1]}, {listeners[0]}]
    ends = [_owned(t) for t in ranks]
    assert [len(e) for e in ends] == [1, 1]  # one connection, an end each
    assert {ends[0][0].local, ends[1][0].local} & set(listeners)  # one end was accepted by a listener
    for t in ranks:
        t.release("test over")


def test_a_release_shuts_down_what_collectives_opened_and_spares_the_next_generation_and_the_store(store_port):
    old = [_transport(store_port, "g1/", r, 1) for r in range(2)]
    _allreduce(old)
    new = [_transport(store_port, "g2/", r, 2) for r in range(2)]
    _allreduce(new)
    old_links = {s.link for t in old for s in _owned(t)}
    new_links = {s.link for t in new for s in _owned(t)}
    assert len(old_links) == len(new_links) == 2 and _established(new_links) == new_links
    assert [t.release("generation 1 ended") for t in old] in ([1, 0], [1, 1])  # the peer may have closed its end first
    _until(lambda: not _established(old_links), 5, "a socket of the released generation is still established")
    assert _established(new_links) == new_links
    _allreduce(new)
    probe = _client(store_port, "")
    probe.set("still", "there")
    assert probe.get("still") == b"there"
    for t in new:
        t.release("test over")


def test_a_released_transport_begins_no_connection(store_port):
    ranks = [_transport(store_port, "r/", r) for r in range(2)]
    ranks[0].release("generation 1 ended")
    with pytest.raises(RuntimeError, match=ABANDONED_MARKER):
        ranks[0].backend.allreduce([torch.ones(1)]).wait()  # C++ code reaching gloo directly
    with pytest.raises(RuntimeError, match=ABANDONED_MARKER):
        ranks[0].pending.run(lambda: ranks[0].group.allreduce([torch.ones(1)])).wait()
    assert ranks[0].endpoints.peers == set() and _owned(ranks[0]) == []
    ranks[1].release("test over")


def _record(host: str, port: int) -> bytes:
    """A gloo tcp address record (host name, then ``sockaddr_storage`` + sequence number, each after its length)."""
    name = socket.gethostname().encode()
    address = (struct.pack("=H", socket.AF_INET) + port.to_bytes(2, "big") + socket.inet_aton(host)).ljust(128, b"\0")
    address += struct.pack("=q", -1)
    return struct.pack("=Q", len(name)) + name + struct.pack("=Q", len(address)) + address


def test_an_address_record_names_the_listener():
    assert comms.record_endpoint(_record("10.1.2.3", 29500)) == (ipaddress.ip_address("10.1.2.3"), 29500)
    with pytest.raises(ValueError, match="not a gloo address record"):
        comms.record_endpoint(struct.pack("=Q", 0) + struct.pack("=Q", 4) + b"abcd")


@pytest.mark.skipif(sys.byteorder != "little", reason="/proc/net/tcp prints native words")
def test_proc_net_tcp_endpoints_read_as_the_kernel_prints_them():
    assert comms._proc_endpoint("0100007F:1F90") == (ipaddress.ip_address("127.0.0.1"), 8080)
    assert comms._proc_endpoint("00000000000000000000000001000000:0050") == (ipaddress.ip_address("::1"), 80)


def _sock(local: tuple[str, int], remote: tuple[str, int] | None) -> comms._TcpSocket:
    return comms._TcpSocket(3, "socket:[1]", comms._endpoint(local), comms._endpoint(remote) if remote else None, False)


def test_a_socket_is_the_listeners_or_to_a_peer_read_never_the_stores_nor_a_newer_transports(monkeypatch):
    monkeypatch.setattr(comms, "_not_gloo_peer_ports", {2379})
    monkeypatch.setattr(comms, "_not_gloo_local_ports", {4000})
    endpoints = comms._Endpoints()
    endpoints.listener = comms._endpoint(("10.0.0.1", 5000))
    peer, reused = comms._endpoint(("10.0.0.2", 6000)), comms._endpoint(("10.0.0.3", 6001))
    peers = {peer, reused, comms._endpoint(("10.0.0.9", 2379))}
    assert endpoints.owns(_sock(("10.0.0.1", 5000), ("10.0.0.7", 40000)), peers, set())  # accepted
    assert endpoints.owns(_sock(("10.0.0.1", 40001), ("10.0.0.2", 6000)), peers, set())  # opened to a peer
    assert not endpoints.owns(_sock(("10.0.0.1", 40002), ("10.0.0.4", 6000)), peers, set())
    assert not endpoints.owns(_sock(("10.0.0.1", 40003), None), peers, set())  # a connect that failed
    # A peer's address that a transport not released has read is that transport's (the port was reused).
    assert not endpoints.owns(_sock(("10.0.0.1", 40004), ("10.0.0.3", 6001)), peers, {reused})
    assert not endpoints.owns(_sock(("10.0.0.1", 40005), ("10.0.0.9", 2379)), peers, set())  # the store
    assert not endpoints.owns(_sock(("10.0.0.1", 4000), ("10.0.0.2", 6000)), peers, set())  # the state server's


class _Running(dist.Work):
    """A collective gloo is still running: keeps its transport in the graveyard until the test ends it."""

    def __init__(self) -> None:
        super().__init__()
        self.fut: torch.futures.Future = torch.futures.Future()

    def get_future(self) -> torch.futures.Future:
        return self.fut

    def is_completed(self) -> bool:
        return self.fut.done()


def test_the_graveyard_shuts_down_connections_that_appear_after_the_release(store_port):
    """A connection whose record was read just before the release (gloo opens it right after the read) and a
    peer's connection to the listener, both opened after the release scanned the process's sockets."""
    ranks = [_transport(store_port, "late/", r) for r in range(2)]
    _allreduce(ranks)
    running = _Running()
    ranks[0].pending.run(lambda: running)
    ranks[0].release("generation 1 ended")
    assert ranks[0] in comms._graveyard._buried
    peer_listener, own_listener = ranks[1].endpoints.listener, ranks[0].endpoints.listener
    ranks[1].release("generation 1 ended")  # its connections are not under test here
    late = [socket.create_connection((str(e[0]), e[1]), timeout=5) for e in (peer_listener, own_listener)]
    for sock in late:
        # Cut by the graveyard: this end was shut down (the connection to the peer) or the accepted end was (EOF).
        assert sock.recv(1) == b""
        sock.close()
    running.fut.set_result([])
    _until(lambda: ranks[0] not in comms._graveyard._buried, 10, "the graveyard kept a settled transport")


def test_a_lazy_connect_to_a_peer_that_never_answers_is_cut_short_by_the_release(store_port):
    """Rank 1's record names a listener whose handshakes never complete (its accept queue is full): rank 0's first
    collective stays in the connect. The release returns the collective at once and shuts down the attempt and
    gloo's new attempts at it, after which gloo gives the connection up and the transport is let go."""
    rank0 = _transport(store_port, "hole/", 0)
    own = rank0.endpoints.listener[1]

    def native(port: int) -> int:  # gloo orders the two ends by their ports as stored, in network byte order
        return int.from_bytes(port.to_bytes(2, "big"), sys.byteorder)

    while True:
        hole = socket.socket()
        hole.bind(("127.0.0.1", 0))
        hole.listen(0)
        if native(own) > native(hole.getsockname()[1]):
            break  # rank 0 opens the connection
        hole.close()
    socket.create_connection(hole.getsockname()).close()  # fills the queue: later handshakes go unanswered
    _client(store_port, "hole/").set("0/1", _record(*hole.getsockname()))
    target = comms._endpoint(hole.getsockname())
    work = rank0.pending.run(lambda: rank0.group.allreduce([torch.ones(2)]))

    def attempts() -> list[comms._TcpSocket]:
        return [s for s in comms._tcp_sockets() if s.remote == target]

    _until(lambda: any(s.connecting for s in attempts()), 10, "rank 0 never tried to connect")
    outcome: list[BaseException] = []

    def training_thread() -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=training_thread)
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()
    t0 = time.monotonic()
    assert rank0.release("generation 1 ended") == 1
    waiter.join(5)
    assert not waiter.is_alive() and time.monotonic() - t0 < 1.0
    # Abandoned, or gloo's own error when its last attempt, cut short too, ended within the wait's slice.
    assert len(outcome) == 1 and is_comm_error(str(outcome[0])), outcome
    _until(lambda: not attempts(), 10, "a connection attempt of the released transport is still open")
    _until(lambda: rank0 not in comms._graveyard._buried, 10, "gloo did not give the connection up")
    assert work._inner is not None and work._inner.is_completed()  # gloo's own: failed, its retries cut short
    hole.close()


def test_a_group_built_for_a_generation_already_ended_is_released_at_once(store_port, monkeypatch):
    """The monitor ended the generation while the main thread was still rebuilding: nothing is waited for."""
    monkeypatch.setattr(comms, "_released_through", 3)
    group = RebuildableProcessGroup(0, 2, "late_rebuild", [0, 1], timedelta(seconds=30))
    group.connect(_client(store_port, "ended/"), 3, timedelta(seconds=30))
    assert group._transport is not None and group._transport.released
    with pytest.raises(RuntimeError, match=ABANDONED_MARKER):
        group.allreduce([torch.ones(1)]).wait()
    group.go_local()


# ---- backend rewrite ------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["gloo", "GLOO", "cpu:gloo", dist.Backend.GLOO, "torchpass"])
def test_rewrite_maps_gloo_to_torchpass(backend):
    assert comms._rewrite_backend(backend) == comms.BACKEND_NAME


def test_rewrite_passes_none_and_undefined_through():
    assert comms._rewrite_backend(None) is None
    assert comms._rewrite_backend("undefined") == "undefined"


@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl", "cpu:gloo,cuda:nccl", "mpi"])
def test_rewrite_rejects_backends_it_cannot_rebuild(backend):
    with pytest.raises(RuntimeError) as info:
        comms._rewrite_backend(backend)
    message = str(info.value)
    assert f"backend {backend!r} cannot be rebuilt" in message
    assert "supports 'gloo' (CPU)" in message


# ---- install(), in a fresh interpreter (it patches c10d for the whole process) ---------------

_INSTALL_PROBE = textwrap.dedent(
    """
    import json, sys, tempfile
    import torch, torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torchpass.core import comms

    out = {}
    comms.install()
    helper = c10d._new_process_group_helper
    comms.install()  # a second call must change nothing
    out["helper_unchanged"] = c10d._new_process_group_helper is helper
    out["cpu_backend"] = dist.Backend.default_device_backend_map["cpu"]
    out["registered"] = "torchpass" in dist.Backend.backend_list
    path = tempfile.mktemp()
    dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
    world = dist.group.WORLD
    out["world_type"] = type(world).__name__
    t = torch.ones(2)
    dist.all_reduce(t)
    out["allreduce"] = t.tolist()
    sub = dist.new_group([0])
    out["new_group_type"] = type(sub).__name__
    out["group_names"] = [g.group_name for g in comms.groups()]
    import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend, as torchtitan does
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("world",))
    try:  # what torchtitan's ParallelDims.build_mesh does for a size-1 dimension
        mesh._unflatten(0, (1, 1), ("pp", "dp"), backend_override={"pp": "fake"})
        out["unflatten"] = "ok"
    except Exception as exc:
        out["unflatten"] = f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group()
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def installed() -> dict:
    proc = subprocess.run([sys.executable, "-c", _INSTALL_PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_install_is_idempotent_and_routes_gloo_groups(installed):
    assert installed["helper_unchanged"]
    assert installed["cpu_backend"] == "torchpass"
    assert installed["registered"]
    assert installed["world_type"] == "RebuildableProcessGroup"
    assert installed["new_group_type"] == "RebuildableProcessGroup"
    assert installed["allreduce"] == [1.0, 1.0]
    assert len(installed["group_names"]) == 2


def test_install_leaves_fake_groups_alone(installed):
    assert installed["unflatten"] == "ok"
