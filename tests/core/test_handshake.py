"""The state channel's handshake: both ends prove the job secret; a stranger learns nothing and gets nothing."""

from __future__ import annotations

import socket
import threading

import pytest

from torchpass.core import handshake

SECRET = b"the-job-secret-0123456789"


def _pair(server_secret: bytes, client_secret: bytes) -> tuple[BaseException | None, BaseException | None]:
    a, b = socket.socketpair()
    outcome: dict[str, BaseException | None] = {"server": None, "client": None}

    def serve() -> None:
        try:
            handshake.accept(a, server_secret)
        except BaseException as exc:
            outcome["server"] = exc
            a.close()  # what the state server does: the connection ends here

    t = threading.Thread(target=serve)
    t.start()
    try:
        handshake.connect(b, client_secret)
    except BaseException as exc:
        outcome["client"] = exc
    t.join(timeout=20)
    b.close()
    return outcome["server"], outcome["client"]


def test_both_ends_holding_the_secret_connect():
    assert _pair(SECRET, SECRET) == (None, None)


def test_a_client_without_the_secret_is_refused_and_gets_no_answer():
    server, client = _pair(SECRET, b"a-guess-of-the-secret-0000")
    assert isinstance(server, handshake.HandshakeError) and "client's proof" in str(server)
    assert isinstance(client, handshake.HandshakeError)  # the server closed without proving anything


def test_a_server_without_the_secret_is_not_trusted():
    a, b = socket.socketpair()
    # An impostor replays the expected framing with a proof made under another key.
    impostor = threading.Thread(target=lambda: _impostor(a))
    impostor.start()
    with pytest.raises(handshake.HandshakeError, match="server's proof"):
        handshake.connect(b, SECRET)
    impostor.join()
    a.close()
    b.close()


def _impostor(sock: socket.socket) -> None:
    sock.sendall(b"\1" * handshake.NONCE_BYTES)
    sock.recv(1024)
    sock.sendall(b"\2" * 32)


def test_a_silent_client_is_dropped_after_the_handshake_timeout(monkeypatch):
    monkeypatch.setattr(handshake, "HANDSHAKE_TIMEOUT_S", 0.2)
    a, b = socket.socketpair()
    with pytest.raises(handshake.HandshakeError, match="no proof"):
        handshake.accept(a, SECRET)
    a.close()
    b.close()
