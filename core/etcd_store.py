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
  ``multi_get``/``multi_set``: one transaction, so a reader never sees half;
* ``add``: a read, then a transaction that writes ``value + amount`` only if
  the key's ``mod_revision`` is still the one read (``create_revision == 0``
  for a key that did not exist), retried until it commits: no lost update;
* ``compare_set``: one transaction comparing the value (or that the key does
  not exist, for an empty ``expected``), with c10d's answer: the value after
  the operation, or ``expected`` for a missing key that was not created;
* ``wait``: a range over the missing keys, then a watch from the revision
  after that read, so a key written between the two is never missed.

Endpoints: a client talks to one member and moves to the next when that one
does not answer (refused, reset, timed out); an operation fails, naming every
endpoint tried, only when no member answers. etcd's own consistency (reads
and writes go through the raft leader) makes every member's answer the same.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable
from urllib.parse import parse_qsl, urlsplit

import torch.distributed as dist

__all__ = ["DEFAULT_PREFIX", "EtcdStore", "EtcdTarget", "job_url", "parse_etcd_url", "shown_url"]

DEFAULT_PREFIX = "/torchpass"
"""Where jobs' keys live when the URL names no path."""



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


_TLS_QUERY = ("cacert", "cert", "key")


def parse_etcd_url(url: str) -> EtcdTarget:
    """``etcd://h1:2379,h2:2379[/prefix]`` or ``etcds://...?cacert=F&cert=F&key=F`` -> :class:`EtcdTarget`;
    ValueError naming the bad part."""
    parts = urlsplit(url)
    if parts.scheme not in ("etcd", "etcds"):
        raise ValueError(f"--store {url!r}: expected etcd://HOST:PORT[,HOST:PORT...][/PREFIX] or etcds://... for TLS")
    endpoints = []
    for item in filter(None, parts.netloc.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--store {url!r}: endpoint {item!r} is not HOST:PORT")
        endpoints.append((host.strip("[]"), int(port)))
    if not endpoints:
        raise ValueError(f"--store {url!r}: no endpoint given")
    query = dict(parse_qsl(parts.query))
    unknown = sorted(set(query) - set(_TLS_QUERY))
    if unknown:
        raise ValueError(f"--store {url!r}: unknown option(s) {unknown}; valid: {list(_TLS_QUERY)}")
    if query and parts.scheme != "etcds":
        raise ValueError(f"--store {url!r}: TLS options need etcds://")
    return EtcdTarget(
        tuple(endpoints),
        prefix=parts.path.rstrip("/") or DEFAULT_PREFIX,
        protocol="https" if parts.scheme == "etcds" else "http",
        ca_cert=query.get("cacert"),
        cert_cert=query.get("cert"),
        cert_key=query.get("key"),
    )


def shown_url(url: str) -> str:
    """``url`` for logs: endpoints and prefix, without the TLS file options."""
    return url.split("?", 1)[0]


def job_url(url: str, job_id: str) -> str:
    """The store URL of one job: ``url`` with the job's id appended to its prefix."""
    parts = urlsplit(url)
    path = (parts.path.rstrip("/") or DEFAULT_PREFIX) + "/" + job_id
    return parts._replace(path=path).geturl()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` whose keys are etcd keys under ``prefix`` (see the module docstring)."""

    def __init__(self, target: EtcdTarget, timeout: timedelta = timedelta(seconds=300)):
        super().__init__()
        import etcd3gw  # the etcd extra: imported only by jobs that name an etcd store

        self._etcd3gw = etcd3gw
        self._prefix = target.prefix.rstrip("/") + "/"
        self._timeout = timeout
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

    # ---- transport --------------------------------------------------------------------
    def _call(self, op: Callable[[Any], Any]) -> Any:
        """Run ``op(client)`` on the current member, moving to the next one that answers."""
        errors = []
        gone = self._etcd3gw.exceptions
        for attempt in range(len(self._clients)):
            client = self._clients[(self._current + attempt) % len(self._clients)]
            try:
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

    def _txn(self, txn: dict[str, Any]) -> dict[str, Any]:
        return self._call(lambda c: c.transaction(txn))

    def _key(self, key: str) -> str:
        return _b64((self._prefix + key).encode())

    def _range(self, keys: list[str]) -> tuple[dict[str, bytes], int]:
        """The present ``keys``' values, and the store's revision at that read."""
        result = self._txn({"compare": [], "success": [{"request_range": {"key": self._key(k)}} for k in keys], "failure": []})
        values = {}
        for key, response in zip(keys, result.get("responses", [])):
            kvs = response.get("response_range", {}).get("kvs", [])
            if kvs:
                values[key] = base64.b64decode(kvs[0].get("value", ""))
        return values, int(result["header"]["revision"])

    # ---- the c10d store API -----------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._call(lambda c: c.post(c.get_url("/kv/put"), json={"key": self._key(key), "value": _b64(_bytes(value))}))

    def get(self, key: str) -> bytes:
        return self._await([key], None)[key]

    def check(self, keys: list[str]) -> bool:
        return len(self._range(list(keys))[0]) == len(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._await(list(keys), None)
        return [values[k] for k in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        puts = [{"request_put": {"key": self._key(k), "value": _b64(_bytes(v))}} for k, v in zip(keys, values)]
        self._txn({"compare": [], "success": puts, "failure": []})

    def add(self, key: str, amount: int) -> int:
        while True:
            result = self._call(lambda c: c.post(c.get_url("/kv/range"), json={"key": self._key(key)}))
            kvs = result.get("kvs", [])
            if kvs:
                current = int(base64.b64decode(kvs[0].get("value", "")) or b"0")
                guard = {"key": self._key(key), "result": "EQUAL", "target": "MOD", "mod_revision": kvs[0]["mod_revision"]}
            else:
                current = 0
                guard = {"key": self._key(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
            new = current + amount
            put = {"request_put": {"key": self._key(key), "value": _b64(str(new).encode())}}
            if self._txn({"compare": [guard], "success": [put], "failure": []}).get("succeeded"):
                return new

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        expected_b, desired_b = _bytes(expected), _bytes(desired)
        if expected_b:
            guard = {"key": self._key(key), "result": "EQUAL", "target": "VALUE", "value": _b64(expected_b)}
        else:
            guard = {"key": self._key(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        result = self._txn(
            {
                "compare": [guard],
                "success": [{"request_put": {"key": self._key(key), "value": _b64(desired_b)}}],
                "failure": [{"request_range": {"key": self._key(key)}}],
            }
        )
        if result.get("succeeded"):
            return desired_b
        kvs = result["responses"][0].get("response_range", {}).get("kvs", [])
        return base64.b64decode(kvs[0].get("value", "")) if kvs else expected_b

    def delete_key(self, key: str) -> bool:
        result = self._call(lambda c: c.post(c.get_url("/kv/deleterange"), json={"key": self._key(key)}))
        return int(result.get("deleted", 0)) > 0

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
