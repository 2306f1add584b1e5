"""State transfer over loopback sockets, in one process: servers and receivers on threads."""

from __future__ import annotations

import json
import os
import pickle
import socket
import threading
import time
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchpass.core import handshake
from torchpass.core.checksum import crc32c
from torchpass.core.manifest import Captured, capture, fingerprint, rebuild, state_digest, tensor_bytes
from torchpass.core.transfer import HolderLink, ReceivePool, StateServer, TransferError, _send_batch, fetch_state

from tests.support.secret import SECRET

CHUNK = 16 << 10
CLASSES = {"model": "params", "optimizer": "optimizer"}


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": OrderedDict(
            [
                ("w", torch.randn(200, 100, generator=g)),  # 80000 bytes: several chunks
                ("b", torch.randn(100, generator=g).to(torch.bfloat16)),
                ("scale", torch.tensor(3.0)),
                ("empty", torch.empty(0)),
            ]
        ),
        "optimizer": {"state": {0: {"exp_avg": torch.randn(200, 100, generator=g), "step": torch.tensor(5.0)}}, "lr": 0.1},
        "extra": {"counter": 7},
    }


def total_bytes(captured, classes=None) -> int:
    return sum(e.nbytes for e in captured.manifest.entries if classes is None or e.state_class in classes)


@pytest.fixture
def servers():
    made: list[StateServer] = []

    def make(**kw) -> StateServer:
        server = StateServer(secret=SECRET, **kw)
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


def serve(make, state: dict, version: int = 5, **kw) -> tuple[StateServer, object]:
    server = make(**kw)
    captured = capture(state, CLASSES, version=version)
    server.publish(captured)
    return server, captured


def src(server: StateServer, copy: str = "live"):
    return (server.address, copy)


def fetch(sources, version: int = 5, **kw):
    kw.setdefault("chunk_bytes", CHUNK)
    kw.setdefault("timeout", 20.0)
    kw.setdefault("secret", SECRET)
    return fetch_state([src(s) for s in sources], version, **kw)


def assert_bitwise_equal(tensors, captured) -> None:
    assert len(tensors) == len(captured.tensors)
    for got, want in zip(tensors, captured.tensors):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert bytes(tensor_bytes(got)) == bytes(tensor_bytes(want))


def served(*servers: StateServer, expected: int | None = None) -> int:
    """Bytes the servers sent. A server counts a stream once its last frame is out,
    which can be just after the receiver returned, so wait briefly for it to settle."""
    deadline = time.time() + 5
    total = sum(s.served_bytes for s in servers)
    while time.time() < deadline:
        time.sleep(0.05)
        now = sum(s.served_bytes for s in servers)
        if now == total and (expected is None or now >= expected):
            break
        total = now
    return sum(s.served_bytes for s in servers)


# ---- full fetch ----------------------------------------------------------------------------


def test_full_fetch_is_bitwise_equal(servers):
    state = make_state()
    server, captured = serve(servers, state)
    manifest, tensors, stats = fetch([server])
    assert manifest.entries == captured.manifest.entries
    assert manifest.version == 5
    assert_bitwise_equal(tensors, captured)
    assert state_digest(rebuild(manifest, tensors)) == state_digest(state)
    assert stats.nbytes == total_bytes(captured)
    assert stats.chunks > 4 and stats.resent_chunks == 0
    assert stats.sources == [f"{server.address[0]}:{server.address[1]}/live"]
    assert stats.checksummed == stats.nbytes  # every received byte verified, once
    assert served(server) == total_bytes(captured)


def test_the_integrity_checksum_is_crc32c():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
    t = torch.arange(1000, dtype=torch.float32)
    assert crc32c(tensor_bytes(t)) == crc32c(t.numpy().tobytes())  # tensor memory, read in place


