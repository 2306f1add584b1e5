"""A c10d store on an etcd cluster: the control plane without a single point of failure.

:class:`EtcdStore` is a ``torch.distributed.Store``, so everything that takes
the job's store (torchpass's control plane through
:class:`~torchpass.core.signed_store.SignedStore`, ``PrefixStore``, the
rendezvous of rebuilt gloo groups) takes it unchanged, and the same contract
tests run against it and the embedded ``TCPStore``
(``tests/core/test_store_contract.py``). It talks to etcd's v3 JSON gateway
through ``etcd3gw`` (OpenStack's maintained client); every key lives under
one prefix per job, so jobs share a cluster without seeing each other's keys.

How each store operation maps onto etcd, and why it is safe under concurrency:

* ``set``/``get``/``check``/``delete_key``: one put, range or delete;
  ``multi_get``/``multi_set``: one transaction per ``MAX_TXN_OPS`` keys, so a reader
  never sees half of a write of that many;
* ``add``: a read, then a transaction that writes ``value + amount`` only if
  the key's ``mod_revision`` is still the one read (``create_revision == 0``
  for a key that did not exist), retried until it commits: no lost update;
  ``add(key, 0)``, a counter's read, is the read alone;
* ``compare_set``: one transaction comparing the value (or that the key does
  not exist, for an empty ``expected``), with c10d's answer: the value after
  the operation, or ``expected`` for a missing key that was not created;
* ``wait``: a range over the missing keys, then a watch from the revision
  after that read, so a key written between the two is never missed.

A store made by :meth:`EtcdStore.guarded` writes only while a guard key still
has the create revision it was given (one comparison more in every write's
transaction): the controller's fencing token (``core/controller_election.py``).
When the guard has changed, the write is not made and :class:`GuardLost` is
raised, so a controller that lost its lease cannot act after another took over.

Endpoints: a client talks to one member and moves to the next when that one
does not answer (refused, reset, timed out); an operation fails, naming every
endpoint tried, only when no member answers. etcd's own consistency (reads
and writes go through the raft leader) makes every member's answer the same.
"""

from __future__ import annotations

import base64
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qsl, urlsplit

import torch.distributed as dist

__all__ = ["DEFAULT_PREFIX", "EtcdStore", "EtcdTarget", "GuardLost", "job_url", "parse_etcd_url", "shown_url"]

DEFAULT_PREFIX = "/torchpass"
"""Where jobs' keys live when the URL names no path."""



_TOKEN_REFUSED = re.compile(r"auth token|user name is empty")
"""etcd's answers to a request whose token the member does not hold (it was issued elsewhere, or expired)."""

MAX_TXN_OPS = 128
"""Operations per etcd transaction: etcd's default ``--max-txn-ops``, which refuses larger ones. Longer
``multi_get``/``multi_set``/``check`` requests are split; each part is atomic, the whole is not (no caller of a
large one needs it: the members' records it reads were each written whole)."""

_REQUEST_TIMEOUT_S = 10.0
"""Longest wait for one member's answer before the next member is asked: a stopped member costs at most this."""

_WATCH_SLICE_S = 1.0
"""Longest single watch: a wait re-reads its keys this often, so a watch lost with its member costs at most this."""


