"""The control plane: key layout on the c10d store and the records exchanged through it.

Everything torchpass coordinates goes through one ``torch.distributed.TCPStore``
hosted by node 0's launcher; there is no other RPC or consensus layer. Every
process reads and writes it through :class:`~torchpass.core.signed_store.SignedStore`:
a value not sealed under the job secret is, to torchpass, not there. Writers
and readers by key (``tp/`` prefix omitted):

==========================  ===================  =====================================
key                         written by           read by
==========================  ===================  =====================================
``job``                     controller           agents, workers (job shape, config; ranks per node)
``workers/<wid>``           worker, controller   controller, ``torchpass status``
``hb/<wid>``                worker heartbeat     agents (liveness), controller (progress)
``events/seq``, ``/<n>``    agents, workers      controller (a mailbox: add, then set)
``gen``                     controller           workers, status
``g/<g>/end``               controller, worker   workers' monitor threads (ends gen g)
``g/<g>/status/<rank>``     survivors            controller (version, clean, address)
``g/<g>/plan``              controller           members of generation g (and its placement)
``g/<g>/ready/<rank>``      members              controller (``Ready``, the writer's wid)
``g/<g>/go``                controller           members ("go" or "abort: ...")
``g/<g>/done/<rank>``       members              controller (timings after resuming)
``g/<g>/<what>_count``      members              controller (one read instead of one per member)
``assign/<wid>``            controller           a spare (its rank, or an order to exit)
``mirror/<rank>/<slot>``    each rank            planner (RNG/data position, one slot per version)
``rankinfo/<rank>``         each rank            the rank that sends it buddy copies (address)
``node/<n>/mail/...``       controller           agent n (fence a worker)
``node/<n>/beat``           agent n              controller (node liveness, a counter)
``node/<n>/lost``           controller           agent n (declared lost: fence all, exit)
``shutdown``                controller           agents, spares
==========================  ===================  =====================================

Records are dataclasses serialized as JSON. Blocking reads use ``store.wait``
on a key that is always eventually written (a generation's ``end`` is set when
the job finishes too), so no thread polls the store in a loop.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, TypeVar

import torch.distributed as dist

from . import safe_pickle
from .signed_store import FORGED, SignedStore

__all__ = [
    "Keys",
    "WorkerRecord",
    "Heartbeat",
    "Report",
    "Status",
    "Plan",
    "Ready",
    "RankPlan",
    "Mailbox",
    "put",
    "get",
    "get_if_present",
    "try_get",
    "StoreAddress",
    "signed",
]

T = TypeVar("T")
PREFIX = "tp/"


class Keys:
    """Key names, in one place so writers and readers cannot drift apart."""

    job = PREFIX + "job"
    config = PREFIX + "config"
    state_bytes = PREFIX + "state_bytes"
    gen = PREFIX + "gen"
    shutdown = PREFIX + "shutdown"
    outcome = PREFIX + "outcome"
    events = PREFIX + "events"
    controller = PREFIX + "controller/lease"
    """Held by the launcher that runs the controller, on an etcd store (``core/controller_election.py``)."""
    controller_state = PREFIX + "controller/state"
    """What a controller taking over needs (``Controller.snapshot``), rewritten when it changes."""

    @staticmethod
    def controller_records(node: int) -> str:
        """The controller's records of node n's processes, for a successor: rewritten when one of them changes."""
        return f"{PREFIX}controller/records/{node}"

    @staticmethod
    def worker(wid: str) -> str:
        return f"{PREFIX}workers/{wid}"

    @staticmethod
    def heartbeat(wid: str) -> str:
        return f"{PREFIX}hb/{wid}"

    @staticmethod
    def end(g: int) -> str:
        return f"{PREFIX}g/{g}/end"

    @staticmethod
    def status(g: int, rank: int) -> str:
        return f"{PREFIX}g/{g}/status/{rank}"

    @staticmethod
    def plan(g: int) -> str:
        return f"{PREFIX}g/{g}/plan"

    @staticmethod
    def count(g: int, what: str) -> str:
        """A counter members bump after writing their ``what`` key (status, ready, done) in generation g."""
        return f"{PREFIX}g/{g}/{what}_count"

    @staticmethod
    def ready(g: int, rank: int) -> str:
        return f"{PREFIX}g/{g}/ready/{rank}"

    @staticmethod
    def go(g: int) -> str:
        return f"{PREFIX}g/{g}/go"

    @staticmethod
    def done(g: int, rank: int) -> str:
        return f"{PREFIX}g/{g}/done/{rank}"

    @staticmethod
    def assign(wid: str) -> str:
        return f"{PREFIX}assign/{wid}"

    @staticmethod
    def rankinfo(rank: int) -> str:
        return f"{PREFIX}rankinfo/{rank}"

    @staticmethod
    def mirror(rank: int, slot: int) -> str:
        return f"{PREFIX}mirror/{rank}/{slot}"

    @staticmethod
    def node_mail(node: int) -> str:
        return f"{PREFIX}node/{node}/mail"

    @staticmethod
    def node_beat(node: int) -> str:
        """Agent n's heartbeat: a counter (``core/liveness.py``: never a time another host compares)."""
        return f"{PREFIX}node/{node}/beat"

    @staticmethod
    def node_lost(node: int) -> str:
        """Set by the controller when it declares node n lost: agent n must kill its workers and exit."""
        return f"{PREFIX}node/{node}/lost"