def test_a_published_copy_is_checksummed_once_however_often_it_is_fingerprinted_and_sent(servers):
    state = make_state()
    live = capture(state, CLASSES, version=5)
    table = live.checksums()
    a = servers(chunk_bytes=CHUNK)
    a.publish(Captured(live.manifest, live.tensors, table))  # live: checksummed on publication
    b, _ = serve(servers, make_state(), chunk_bytes=CHUNK)
    for _ in range(2):
        _, tensors, _ = fetch([a, b], verify_replicas=True)
        assert_bitwise_equal(tensors, live)
    _, tensors, _ = fetch([a])
    assert_bitwise_equal(tensors, live)
    assert table.checksummed == total_bytes(live)


def test_fetch_striped_over_two_replicas(servers):
    a, captured = serve(servers, make_state())
    b, _ = serve(servers, make_state())  # an identical replica in separate memory
    manifest, tensors, stats = fetch([a, b], verify_replicas=True)
    assert_bitwise_equal(tensors, captured)
    assert len(stats.sources) == 2
    assert served(a, b, expected=stats.nbytes) == total_bytes(captured) == stats.nbytes
    assert a.served_bytes > 0 and b.served_bytes > 0


def test_state_classes_filter_fetches_only_those_tensors(servers):
    server, captured = serve(servers, make_state())
    manifest, tensors, stats = fetch([server], state_classes={"optimizer"})
    assert len(tensors) == len(manifest.entries)  # placeholders for the rest
    assert stats.nbytes == total_bytes(captured, {"optimizer"}) == served(server)
    for entry, got, want in zip(manifest.entries, tensors, captured.tensors):
        assert got.shape == want.shape and got.dtype == want.dtype
        if entry.state_class == "optimizer":
            assert bytes(tensor_bytes(got)) == bytes(tensor_bytes(want))


def test_into_receives_in_place(servers):
    server, captured = serve(servers, make_state(seed=1))
    mine = capture(make_state(seed=2), CLASSES, version=4)  # same names and shapes, other values
    manifest, tensors, _ = fetch([server], into=mine)
    assert all(got is own for got, own in zip(tensors, mine.tensors))
    assert_bitwise_equal(mine.tensors, captured)


def test_into_only_reuses_matching_entries(servers):
    server, captured = serve(servers, make_state())
    other = make_state(seed=3)
    other["model"]["w"] = torch.zeros(10)  # a different shape: cannot receive in place
    mine = capture(other, CLASSES, version=4)
    _, tensors, _ = fetch([server], into=mine)
    names = [e.name for e in captured.manifest.entries]
    assert tensors[names.index("model/w")] is not mine.tensors[names.index("model/w")]
    assert tensors[names.index("model/b")] is mine.tensors[names.index("model/b")]
    assert_bitwise_equal(tensors, captured)


def test_fetch_of_a_state_without_tensors(servers):
    server = servers()
    server.publish(capture({"extra": {"n": 1}}, {}, version=2))
    manifest, tensors, stats = fetch([server], version=2)
    assert tensors == [] and stats.nbytes == 0
    assert rebuild(manifest, tensors) == {"extra": {"n": 1}}


# ---- receive pool -----------------------------------------------------------------------------


def test_receive_pool_hands_out_aligned_views_then_falls_back():
    pool = ReceivePool(1000)
    base = pool._storage.data_ptr()
    a = pool.take(torch.float32, (3,))
    b = pool.take(torch.bfloat16, (5, 2))
    c = pool.take(torch.int64, ())
    for t in (a, b, c):
        assert t.data_ptr() % 64 == 0
        assert base <= t.data_ptr() < base + 1000
    assert b.shape == (5, 2) and b.dtype == torch.bfloat16 and c.shape == ()
    assert b.data_ptr() - a.data_ptr() == 64
    big = pool.take(torch.float32, (1000,))  # past the end: ordinary memory
    assert not base <= big.data_ptr() < base + 1000
    assert big.shape == (1000,)
    d = pool.take(torch.uint8, (16,))  # smaller requests still fit after a fallback
    assert base <= d.data_ptr() < base + 1000


def test_receive_pool_views_do_not_overlap():
    pool = ReceivePool(4096)
    a = pool.take(torch.float32, (10,))
    b = pool.take(torch.float32, (10,))
    a.fill_(1.0)
    b.fill_(2.0)
    assert a.tolist() == [1.0] * 10 and b.tolist() == [2.0] * 10


