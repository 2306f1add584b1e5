"""Mutual challenge-response under the job secret, at the start of every state-channel connection.

Steps (fixed-size messages, so nothing is allocated from a length a stranger sent):

1. the server sends a fresh 32-byte nonce ``Ns``;
2. the client sends its own nonce ``Nc`` and ``HMAC(secret, "client" | Ns | Nc)``;
3. the server checks it (in constant time) and, only then, answers
   ``HMAC(secret, "server" | Nc | Ns)``; a wrong proof closes the connection
   without a byte of state or a reply;
4. the client checks the server's proof before it sends a request or trusts a
   reply: a receiver never loads state from a process without the secret.

Fresh nonces on both sides mean a recorded exchange proves nothing on a new
connection, and the two proofs differ by role, so one cannot be reflected as
the other. The channel is authenticated, not encrypted: state crosses the
network in clear (the same as gloo's collectives), with per-chunk CRCs.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

__all__ = ["HandshakeError", "NONCE_BYTES", "HANDSHAKE_TIMEOUT_S", "accept", "connect"]

NONCE_BYTES = 32
_PROOF_BYTES = hashlib.sha256().digest_size
HANDSHAKE_TIMEOUT_S = 10.0
"""How long a server waits for a client's proof: a connection that says nothing is closed after this."""


class HandshakeError(ConnectionError):
    """The peer did not prove it holds the job secret (or went away mid-handshake)."""


def _proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, b"torchpass-channel/" + role + b"/" + first + second, hashlib.sha256).digest()


def _read(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise HandshakeError("the peer closed the connection during the handshake")
        data += chunk
    return bytes(data)


def accept(sock: socket.socket, secret: bytes) -> None:
    """Server side: returns once the client proved the secret; raises ``HandshakeError`` otherwise."""
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    previous = sock.gettimeout()
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        sock.sendall(server_nonce)
        answer = _read(sock, NONCE_BYTES + _PROOF_BYTES)
    except OSError as exc:
        raise HandshakeError(f"no proof from the client: {exc}") from None
    finally:
        sock.settimeout(previous)
    client_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _proof(secret, b"client", server_nonce, client_nonce)):
        raise HandshakeError("the client's proof does not match the job secret")
    sock.sendall(_proof(secret, b"server", client_nonce, server_nonce))


def connect(sock: socket.socket, secret: bytes) -> None:
    """Client side: returns once the server proved the secret; raises ``HandshakeError`` otherwise."""
    server_nonce = _read(sock, NONCE_BYTES)
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(client_nonce + _proof(secret, b"client", server_nonce, client_nonce))
    proof = _read(sock, _PROOF_BYTES)
    if not hmac.compare_digest(proof, _proof(secret, b"server", client_nonce, server_nonce)):
        raise HandshakeError("the server's proof does not match the job secret")