def _to_json(record: Any) -> bytes:
    return json.dumps(dataclasses.asdict(record) if dataclasses.is_dataclass(record) else record).encode()


def _from_json(cls: type[T], raw: bytes) -> T:
    data = json.loads(raw)
    if (dataclasses.is_dataclass(cls) or cls is dict) and not isinstance(data, dict):
        raise TypeError(f"expected a JSON object, got {type(data).__name__}")
    return cls(**data) if dataclasses.is_dataclass(cls) else data


def put(store: dist.Store, key: str, record: Any) -> None:
    store.set(key, _to_json(record))


def get(store: dist.Store, key: str, cls: type[T], timeout: float | None = None) -> T:
    """Blocking read: waits (server side, no polling) until ``key`` exists."""
    if timeout is not None:
        store.wait([key], timedelta(seconds=timeout))
    return _from_json(cls, store.get(key))


def put_counted(store: dist.Store, g: int, what: str, key: str, record: Any) -> None:
    """Write a member's record, then bump the generation's counter of such records."""
    put(store, key, record)
    store.add(Keys.count(g, what), 1)


STORE_BATCH = 512
"""Keys per multi-key store request. The TCPStore server handles one large request in superlinear time
(measured: a ``multi_get`` of 16,384 keys took 1.0 s in one request, 0.19 s in requests of 256 keys)."""


def check_all(store: dist.Store, keys: list[str]) -> bool:
    """Whether every key exists, in ``len(keys) / STORE_BATCH`` requests."""
    return all(store.check(keys[i : i + STORE_BATCH]) for i in range(0, len(keys), STORE_BATCH))


def multi_get(store: dist.Store, keys: list[str]) -> list[bytes]:
    """The values of keys that all exist, in ``len(keys) / STORE_BATCH`` requests."""
    values: list[bytes] = []
    for i in range(0, len(keys), STORE_BATCH):
        values += store.multi_get(keys[i : i + STORE_BATCH])
    return values


def gather(store: dist.Store, keys: list[str], cls: type[T]) -> list[T]:
    """Read many JSON records in few round trips (all keys must exist)."""
    if not keys:
        return []
    # One parse of all records as a JSON array: a parse per record costs more than the records.
    records = json.loads(b"[" + b",".join(multi_get(store, keys)) + b"]")
    return [cls(**data) for data in records] if dataclasses.is_dataclass(cls) else records


def present(store: dist.Store, g: int, what: str, keys: list[str]) -> bool:
    """Whether every key exists: the counter first (one operation), then a check of all keys."""
    return store.add(Keys.count(g, what), 0) >= len(keys) and check_all(store, keys)


def get_if_present(store: dist.Store, key: str) -> bytes | None:
    """The value of ``key``, or None if it has none (on a signed store: none that opens)."""
    if isinstance(store, SignedStore):
        return store.get_if_present(key)
    return store.get(key) if store.check([key]) else None


def try_get(store: dist.Store, key: str, cls: type[T]) -> T | None:
    raw = get_if_present(store, key)
    return None if raw is None else _from_json(cls, raw)


def worker_id(node: int, spare: bool, index: int) -> str:
    """The id an agent gives a process it starts: ``n<node>-a<i>`` for active slot i, ``n<node>-s<j>`` for spare j."""
    return f"n{node}-{'s' if spare else 'a'}{index}"