def test_fetch_into_a_pool(servers):
    server, captured = serve(servers, make_state())
    pool = ReceivePool(total_bytes(captured) + 64 * len(captured.tensors))
    base = pool._storage.data_ptr()
    _, tensors, _ = fetch([server], pool=pool)
    assert_bitwise_equal(tensors, captured)
    assert all(base <= t.data_ptr() < base + pool.nbytes for t in tensors if t.numel())  # empty: no data pointer


def test_fetch_with_an_exhausted_pool_falls_back(servers):
    server, captured = serve(servers, make_state())
    _, tensors, _ = fetch([server], pool=ReceivePool(1024))
    assert_bitwise_equal(tensors, captured)


# ---- corruption ---------------------------------------------------------------------------------


def flip_first_byte(view: memoryview) -> bytes:
    data = bytearray(view)
    data[0] ^= 0xFF
    return bytes(data)


def test_corrupted_chunk_is_detected_and_resent(servers):
    hits: list[tuple] = []

    def corrupt(chunk, view):
        if chunk[1] == 0 and len(hits) < 2 and chunk not in hits:  # the first chunk of two tensors, once each
            hits.append(chunk)
            return flip_first_byte(view)
        return None

    server, captured = serve(servers, make_state(), corrupt=corrupt)
    _, tensors, stats = fetch([server])
    assert len(hits) == 2
    assert stats.resent_chunks == 2
    assert stats.nbytes == total_bytes(captured) + sum(c[2] for c in hits)
    assert stats.checksummed == stats.nbytes  # resent chunks are verified again
    assert_bitwise_equal(tensors, captured)


def corrupt_first_chunk():
    """A server's ``corrupt`` hook that flips a byte of the first chunk it sends, once."""
    once: list = []

    def corrupt(chunk, view):
        if not once:
            once.append(chunk)
            return flip_first_byte(view)
        return None

    return corrupt


def test_a_resent_chunk_travels_with_the_crc_computed_the_first_time(servers):
    corrupt = corrupt_first_chunk()
    captured = capture(make_state(), CLASSES, version=5)
    table = captured.checksums()
    server = servers(corrupt=corrupt)
    server.publish(Captured(captured.manifest, captured.tensors, table), "snapshot")  # not checksummed until sent
    _, tensors, stats = fetch_state([src(server, "snapshot")], 5, chunk_bytes=CHUNK, timeout=20.0, secret=SECRET)
    assert stats.resent_chunks == 1
    assert table.checksummed == total_bytes(captured)  # the source read each byte once for its CRC
    assert_bitwise_equal(tensors, captured)


def test_corruption_on_one_of_two_replicas_is_resent(servers):
    corrupt = corrupt_first_chunk()
    a, captured = serve(servers, make_state(), corrupt=corrupt)
    b, _ = serve(servers, make_state())
    _, tensors, stats = fetch([a, b])
    assert stats.resent_chunks == 1
    assert_bitwise_equal(tensors, captured)


def test_persistent_corruption_fails_naming_the_tensor(servers):
    server = servers(corrupt=lambda chunk, view: flip_first_byte(view) if chunk[0] == 4 else None)
    captured = capture(make_state(), CLASSES, version=5)
    server.publish(captured)
    name = captured.manifest.entries[4].name
    with pytest.raises(TransferError) as info:
        fetch([server], retries=2)
    message = str(info.value)
    assert f"tensor {name!r}" in message
    assert "after 2 resend round(s)" in message


def test_zero_retries_fails_on_the_first_bad_chunk(servers):
    server, _ = serve(servers, make_state(), corrupt=lambda chunk, view: flip_first_byte(view) if chunk == (0, 0, CHUNK) else None)
    with pytest.raises(TransferError, match=r"1 chunk\(s\) still failed their checksum after 0 resend round\(s\); first: tensor 'model/w' at byte 0"):
        fetch([server], retries=0)


# ---- errors ---------------------------------------------------------------------------------------