@dataclass(frozen=True)
class EtcdTarget:
    """Where the job's etcd cluster is, how to reach it and where its keys live: one URL carries it all
    (``--store``, and the environment each worker gets), so every process reads the same fact."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str = DEFAULT_PREFIX
    """The keys' prefix: the URL's path (the launcher appends the job's id, so jobs never share keys)."""
    protocol: str = "http"
    """``https`` for a TLS cluster (``etcds://`` in the URL)."""
    ca_cert: str | None = None
    """``?cacert=``: the CA bundle that signed the members' certificates (etcdctl's ``--cacert``)."""
    cert_cert: str | None = None
    """``?cert=``: this client's certificate, for clusters that authenticate clients (``--cert``)."""
    cert_key: str | None = None
    """``?key=``: that certificate's key (``--key``)."""
    user: str | None = None
    """The URL's user (``etcd://NAME@host:2379``): for a cluster with authentication enabled (etcdctl's ``--user``)."""
    password_file: str | None = None
    """``?password-file=``: a file holding that user's password (never the URL itself: it shows in ``ps``)."""


_TLS_QUERY = ("cacert", "cert", "key")
_QUERY = (*_TLS_QUERY, "password-file")


def parse_etcd_url(url: str) -> EtcdTarget:
    """``etcd://[USER@]h1:2379,h2:2379[/prefix][?password-file=F]`` or ``etcds://...?cacert=F&cert=F&key=F`` ->
    :class:`EtcdTarget`; ValueError naming the bad part."""
    parts = urlsplit(url)
    if parts.scheme not in ("etcd", "etcds"):
        raise ValueError(f"--store {shown_url(url)!r}: expected etcd://HOST:PORT[,HOST:PORT...][/PREFIX] or etcds://... for TLS")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if ":" in userinfo:
        raise ValueError(
            f"--store {shown_url(url)!r}: a password in the URL would show in `ps` and in the run directory; "
            "write it to a file readable only by you and give ?password-file=FILE"
        )
    endpoints = []
    for item in filter(None, hosts.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--store {url!r}: endpoint {item!r} is not HOST:PORT")
        endpoints.append((host.strip("[]"), int(port)))
    if not endpoints:
        raise ValueError(f"--store {url!r}: no endpoint given")
    query = dict(parse_qsl(parts.query))
    unknown = sorted(set(query) - set(_QUERY))
    if unknown:
        raise ValueError(f"--store {url!r}: unknown option(s) {unknown}; valid: {list(_QUERY)}")
    if set(query) & set(_TLS_QUERY) and parts.scheme != "etcds":
        raise ValueError(f"--store {url!r}: TLS options need etcds://")
    if bool(userinfo) != ("password-file" in query):
        raise ValueError(f"--store {url!r}: a user (etcd://USER@HOST:PORT) and ?password-file=FILE go together")
    return EtcdTarget(
        tuple(endpoints),
        prefix=parts.path.rstrip("/") or DEFAULT_PREFIX,
        protocol="https" if parts.scheme == "etcds" else "http",
        ca_cert=query.get("cacert"),
        cert_cert=query.get("cert"),
        cert_key=query.get("key"),
        user=userinfo or None,
        password_file=query.get("password-file"),
    )


def shown_url(url: str) -> str:
    """``url`` for logs: endpoints and prefix, without the TLS file options."""
    return url.split("?", 1)[0]


def _password(target: EtcdTarget) -> str:
    assert target.password_file is not None
    try:
        return Path(target.password_file).read_text().rstrip("\n")
    except OSError as exc:
        raise dist.DistStoreError(f"etcd store: cannot read the password of user {target.user!r} from {target.password_file}: {exc}") from None


def job_url(url: str, job_id: str) -> str:
    """The store URL of one job: ``url`` with the job's id appended to its prefix."""
    parts = urlsplit(url)
    path = (parts.path.rstrip("/") or DEFAULT_PREFIX) + "/" + job_id
    return parts._replace(path=path).geturl()


class GuardLost(dist.DistStoreError):
    """A guarded store's write refused: its guard key no longer has the create revision it was given."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` whose keys are etcd keys under ``prefix`` (see the module docstring)."""

    def __init__(self, target: EtcdTarget, timeout: timedelta = timedelta(seconds=300), guard: tuple[str, int] | None = None):
        super().__init__()
        import etcd3gw  # the etcd extra: imported only by jobs that name an etcd store

        self._etcd3gw = etcd3gw
        self._target = target
        self._prefix = target.prefix.rstrip("/") + "/"
        self._timeout = timeout
        self._guard = guard
        """(key, create revision) every write of this store compares first; None: unguarded."""
        self._clients = [
            etcd3gw.client(
                host=host,
                port=port,
                protocol=target.protocol,
                ca_cert=target.ca_cert,
                cert_cert=target.cert_cert,
                cert_key=target.cert_key,
                timeout=_REQUEST_TIMEOUT_S,
                api_path="/v3/",
            )
            for host, port in target.endpoints
        ]
        self._current = 0
        self._password = _password(target) if target.user else None
        self._authenticated: set[int] = set()
        """Members (client indices) whose session carries a token: etcd's tokens are per member."""

    def guarded(self, key: str, create_revision: int) -> "EtcdStore":
        """A store on the same cluster and prefix whose writes commit only while ``key`` has ``create_revision``."""
        return EtcdStore(self._target, self._timeout, (key, create_revision))

    # ---- transport --------------------------------------------------------------------
    def _call(self, op: Callable[[Any], Any]) -> Any:
        """Run ``op(client)`` on the current member, moving to the next one that answers."""
        errors = []
        gone = self._etcd3gw.exceptions
        for attempt in range(len(self._clients)):
            index = (self._current + attempt) % len(self._clients)
            client = self._clients[index]
            try:
                if self._password is not None and index not in self._authenticated:
                    self._authenticate(index)
                try:
                    result = op(client)
                except gone.Etcd3Exception as exc:
                    if self._password is None or not _TOKEN_REFUSED.search(exc.detail_text or ""):
                        raise
                    # The member forgot the token (restarted, or its TTL ran out while the job was quiet): a new one.
                    self._authenticate(index)
                    result = op(client)
            except (gone.ConnectionFailedError, gone.ConnectionTimeoutError, gone.InternalServerError) as exc:
                # Down, cut off, or without a leader for now (etcd answers 500 during an election): the next member.
                errors.append(f"{client.host}:{client.port}: {type(exc).__name__}")
                continue
            except gone.Etcd3Exception as exc:
                raise dist.DistStoreError(f"etcd store at {client.host}:{client.port}: {type(exc).__name__}: {exc.detail_text}") from exc
            self._current = (self._current + attempt) % len(self._clients)
            return result
        raise dist.DistNetworkError(f"etcd store: no member answered ({'; '.join(errors)})")

    def _authenticate(self, index: int) -> None:
        client = self._clients[index]
        client.session.headers.pop("Authorization", None)
        try:
            result = client.post(client.get_url("/auth/authenticate"), json={"name": self._target.user, "password": self._password})
        except self._etcd3gw.exceptions.Etcd3Exception as exc:
            if isinstance(exc, (self._etcd3gw.exceptions.ConnectionFailedError, self._etcd3gw.exceptions.ConnectionTimeoutError)):
                raise
            raise dist.DistStoreError(
                f"etcd store at {client.host}:{client.port}: user {self._target.user!r} could not log in "
                f"(password from {self._target.password_file}): {exc.detail_text}"
            ) from None
        client.session.headers["Authorization"] = result["token"]
        self._authenticated.add(index)

    def _txn(self, txn: dict[str, Any]) -> dict[str, Any]:
        return self._call(lambda c: c.transaction(txn))

    def _write(self, compare: list[dict[str, Any]], success: list[dict[str, Any]], failure: list[dict[str, Any]]) -> dict[str, Any]:
        """One write transaction, with the guard's comparison first when this store has one (GuardLost if it fails)."""
        if self._guard is None:
            return self._txn({"compare": compare, "success": success, "failure": failure})
        key, revision = self._guard
        guard = {"key": self._key(key), "result": "EQUAL", "target": "CREATE", "create_revision": str(revision)}
        result = self._txn({"compare": [guard, *compare], "success": success, "failure": failure})
        if not result.get("succeeded") and self.create_revision(key) != revision:
            raise GuardLost(f"etcd store: {self._prefix + key} is no longer the one created at revision {revision}; write refused")
        return result

    def create_revision(self, key: str) -> int:
        """The revision at which ``key`` was created (0: it does not exist)."""
        result = self._call(lambda c: c.post(c.get_url("/kv/range"), json={"key": self._key(key)}))
        kvs = result.get("kvs", [])
        return int(kvs[0]["create_revision"]) if kvs else 0

    def create(self, key: str, value: bytes | str, lease: int) -> int:
        """Create ``key`` attached to ``lease`` if it does not exist; its create revision, or 0 if it existed."""
        absent = {"key": self._key(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        put = {"request_put": {"key": self._key(key), "value": _b64(_bytes(value)), "lease": str(lease)}}
        result = self._txn({"compare": [absent], "success": [put], "failure": []})
        return int(result["header"]["revision"]) if result.get("succeeded") else 0

    def grant_lease(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds (etcd may grant more: its minimum); returns its id."""
        result = self._call(lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": ttl_s, "ID": 0}))
        return int(result["ID"])

    def refresh_lease(self, lease: int) -> int:
        """Renew ``lease``: its TTL in seconds, or -1 when it has expired already."""
        result = self._call(lambda c: c.post(c.get_url("/lease/keepalive"), json={"ID": lease}))
        return int(result.get("result", {}).get("TTL", -1))

    def revoke_lease(self, lease: int) -> None:
        """End ``lease`` now: the keys attached to it are deleted."""
        self._call(lambda c: c.post(c.get_url("/kv/lease/revoke"), json={"ID": lease}))

    def _key(self, key: str) -> str:
        return _b64((self._prefix + key).encode())

    def _range(self, keys: list[str]) -> tuple[dict[str, bytes], int]:
        """The present ``keys``' values, and the store's revision at the first of the reads (one per
        ``MAX_TXN_OPS`` keys): a watch from the revision after it misses no write made since."""
        values = {}
        revision = None
        for i in range(0, max(len(keys), 1), MAX_TXN_OPS):
            chunk = keys[i : i + MAX_TXN_OPS]
            result = self._txn({"compare": [], "success": [{"request_range": {"key": self._key(k)}} for k in chunk], "failure": []})
            for key, response in zip(chunk, result.get("responses", [])):
                kvs = response.get("response_range", {}).get("kvs", [])
                if kvs:
                    values[key] = base64.b64decode(kvs[0].get("value", ""))
            revision = int(result["header"]["revision"]) if revision is None else revision
        assert revision is not None
        return values, revision

    # ---- the c10d store API -----------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        if self._guard is None:
            self._call(lambda c: c.post(c.get_url("/kv/put"), json={"key": self._key(key), "value": _b64(_bytes(value))}))
        else:
            self._write([], [{"request_put": {"key": self._key(key), "value": _b64(_bytes(value))}}], [])

    def get(self, key: str) -> bytes:
        return self._await([key], None)[key]

    def check(self, keys: list[str]) -> bool:
        return len(self._range(list(keys))[0]) == len(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._await(list(keys), None)
        return [values[k] for k in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        puts = [{"request_put": {"key": self._key(k), "value": _b64(_bytes(v))}} for k, v in zip(keys, values)]
        for i in range(0, len(puts), MAX_TXN_OPS):
            self._write([], puts[i : i + MAX_TXN_OPS], [])

    def add(self, key: str, amount: int) -> int:
        while True:
            result = self._call(lambda c: c.post(c.get_url("/kv/range"), json={"key": self._key(key)}))
            kvs = result.get("kvs", [])
            if amount == 0:
                # A read of a counter (a mailbox's length, every tick of every reader): nothing to write. c10d
                # creates a missing key as 0; a reader that is told 0 behaves the same without it.
                return int(base64.b64decode(kvs[0].get("value", "")) or b"0") if kvs else 0
            if kvs:
                current = int(base64.b64decode(kvs[0].get("value", "")) or b"0")
                guard = {"key": self._key(key), "result": "EQUAL", "target": "MOD", "mod_revision": kvs[0]["mod_revision"]}
            else:
                current = 0
                guard = {"key": self._key(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
            new = current + amount
            put = {"request_put": {"key": self._key(key), "value": _b64(str(new).encode())}}
            if self._write([guard], [put], []).get("succeeded"):
                return new

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        expected_b, desired_b = _bytes(expected), _bytes(desired)
        if expected_b:
            guard = {"key": self._key(key), "result": "EQUAL", "target": "VALUE", "value": _b64(expected_b)}
        else:
            guard = {"key": self._key(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        result = self._write(
            [guard], [{"request_put": {"key": self._key(key), "value": _b64(desired_b)}}], [{"request_range": {"key": self._key(key)}}]
        )
        if result.get("succeeded"):
            return desired_b
        kvs = result["responses"][0].get("response_range", {}).get("kvs", [])
        return base64.b64decode(kvs[0].get("value", "")) if kvs else expected_b

    def delete_key(self, key: str) -> bool:
        if self._guard is None:
            result = self._call(lambda c: c.post(c.get_url("/kv/deleterange"), json={"key": self._key(key)}))
            return int(result.get("deleted", 0)) > 0
        result = self._write([], [{"request_delete_range": {"key": self._key(key)}}], [])
        return int(result["responses"][0].get("response_delete_range", {}).get("deleted", 0)) > 0

    def _whole_prefix(self) -> dict[str, str]:
        prefix = self._prefix.encode()
        return {"key": _b64(prefix), "range_end": _b64(prefix[:-1] + bytes([prefix[-1] + 1]))}

    def num_keys(self) -> int:
        result = self._call(lambda c: c.post(c.get_url("/kv/range"), json={**self._whole_prefix(), "count_only": True}))
        return int(result.get("count", 0))

    def delete_prefix(self) -> int:
        """Delete every key of this store (the job's, at its end); returns how many there were."""
        result = self._call(lambda c: c.post(c.get_url("/kv/deleterange"), json=self._whole_prefix()))
        return int(result.get("deleted", 0))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._await(list(keys), timeout)

    def _await(self, keys: list[str], timeout: timedelta | None) -> dict[str, bytes]:
        """The values of ``keys`` once all exist: one read when they do already."""
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        while True:
            present, revision = self._range(keys)
            missing = [k for k in keys if k not in present]
            if not missing:
                return present
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"etcd store: wait timeout after {limit * 1000:.0f}ms, keys: {missing}")
            client = self._clients[self._current]
            try:
                client.watch_once(self._prefix + missing[0], timeout=min(left, _WATCH_SLICE_S), start_revision=revision + 1)
            except self._etcd3gw.exceptions.WatchTimedOut:
                pass  # re-read: the slice bounds a watch lost with its member
            except (self._etcd3gw.exceptions.ConnectionFailedError, self._etcd3gw.exceptions.ConnectionTimeoutError):
                self._current = (self._current + 1) % len(self._clients)