@dataclass(frozen=True)
class StoreAddress:
    """Where the control-plane store is, and the secret every value in it is sealed with."""

    host: str
    port: int
    secret: bytes = field(repr=False)
    """The job secret (``core/job_secret.py``); kept out of ``repr`` so it never reaches a log."""
    etcd: str | None = None
    """The job's etcd URL (``core/etcd_store.py``) when the control plane is on etcd; ``host:port`` is then
    node 0's TCPStore, which only the workers' set-up uses (``init_process_group``'s default store)."""

    def connect(self, timeout: float = 300.0) -> SignedStore:
        """A client connection (one per thread: clients are not thread-safe), sealing and opening every value."""
        if self.etcd is not None:
            from .etcd_store import EtcdStore, parse_etcd_url

            base: dist.Store = EtcdStore(parse_etcd_url(self.etcd), timedelta(seconds=timeout))
        else:
            base = dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)
        return signed(base, self.secret, timedelta(seconds=timeout))

    def describe(self) -> str:
        """Where the store is, for messages (no TLS file names)."""
        if self.etcd is not None:
            from .etcd_store import shown_url

            return shown_url(self.etcd)
        return f"{self.host}:{self.port}"

    def silence_means(self) -> str:
        """What a store that stopped answering means, for messages."""
        return "no member of the etcd cluster answers" if self.etcd is not None else "node 0 is gone"


_forged_reported = False


def _report_forged(key: str) -> None:
    # Once per process: a stranger writing many keys must not flood the log (SignedStore counts them all).
    global _forged_reported
    if not _forged_reported:
        _forged_reported = True
        print(f"[torchpass] the store holds a value at {key!r} not sealed with this job's secret: ignored", flush=True)


def signed(base: dist.Store, secret: bytes, timeout: timedelta) -> SignedStore:
    """``base`` behind the job secret (every torchpass process reads and writes the store through this)."""
    store = SignedStore(base, secret, _report_forged)
    store.set_timeout(timeout)
    return store


@dataclass
class WorkerRecord:
    """One process of the job, as ``workers.json`` and ``torchpass status`` show it."""

    wid: str
    node: int
    pid: int
    role: str
    """``active``, ``spare``, ``retired`` (handed its rank over, or a spare of a draining node), ``lost`` or ``finished``."""
    rank: int | None = None
    generation: int = 0
    transfer_addr: list[Any] | None = None


@dataclass
class Heartbeat:
    t: float
    """The writer's wall clock: for reports only. Liveness is judged by ``seq`` changing (``core/liveness.py``)."""
    step: int
    generation: int
    phase: str
    """``setup``, ``spare``, ``train``, ``recover`` or ``done``."""
    seq: int = 0
    """Counts the writer's beats."""


@dataclass
class Report:
    """A message to the controller through the ``events`` mailbox."""

    kind: str
    """``exit``, ``hung``, ``comm_error``, ``drain``, ``node_drain``, ``attached``, ``spare_ready``, ``crash``."""
    wid: str = ""
    node: int = -1
    rank: int | None = None
    generation: int = -1
    t: float = field(default_factory=time.time)
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Status:
    """A surviving member's state after its generation ended."""

    rank: int
    wid: str
    version: int
    """Optimizer steps this rank's state reflects."""
    clean: bool
    """False when the failure interrupted an optimizer step: the state is unusable."""
    step_started: int
    """The step the rank was executing (or about to) when the generation ended."""
    transfer_addr: list[Any]
    draining: bool = False
    snapshots: list[int] = field(default_factory=list)
    """Versions of this rank's complete local snapshots (buddy redundancy)."""
    holds: dict[str, list[int]] = field(default_factory=dict)
    """Rank (as a string) -> versions of that rank's buddy copies held here."""
    t: float = field(default_factory=time.time)


@dataclass
class Ready:
    """A member's answer to a plan: ready, or why it is not."""

    wid: str
    """The writer: the controller ignores an answer from any process but the rank's member in the plan."""
    generation: int
    failure: str = ""
    """Empty when ready; otherwise why the member could not reach the plan's target (a failed transfer)."""


@dataclass
class RankPlan:
    """What one member does to reach the target version."""

    fetch: dict[str, list[list[Any]]] = field(default_factory=dict)
    """State class -> sources ``[rank, copy]`` to copy it from, striped over all of them (empty: keep the live
    state). ``copy`` is ``live``, ``snapshot`` (the source's own earlier consistent copy) or ``held:<r>`` (a
    buddy copy of rank r held by the source); a rank may name itself to restore its own snapshot."""
    small_from: str = "self"
    """Where the rank's RNG streams and data position come from: ``self``, ``mirror`` (its record in the
    store) or ``<rank>/<copy>`` (the small state inside that source's copy)."""