def test_version_mismatch(servers):
    server, _ = serve(servers, make_state(), version=5)
    with pytest.raises(TransferError) as info:
        fetch([server], version=6)
    message = str(info.value)
    assert f"{server.address[0]}:{server.address[1]}" in message
    assert "version 6" in message and "5" in message


def test_nothing_published(servers):
    server = servers()
    with pytest.raises(TransferError, match="no 'live' copy at version 5"):
        fetch([server])
    server.publish(capture(make_state(), CLASSES, version=5))
    server.publish(None)  # withdrawn again
    with pytest.raises(TransferError, match="no 'live' copy"):
        fetch([server])


def test_publishing_a_new_live_version_replaces_the_old_one(servers):
    server, _ = serve(servers, make_state(), version=5)
    newer = capture(make_state(seed=9), CLASSES, version=6)
    server.publish(newer)
    _, tensors, _ = fetch([server], version=6)
    assert_bitwise_equal(tensors, newer)
    with pytest.raises(TransferError):
        fetch([server], version=5)


def test_no_sources():
    with pytest.raises(TransferError, match="no source"):
        fetch_state([], 5, secret=SECRET)


def test_unreachable_source_is_an_error():
    import socket

    with socket.socket() as bound:  # bound, never listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        with pytest.raises(ConnectionRefusedError):
            fetch_state([(bound.getsockname(), "live")], 5, timeout=5.0, secret=SECRET)


def test_verify_replicas_detects_disagreeing_replicas(servers):
    good, _ = serve(servers, make_state())
    diverged_state = make_state()
    diverged_state["optimizer"]["state"][0]["exp_avg"][7, 7] += 1e-3
    bad, _ = serve(servers, diverged_state)
    with pytest.raises(TransferError, match="replicas disagree on the state at version 5"):
        fetch([good, bad], verify_replicas=True)
    # restricted to the classes that agree, the check passes
    _, _, stats = fetch([good, bad], verify_replicas=True, state_classes={"params"})
    assert stats.nbytes == total_bytes(capture(make_state(), CLASSES, 5), {"params"})


def test_fingerprints_served_match_the_local_ones(servers):
    server, captured = serve(servers, make_state())
    twin, _ = serve(servers, make_state())
    fetch([server, twin], verify_replicas=True)  # agrees
    assert fingerprint(captured) == fingerprint(capture(make_state(), CLASSES, version=5))


# ---- strangers at the port: no state out, no state in, no code run -------------------------

def _stranger(server: StateServer) -> socket.socket:
    return socket.create_connection(server.address, timeout=10)


def _closed_without_a_reply(sock: socket.socket) -> bool:
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:  # closed with our unread bytes in its buffer: the kernel resets
        pass
    return data == b""


@pytest.mark.parametrize("copy", ["live", "snapshot", "held:1"])
def test_a_client_without_the_secret_gets_no_byte_of_any_copy(servers, copy):
    server = servers()
    captured = capture(make_state(), CLASSES, version=5)
    server.publish(captured, copy)
    with pytest.raises(TransferError, match="server's proof|closed the connection"):
        fetch_state([(server.address, copy)], 5, timeout=10.0, secret=b"not-the-job-secret-000000")
    # By hand: the nonce, a made-up proof, then the request a client would send.
    with _stranger(server) as sock:
        nonce = sock.recv(64)
        assert len(nonce) == 32
        sock.sendall(b"\0" * 64 + b"\x20\0\0\0\0\0\0\0" + b'{"op": "chunks", "copy": "live", "version": 5}')
        assert _closed_without_a_reply(sock)
    assert server.served_bytes == 0 and server.refused == 2


def test_a_hold_push_without_the_secret_installs_nothing(servers):
    held: list[int] = []
    server = servers(hold_into=lambda src, manifest: [torch.empty(e.shape, dtype=getattr(torch, e.dtype)) for e in manifest.entries],
                     on_held=lambda src, captured: held.append(src))  # fmt: skip
    forged = capture(make_state(seed=9), CLASSES, version=6)
    with pytest.raises(TransferError):
        HolderLink(10.0, b"not-the-job-secret-000000").push(server.address, 1, forged, chunk_bytes=CHUNK, retries=0)
    assert held == [] and server.refused == 1
    HolderLink(10.0, SECRET).push(server.address, 1, forged, chunk_bytes=CHUNK, retries=0)
    assert held == [1]  # the job's own push still lands


def _holder(servers) -> tuple[StateServer, list[tuple[int, int, threading.Thread]]]:
    """A state server that holds buddy copies, and (source rank, version, serving thread) of each it installed.

    The server serves each connection on a thread of its own: pushes served by one thread came over one connection."""
    held: list[tuple[int, int, threading.Thread]] = []
    server = servers(hold_into=lambda src, manifest: [torch.empty(e.shape, dtype=getattr(torch, e.dtype)) for e in manifest.entries],
                     on_held=lambda src, captured: held.append((src, captured.manifest.version, threading.current_thread())))  # fmt: skip
    return server, held


def _until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_state_of_many_small_tensors_crosses_bitwise(servers):
    """Hundreds of tensors a few bytes to a few KiB each (biases, norms, scalars, empties): their frames go out in batches."""
    g = torch.Generator().manual_seed(7)
    sizes = [int(n) for n in torch.randint(0, 3000, (400,), generator=g)]
    state = {"model": {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}, "optimizer": {}}
    server = servers()
    server.publish(capture(state, CLASSES, version=1))
    manifest, tensors, stats = fetch_state([(server.address, "live")], 1, chunk_bytes=CHUNK, secret=SECRET)
    assert state_digest(rebuild(manifest, tensors)) == state_digest(state)
    assert stats.nbytes == sum(sizes) * 4