@dataclass
class Plan:
    """The controller's decision for one generation."""

    generation: int
    target_version: int
    joins: dict[str, str]
    """Rank (as a string, JSON keys) -> worker id of the spare taking it over; other ranks keep their process."""
    ranks: dict[str, RankPlan | dict[str, Any]]
    """Rank -> what it does to reach the target; a rank not listed keeps its live state (O(changes) in size)."""
    addresses: dict[str, list[Any]]
    """Rank -> transfer address, for every rank the plan reads state from."""
    cause: str
    replaced: dict[str, str] = field(default_factory=dict)
    """Rank -> worker id of the process the spare replaces."""
    retire: list[str] = field(default_factory=list)
    """Worker ids that hand their rank over and exit (planned migrations)."""
    steps_lost: int = 0
    """Completed steps rolled back (the newest survivor version minus the target)."""
    moved: dict[str, int] = field(default_factory=dict)
    """Rank -> node, for every member of the generation not on the node that launched its rank: with the
    launch placement (``Placement.contiguous``), the generation's placement, in O(moves) bytes."""
    t: float = field(default_factory=time.time)

    def rank_plan(self, rank: int) -> RankPlan:
        raw = self.ranks.get(str(rank))
        if raw is None:
            return RankPlan()
        return raw if isinstance(raw, RankPlan) else RankPlan(**raw)


class Mailbox:
    """An append-only message queue on the store: ``add`` a sequence number, then ``set`` the entry.

    Reading never takes the reader down and never blocks it: an entry that does
    not decode as the expected record (malformed, or of another shape) or that
    is not sealed with the job secret is handed to ``on_bad`` and skipped; an
    entry whose number exists but whose value does not (its poster died between
    ``add`` and ``set``) is waited for across calls, up to ``missing_after_s``,
    then handed to ``on_bad`` and skipped.
    """

    def __init__(self, store: dist.Store, key: str, missing_after_s: float = 10.0, read: int = 0):
        self._store = store
        self._key = key
        self._read = read
        self._missing_after_s = missing_after_s
        self._missing_since: float | None = None

    @property
    def read(self) -> int:
        """How many entries this reader has taken (a reader that takes over from another starts there)."""
        return self._read

    def post(self, record: Any) -> int:
        n = self._store.add(f"{self._key}/seq", 1)
        put(self._store, f"{self._key}/{n}", record)
        return n

    def drain(self, cls: type[T], on_bad: Callable[[str, str], None]) -> Iterator[T]:
        """New messages since the last call, in order; ``on_bad(key, why)`` for each one skipped."""
        latest = self._store.add(f"{self._key}/seq", 0)
        while self._read < latest:
            key = f"{self._key}/{self._read + 1}"
            if isinstance(self._store, SignedStore) and self._store.holds_forged(key):
                # A slot a stranger took (it cannot be a poster's half-written entry: a set is atomic).
                on_bad(key, FORGED)
            elif not self._store.check([key]):
                now = time.monotonic()
                if self._missing_since is None:
                    self._missing_since = now
                if now - self._missing_since < self._missing_after_s:
                    return  # most likely being written right now: read it next time
                on_bad(key, f"numbered but never written in {self._missing_after_s:g} s (its poster died between add and set?)")
            else:
                raw = self._store.get(key)
                try:
                    record = _from_json(cls, raw)
                except (ValueError, TypeError) as exc:
                    on_bad(key, f"not a {getattr(cls, '__name__', cls)} record ({type(exc).__name__}: {exc}): {raw[:200]!r}")
                else:
                    self._read += 1
                    self._missing_since = None
                    yield record
                    continue
            self._read += 1
            self._missing_since = None


def put_object(store: dist.Store, key: str, obj: Any) -> None:
    """Write an object JSON cannot hold (tensors, RNG states) as a :mod:`~torchpass.core.safe_pickle`."""
    store.set(key, safe_pickle.dumps(obj))


def get_object(store: dist.Store, key: str) -> Any | None:
    """Read what ``put_object`` wrote (None when absent); never runs code named by the bytes it reads."""
    if not store.check([key]):
        return None
    return safe_pickle.loads(store.get(key))


MIRROR_SLOTS = 3
"""Small-state records kept per rank in the store: one per version, for the last three versions."""


def read_mirror(store: dist.Store, rank: int) -> dict[int, dict[str, Any]]:
    """A rank's mirrored small-state records by version (the newest ``MIRROR_SLOTS`` versions)."""
    out = {}
    for slot in range(MIRROR_SLOTS):
        record = get_object(store, Keys.mirror(rank, slot))
        if record is not None:
            out[record["version"]] = record
    return out