class _Trickle:
    """A connection whose ``sendmsg`` takes at most 777 bytes a call, as a socket with a send timeout
    (``SO_SNDTIMEO``) or interrupted by a signal may: cuts fall inside headers and payloads alike."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.calls = 0

    def sendmsg(self, buffers) -> int:
        self.calls += 1
        room = 777
        for buffer in buffers:
            taken = bytes(memoryview(buffer)[:room])
            self.received += taken
            room -= len(taken)
            if not room:
                break
        return 777 - room


def test_a_batch_the_socket_takes_in_parts_arrives_whole_and_in_order():
    buffers = [bytes([i]) * n for i, n in enumerate([20, 70000, 3, 20, 150000, 0, 20, 9999])]
    connection = _Trickle()
    _send_batch(connection, [memoryview(b) if i % 2 else b for i, b in enumerate(buffers)])  # type: ignore[arg-type]
    assert bytes(connection.received) == b"".join(buffers)
    assert connection.calls == -(-sum(map(len, buffers)) // 777)


def test_pushes_to_one_holder_share_one_connection_and_a_holder_that_moved_gets_a_new_one(servers):
    """A push per step must not pay a connect, a handshake and a thread on the holder each time."""
    first, held_first = _holder(servers)
    second, held_second = _holder(servers)
    link = HolderLink(10.0, SECRET)
    for version in (1, 2, 3):
        link.push(first.address, 4, capture(make_state(seed=version), CLASSES, version=version), chunk_bytes=CHUNK, retries=0)
    assert [(src, version) for src, version, _ in held_first] == [(4, 1), (4, 2), (4, 3)]
    (first_conn,) = {thread for _, _, thread in held_first}
    # The buddy was re-paired (a migration): the old connection is closed, not left open beside the new one.
    link.push(second.address, 4, capture(make_state(seed=4), CLASSES, version=4), chunk_bytes=CHUNK, retries=0)
    assert [(src, version) for src, version, _ in held_second] == [(4, 4)]
    _until(lambda: not first_conn.is_alive(), "the connection to the first holder was left open")
    second_conn = held_second[0][2]
    assert second_conn.is_alive()
    link.close()
    _until(lambda: not second_conn.is_alive(), "close() left the connection open")


def test_a_failed_push_drops_the_connection_and_the_next_push_opens_a_new_one(servers):
    """The holder refuses one push (it has no slot for it) and takes the next, on a new connection."""
    held: list[tuple[int, threading.Thread]] = []
    refusals = [TransferError("no slot for this copy")]
    refused_on: list[threading.Thread] = []

    def hold_into(src, manifest):
        if refusals:
            refused_on.append(threading.current_thread())
            raise refusals.pop()
        return [torch.empty(e.shape, dtype=getattr(torch, e.dtype)) for e in manifest.entries]

    holder = servers(hold_into=hold_into, on_held=lambda src, captured: held.append((captured.manifest.version, threading.current_thread())))
    link = HolderLink(10.0, SECRET)
    with pytest.raises(TransferError, match="no slot for this copy"):
        link.push(holder.address, 2, capture(make_state(seed=1), CLASSES, version=1), chunk_bytes=CHUNK, retries=0)
    link.push(holder.address, 2, capture(make_state(seed=2), CLASSES, version=2), chunk_bytes=CHUNK, retries=0)
    link.push(holder.address, 2, capture(make_state(seed=3), CLASSES, version=3), chunk_bytes=CHUNK, retries=0)
    assert [version for version, _ in held] == [2, 3]
    assert held[0][1] is not refused_on[0], "the push after the failure went over the connection it failed on"
    assert held[0][1] is held[1][1], "the pushes after the failure did not share their new connection"
    link.close()


def test_a_pickle_that_would_run_code_is_never_loaded_even_from_a_peer_with_the_secret(servers, tmp_path):
    canary = tmp_path / "canary"

    class Hostile:
        def __reduce__(self):
            return (os.system, (f"touch {canary}",))

    server = servers(hold_into=lambda src, manifest: [], on_held=lambda src, captured: None)
    sock = socket.create_connection(server.address, timeout=10)
    with sock:
        handshake.connect(sock, SECRET)
        for body in (json.dumps({"op": "hold", "src": 1, "version": 1}).encode(), pickle.dumps(Hostile())):
            sock.sendall(len(body).to_bytes(8, "little") + body)
        reply = sock.recv(1 << 16)
    assert reply[8:10] == b"er" and b"cannot be loaded safely" in reply
    assert not canary.exists()


@pytest.mark.parametrize("chunk", [[9, 0, 4], [0, 79_999, 2], [0, 0, -1]])
def test_a_chunk_outside_the_manifest_is_refused(servers, chunk):
    server, captured = serve(servers, make_state())
    with socket.create_connection(server.address, timeout=10) as sock:
        handshake.connect(sock, SECRET)
        body = json.dumps({"op": "chunks", "copy": "live", "version": 5, "chunks": [chunk]}).encode()
        sock.sendall(len(body).to_bytes(8, "little") + body)
        header = sock.recv(8, socket.MSG_WAITALL)
        reply = sock.recv(int.from_bytes(header, "little"), socket.MSG_WAITALL)
    assert reply[:2] == b"er" and b"outside the manifest" in reply
    _, tensors, _ = fetch([server])
    assert_bitwise_equal(tensors, captured)


def test_an_oversized_length_allocates_nothing_and_the_server_goes_on(servers):
    server, captured = serve(servers, make_state())
    sock = socket.create_connection(server.address, timeout=10)
    with sock:
        handshake.connect(sock, SECRET)
        sock.sendall((1 << 62).to_bytes(8, "little"))
        assert _closed_without_a_reply(sock)
    _, tensors, _ = fetch([server])
    assert_bitwise_equal(tensors, captured)


@pytest.fixture(scope="module")
def stranger_target():
    server = StateServer(secret=SECRET)
    server.publish(capture(make_state(), CLASSES, version=5))
    yield server
    server.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(noise=st.binary(min_size=0, max_size=4096))
def test_random_bytes_at_the_port_leave_the_server_serving(stranger_target, noise):
    with _stranger(stranger_target) as sock:
        sock.recv(64)
        sock.sendall(noise)
        sock.shutdown(socket.SHUT_WR)
        assert _closed_without_a_reply(sock)
    assert stranger_target.served_bytes == 0
