"""Rebuildable process groups: stable group objects over a replaceable transport.

Frameworks cache process-group objects everywhere (DDP's C++ reducer,
DeepSpeed's ``groups`` globals and ZeRO optimizers, megatron-core's
``parallel_state`` and layers, FSDP2's mesh info, DeviceMesh) and functional
collectives resolve groups by name through c10d's registry. Rebinding all of
those after a failure is fragile, so torchpass never replaces a group object:
every group of a migratable job is a :class:`RebuildableProcessGroup`, a Python
subclass of ``torch.distributed.ProcessGroup`` whose identity, name, rank and
size stay fixed for the life of the process, and which forwards each
collective to an *inner* group that is rebuilt per generation: gloo for CPU
tensors, and for CUDA tensors gloo or NCCL, as the job asked
(:class:`InnerBackends`; NCCL's own life cycle is in
:mod:`torchpass.core.nccl_transport`).

Protocol (driven by :mod:`torchpass.core.runtime`):

1. ``install()`` registers the ``torchpass`` c10d backends and maps requests
   for ``gloo``, ``nccl`` and ``cpu:gloo,cuda:nccl`` onto them, so
   ``init_process_group``, ``new_group`` and ``DeviceMesh`` all create
   rebuildable groups without code changes. Each registered name stands for
   one :class:`InnerBackends`, so a ``new_group`` that inherits the world's
   backend inherits its inner backends too.
2. A group is *live* (forwarding to its generation's inner gloo group) or
   *local*. A hot spare runs the training script's set-up in local mode: its
   collectives complete at once as if every peer held the same data as the
   spare, because whatever they compute is overwritten by the state transfer.
3. ``release()`` (any thread) shuts down the connected sockets of the current
   inner group (told apart by the addresses its rendezvous wrote and read:
   :mod:`torchpass.core.gloo_sockets`) and abandons its pending collectives. gloo has no abort that
   wakes a pending operation (measured: ``ProcessGroupGloo.abort()`` and
   ``shutdown()`` return at once while the pending collective stays blocked
   until the peer's socket closes), so this is how survivors blocked on a hung
   or migrating peer are released within milliseconds instead of the
   process-group timeout. A closed socket alone is not enough: gloo never
   signals an operation whose message was in transfer, so every live
   collective's ``Work`` is one of :mod:`torchpass.core.pending_work`'s, which
   the release fails. NCCL communicators are aborted instead, all of a
   generation's together (:func:`release_generation`); their works fail by
   themselves and keep NCCL's stream semantics, so they are not wrapped.
4. ``rebuild_all(store, generation)`` builds, in group-creation order, fresh
   inner groups for every rebuildable group on the store prefix of the new
   generation. Creation order is the same on every rank (``new_group`` is a
   collective call), so the rebuild cannot deadlock.
5. ``hold(True)`` makes every group answer locally while keeping its live
   transport, until ``hold(False)``: for a rank that recovered from a failure
   inside code the framework runs between steps (a logging barrier, say),
   whose remaining collectives no peer will issue, because the new generation
   resumes at the next step.

Invariants: rank numbering and group membership never change; a group object
is never replaced; an inner group that was released is never used again.
C++ code that bypasses the Python object and calls the registered c10d backend
directly sees the first live generation's gloo group, which fails loudly once
released rather than computing on a stale membership.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    FakeProcessGroup,
    GatherOptions,
    ProcessGroupGloo,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    _create_work_from_future,
)

from . import gloo_sockets, job_secret, nccl_transport
from .failures import ABANDONED_MARKER
from .pending_work import PendingWork
from .rendezvous_store import InterruptibleStore
from .signed_store import SignedStore

__all__ = [
    "BACKEND_NAME",
    "InnerBackends",
    "RebuildableProcessGroup",
    "groups",
    "hold",
    "install",
    "rebuild_all",
    "release_generation",
    "set_local_mode_default",
]

BACKEND_NAME = "torchpass"
"""The registered c10d backend of groups whose tensors, CPU and CUDA, go over gloo."""


@dataclass(frozen=True)
class InnerBackends:
    """Which inner backend carries each device type's tensors (None: that device type is not served)."""

    cpu: str | None
    cuda: str | None

    def served(self) -> list[tuple[str, str]]:
        """(device type, inner backend) of each device type this kind of group serves."""
        return [(device, kind) for device, kind in (("cpu", self.cpu), ("cuda", self.cuda)) if kind is not None]

    @property
    def uses_gloo(self) -> bool:
        return "gloo" in (self.cpu, self.cuda)

    @property
    def name(self) -> str:
        """The backend name frameworks see (``dist.get_backend``, ``getBackendName``)."""
        return "nccl" if self.cuda == "nccl" else "gloo"


# One registered c10d name per kind of group, so that ``new_group`` without a backend
# (it reuses the world's registered name) builds the same inner backends as the world.
_KINDS: dict[str, InnerBackends] = {
    BACKEND_NAME: InnerBackends(cpu="gloo", cuda="gloo"),
    f"{BACKEND_NAME}_nccl": InnerBackends(cpu=None, cuda="nccl"),
    f"{BACKEND_NAME}_mixed": InnerBackends(cpu="gloo", cuda="nccl"),
}

_registry_lock = threading.Lock()
_registry: list[weakref.ReferenceType["RebuildableProcessGroup"]] = []
_local_by_default = False
_installed = False
before_collective: Callable[[], None] | None = None
"""Called before every live collective (the runtime makes pending mirror records durable)."""


def set_local_mode_default(local: bool) -> None:
    """Make groups created from now on start in local mode (a spare running its set-up)."""
    global _local_by_default
    _local_by_default = local


def groups() -> list["RebuildableProcessGroup"]:
    """Live rebuildable groups of this process, in creation order."""
    with _registry_lock:
        alive = [g for g in (ref() for ref in _registry) if g is not None]
    return sorted(alive, key=lambda g: g.creation_index)


class _Transport:
    """One generation's inner groups of one rebuildable group: gloo (and the sockets it owns), NCCL, or both."""

    def __init__(
        self,
        name: str,
        store: dist.Store,
        rank: int,
        size: int,
        connect_timeout: timedelta,
        op_timeout: timedelta,
        inner: InnerBackends,
        global_ranks: Sequence[int],
    ):
        self.name = name
        self.inner = inner
        self.group = dist.ProcessGroup(store, rank, size)
        self.gloo: Any = None
        self.endpoints = gloo_sockets.Endpoints()
        """The listeners gloo's rendezvous wrote and read: how this transport's sockets are told apart."""
        if inner.uses_gloo:
            # Kept for the group's life: a lazily connected gloo group reads peers' records from it long after it
            # was built, and c10d reaches a store written in Python only while its Python object lives.
            self.rendezvous_store = gloo_sockets.EndpointNotingStore(store, self.endpoints)
            self.gloo = ProcessGroupGloo(self.rendezvous_store, rank, size, connect_timeout)
            self.gloo._set_default_timeout(op_timeout)
        self.nccl: Any = None
        if inner.cuda == "nccl":
            self.nccl = nccl_transport.connect(dist.PrefixStore("nccl/", store), rank, size, op_timeout, name, global_ranks)
        for device, kind in inner.served():
            self.group._register_backend(torch.device(device), *self.backend_of(kind))
        self.group._set_default_backend(self.backend_of(inner.cuda if inner.cpu is None else inner.cpu)[0])
        self.pending = PendingWork(name)
        self.released = False

    def backend_of(self, kind: str | None) -> tuple[dist.ProcessGroup.BackendType, Any]:
        if kind == "nccl":
            return dist.ProcessGroup.BackendType.NCCL, self.nccl
        return dist.ProcessGroup.BackendType.GLOO, self.gloo

    def run(self, name: str, args: tuple[Any, ...]) -> dist.Work:
        """Issue ``name`` on the inner group; gloo's works are tracked, NCCL's returned as they are."""
        device = _cuda_device(args)
        if self.nccl is not None and device is not None:
            if self.released:
                raise RuntimeError(f"{ABANDONED_MARKER}: group {self.name!r}: this generation's NCCL communicators were aborted")
            return getattr(self.group, name)(*args)
        return self.pending.run(lambda: getattr(self.group, name)(*args), device)

    def release(self, reason: str, *, nccl_aborted: bool = False, connections: list[gloo_sockets.Connection] | None = None) -> int:
        """Abort its NCCL communicator (unless the caller aborted it with others), shut down gloo's
        sockets and fail gloo's pending collectives; returns the sockets shut down.

        ``connections``: the process's connected sockets, listed once for all the groups a caller releases.
        """
        if self.nccl is not None and not nccl_aborted and not self.released:
            nccl_transport.abort_together([self.nccl])
        self.released = True
        count = 0
        if self.gloo is not None:
            count = gloo_sockets.shut_down(gloo_sockets.connected() if connections is None else connections, self.endpoints)
        self.pending.abandon(reason)
        return count


class _Graveyard:
    """Released transports kept until gloo has nothing of theirs in flight, then let go on its own thread.

    Dropping a transport's last reference destroys its gloo group, closing its
    sockets and ending its threads, but gloo's destructor waits for operations
    still running. An operation whose message was in transfer when its sockets
    were shut down is never signalled by gloo (the pair signals queued operations,
    not the one being read or written) and ends only at gloo's own timeout, the
    group's ``timeout``. So no caller's thread ever drops a transport's last
    reference: a burial only hands the transport over, and the sweeper thread,
    which runs while the graveyard holds anything, lets go of the quiet ones
    without holding the lock. A destructor that still blocks (an operation the
    transport did not track, a C++ caller's) then holds up only the sweeper, never
    the training thread in the middle of a recovery, where a rank that does not
    report within the report timeout is fenced.
    """

    SWEEP_INTERVAL_S = 1.0
    """How often the sweeper looks again; only while the graveyard is not empty."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buried: list[_Transport] = []
        self._sweeper: threading.Thread | None = None

    def bury(self, transport: _Transport) -> None:
        with self._lock:
            self._buried.append(transport)
            if self._sweeper is None or not self._sweeper.is_alive():
                self._sweeper = threading.Thread(target=self._sweep, name="torchpass-graveyard", daemon=True)
                self._sweeper.start()

    def _sweep(self) -> None:
        while True:
            time.sleep(self.SWEEP_INTERVAL_S)
            with self._lock:
                # Comprehensions, not a loop: a loop variable would keep the last transport alive past the del.
                judged = [(t, t.pending.quiet()) for t in self._buried]
                quiet = [t for t, done in judged if done]
                self._buried = [t for t, done in judged if not done]
                empty = not self._buried
                if empty:
                    self._sweeper = None
            # The last references: the quiet transports' gloo groups are destroyed here, outside the lock.
            del judged, quiet
            if empty:
                return


_graveyard = _Graveyard()


def _cuda_device(args: Any) -> torch.device | None:
    """The device of a collective's first tensor argument when it is a CUDA tensor, else None."""
    if isinstance(args, torch.Tensor):
        return args.device if args.device.type == "cuda" else None
    if isinstance(args, (list, tuple)):
        for a in args:
            if isinstance(a, (torch.Tensor, list, tuple)):
                return _cuda_device(a)
    return None


def _completed(result: Any) -> dist.Work:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _reduce_local(tensors: list[torch.Tensor], op: Any, size: int) -> list[torch.Tensor]:
    """Reduce as if ``size`` peers held these tensors: SUM multiplies, PRODUCT raises to the power."""
    for t in tensors:
        if t.dtype == torch.bool:
            continue
        if op == ReduceOp.SUM:
            t.mul_(size)
        elif op == ReduceOp.PRODUCT:
            t.pow_(size)
    return tensors


def _fill_lists(outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    for outs, inp in zip(outputs, inputs):
        for out in outs:
            out.copy_(inp)
    return outputs


def _gather_into(output: torch.Tensor, input: torch.Tensor, size: int) -> list[torch.Tensor]:
    output.copy_(input.reshape(1, -1).expand(size, -1).reshape(output.shape))
    return [output]


def _exchange_local(
    output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int], rank: int, size: int
) -> list[torch.Tensor]:
    """All-to-all as if every peer held this rank's input: each peer sends its chunk for this rank."""
    in_sizes = in_splits or [input.shape[0] // size] * size
    out_sizes = out_splits or [output.shape[0] // size] * size
    mine = input.split(in_sizes)[rank]
    if all(n == mine.shape[0] for n in out_sizes):
        for chunk in output.split(out_sizes):
            chunk.copy_(mine)
    else:
        # Uneven splits have no consistent fiction; the values are overwritten by the
        # state transfer anyway, so zeros keep the spare deterministic.
        output.zero_()
    return [output]


class RebuildableProcessGroup(dist.ProcessGroup):
    """A c10d group whose transport can be released and rebuilt without replacing the object."""

    def __init__(
        self,
        rank: int,
        size: int,
        name: str,
        global_ranks: Sequence[int],
        op_timeout: timedelta,
        inner: InnerBackends = _KINDS[BACKEND_NAME],
    ):
        super().__init__(rank, size)
        self.inner = inner
        self._rank = rank
        self._size = size
        self._name = name
        self.global_ranks = list(global_ranks)
        self._op_timeout = op_timeout
        self._transport: _Transport | None = None
        self.generation = -1
        self._scripted_broadcasts: list[torch.Tensor] = []
        with _registry_lock:
            self.creation_index = len(_registry)
            _registry.append(weakref.ref(self))

    # ---- identity -------------------------------------------------------
    def getBackendName(self) -> str:
        # c10d maps this name to the registered backend type it looks up (DDP's
        # logger does): the fake placeholder of a never-live spare is CUSTOM.
        return self.inner.name if self.generation >= 0 else BACKEND_NAME

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    @property
    def is_local(self) -> bool:
        return self._transport is None

    def _get_backend(self, device: Any) -> Any:
        transport = self._transport
        if transport is None:
            return super()._get_backend(device)
        kind = self.inner.cuda if torch.device(device).type == "cuda" else self.inner.cpu
        return transport.backend_of(kind)[1]

    def __repr__(self) -> str:
        mode = "local" if self.is_local else f"generation {self.generation}"
        return f"RebuildableProcessGroup(name={self._name!r}, rank={self._rank}/{self._size}, {mode})"

    # ---- lifecycle ------------------------------------------------------
    def connect(self, store: dist.Store, generation: int, connect_timeout: timedelta) -> None:
        """Build this generation's transport; the previous one must have been released."""
        transport = _Transport(
            self._name, store, self._rank, self._size, connect_timeout, self._op_timeout, self.inner, self.global_ranks
        )
        if self._transport is None and self.generation < 0:
            # The first live transport becomes the c10d-registered backend (see module docstring).
            for device, kind in self.inner.served():
                self._register_backend(torch.device(device), *transport.backend_of(kind))
            self._set_default_backend(transport.backend_of(self.inner.cpu or self.inner.cuda)[0])
        if self._transport is not None:
            _graveyard.bury(self._transport)
        self._transport = transport
        self.generation = generation

    def go_local(self) -> None:
        """Answer collectives locally (a spare before it joins)."""
        if self._transport is not None:
            self._transport.release("the group went local")
            _graveyard.bury(self._transport)
        self._transport = None
        if self.generation < 0:
            fake = FakeProcessGroup._create_internal(self._rank, self._size)
            for device, _ in self.inner.served():
                self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, fake)
            self._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)

    def release(self, *, nccl_aborted: bool = False, connections: list[gloo_sockets.Connection] | None = None) -> int:
        """Unblock any pending collective on the current transport; safe from any thread.

        ``connections``: the process's connected sockets, when the caller lists them once for several groups.
        """
        transport = self._transport
        if transport is None or transport.released:
            return 0
        return transport.release(f"generation {self.generation} ended", nccl_aborted=nccl_aborted, connections=connections)

    def script_broadcasts(self, payloads: Sequence[torch.Tensor]) -> None:
        """In local mode, make the next broadcasts deliver ``payloads`` as if sent by the root.

        Used to hand a joining rank the result of a set-up broadcast the survivors
        performed long ago (DDP's bucket layout), without involving them.
        """
        self._scripted_broadcasts.extend(payloads)

    # ---- dispatch -------------------------------------------------------
    # Each collective forwards to the live transport, or runs its local-mode
    # fiction: every peer is assumed to hold exactly what this rank holds.
    def _run(self, name: str, args: tuple[Any, ...], local: Callable[[], Any]) -> dist.Work:
        transport = self._transport
        if transport is not None and not _held:
            if before_collective is not None:
                before_collective()
            return transport.run(name, args)
        return _completed(local())

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if isinstance(opts, AllreduceOptions) else _allreduce_opts(opts)
        return self._run("allreduce", (tensors, opts), lambda: _reduce_local(tensors, opts.reduceOp, self._size))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or AllreduceCoalescedOptions()
        return self._run("allreduce_coalesced", (tensors, opts), lambda: _reduce_local(tensors, opts.reduceOp, self._size))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._run("allgather", (outputs, inputs, opts or AllgatherOptions()), lambda: _fill_lists(outputs, inputs))

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        def local() -> list[list[torch.Tensor]]:
            # outputs[r][j] receives input j of rank r; every rank holds these inputs.
            for per_rank in outputs:
                for out, inp in zip(per_rank, inputs):
                    out.copy_(inp)
            return outputs

        return self._run("allgather_coalesced", (outputs, inputs, opts or AllgatherOptions()), local)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._run("_allgather_base", (output, input, opts or AllgatherOptions()), lambda: _gather_into(output, input, self._size))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._run("all_gather_single", (output, input, opts or AllgatherOptions()), lambda: _gather_into(output, input, self._size))

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._run(
            "allgather_into_tensor_coalesced",
            (outputs, inputs, opts or AllgatherOptions()),
            lambda: [_gather_into(o, i, self._size) for o, i in zip(outputs, inputs)],
        )

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._run(
            "all_gather_single_coalesced",
            (outputs, inputs, opts or AllgatherOptions()),
            lambda: [_gather_into(o, i, self._size) for o, i in zip(outputs, inputs)],
        )

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> dist.Work:
        opts = opts or ReduceScatterOptions()

        def local() -> list[torch.Tensor]:
            for out, ins in zip(outputs, inputs):
                out.copy_(ins[self._rank])
            return _reduce_local(outputs, opts.reduceOp, self._size)

        return self._run("reduce_scatter", (outputs, inputs, opts), local)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = opts or ReduceScatterOptions()
        return self._run("_reduce_scatter_base", (output, input, opts), lambda: self._scatter_into(output, input, opts.reduceOp))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = opts or ReduceScatterOptions()
        return self._run("reduce_scatter_single", (output, input, opts), lambda: self._scatter_into(output, input, opts.reduceOp))

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or ReduceScatterOptions()
        return self._run(
            "reduce_scatter_tensor_coalesced",
            (outputs, inputs, opts),
            lambda: [self._scatter_into(o, i, opts.reduceOp) for o, i in zip(outputs, inputs)],
        )

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or ReduceScatterOptions()
        return self._run(
            "reduce_scatter_single_coalesced",
            (outputs, inputs, opts),
            lambda: [self._scatter_into(o, i, opts.reduceOp) for o, i in zip(outputs, inputs)],
        )

    def _scatter_into(self, output: torch.Tensor, input: torch.Tensor, op: Any) -> list[torch.Tensor]:
        output.copy_(input.reshape(self._size, -1)[self._rank].reshape(output.shape))
        return _reduce_local([output], op, self._size)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int], opts: Any = None) -> dist.Work:
        args = (output, input, out_splits, in_splits, opts or AllToAllOptions())
        return self._run("alltoall_base", args, lambda: _exchange_local(output, input, out_splits, in_splits, self._rank, self._size))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int], opts: Any = None) -> dist.Work:
        args = (output, input, out_splits, in_splits, opts or AllToAllOptions())
        return self._run("all_to_all_single", args, lambda: _exchange_local(output, input, out_splits, in_splits, self._rank, self._size))

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._run("alltoall", (outputs, inputs, opts or AllToAllOptions()), lambda: [o.copy_(inputs[self._rank]) for o in outputs])

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        def local() -> list[torch.Tensor]:
            if self._scripted_broadcasts:
                tensors[0].copy_(self._scripted_broadcasts.pop(0).reshape(tensors[0].shape))
            return tensors

        return self._run("broadcast", (tensors, opts or BroadcastOptions()), local)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or ReduceOptions()
        return self._run("reduce", (tensors, opts), lambda: _reduce_local(tensors, opts.reduceOp, self._size))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._run("gather", (outputs, inputs, opts or GatherOptions()), lambda: _fill_lists(outputs, inputs * len(outputs)))

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> dist.Work:
        def local() -> list[torch.Tensor]:
            if inputs and inputs[0]:
                outputs[0].copy_(inputs[0][self._rank])
            return outputs

        return self._run("scatter", (outputs, inputs, opts or ScatterOptions()), local)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist.Work:
        return self._run("send", (tensors, dst_rank, tag), lambda: tensors)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist.Work:
        return self._run("recv", (tensors, src_rank, tag), lambda: tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        return self._run("recv_anysource", (tensors, tag), lambda: tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._run("barrier", (opts or BarrierOptions(),), lambda: [])

    def monitored_barrier(self, *args: Any) -> None:
        transport = self._transport
        if transport is not None:
            transport.group.monitored_barrier(*args)

    def _start_coalescing(self, device: torch.device) -> None:
        transport = self._transport
        if transport is not None:
            transport.group._start_coalescing(device)

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        transport = self._transport
        if transport is None:
            return _completed([])
        if transport.nccl is not None and torch.device(device).type == "cuda":
            return transport.group._end_coalescing(device)
        return transport.pending.run(lambda: transport.group._end_coalescing(device))


def _allreduce_opts(op: Any) -> AllreduceOptions:
    opts = AllreduceOptions()
    if op is not None:
        opts.reduceOp = op
    return opts


def _creator(inner: InnerBackends) -> Callable[[Any, Any], RebuildableProcessGroup]:
    def create(dist_opts: Any, backend_options: Any) -> RebuildableProcessGroup:
        del backend_options  # inner options are fixed by torchpass (NCCL: nonblocking); the group timeout is honoured
        timeout = dist_opts.timeout if isinstance(dist_opts.timeout, timedelta) else timedelta(seconds=float(dist_opts.timeout))
        group = RebuildableProcessGroup(
            dist_opts.group_rank,
            dist_opts.group_size,
            dist_opts.group_id,
            list(dist_opts.global_ranks_in_group) or list(range(dist_opts.group_size)),
            timeout,
            inner,
        )
        if _local_by_default:
            group.go_local()
        else:
            # Generation 0 meets through torch's default store: in a worker, sealed like every torchpass value.
            secret = job_secret.worker_secret()
            group.connect(SignedStore(dist_opts.store, secret) if secret else dist_opts.store, 0, timeout)
        return group

    return create


_NCCL_NAME, _MIXED_NAME = f"{BACKEND_NAME}_nccl", f"{BACKEND_NAME}_mixed"
_REWRITES = {
    "gloo": BACKEND_NAME,
    "cpu:gloo": BACKEND_NAME,
    "cpu:gloo,cuda:gloo": BACKEND_NAME,
    "nccl": _NCCL_NAME,
    "cuda:nccl": _NCCL_NAME,
    "cpu:gloo,cuda:nccl": _MIXED_NAME,
    "cuda:nccl,cpu:gloo": _MIXED_NAME,
    **{name: name for name in _KINDS},
}
# "fake" groups never communicate (TorchTitan uses them for size-1 mesh dimensions):
# there is nothing to rebuild, so they stay as they are.
_KEEP = ("fake",)


def _rewrite_backend(backend: Any) -> Any:
    if backend is None:
        return None
    key = str(backend).lower().replace(" ", "")
    if key in _KEEP:
        return backend
    if key == "undefined":
        # torch's own default: gloo for CPU, and NCCL for CUDA where this build has it.
        return _MIXED_NAME if torch.cuda.is_available() and nccl_transport.available() else BACKEND_NAME
    if key in _REWRITES:
        name = _REWRITES[key]
        if _KINDS[name].cuda == "nccl" and not nccl_transport.available():
            raise RuntimeError(f"torchpass: backend {str(backend)!r} asks for NCCL, which this torch build does not have")
        return name
    raise RuntimeError(
        f"torchpass: process groups on backend {str(backend)!r} cannot be rebuilt; this release supports "
        f"'gloo' (CPU and CUDA tensors), 'nccl' and 'cpu:gloo,cuda:nccl'. Launch without torchpass, or use one of those."
    )


def install() -> None:
    """Register the ``torchpass`` backends and route gloo and NCCL group creation to them (idempotent)."""
    global _installed
    if _installed:
        return
    for name, inner in _KINDS.items():
        devices = [device for device, _ in inner.served()]
        dist.Backend.register_backend(name, _creator(inner), extended_api=True, devices=devices)
    dist.Backend.default_device_backend_map["cpu"] = BACKEND_NAME
    original: Callable[..., Any] = c10d._new_process_group_helper

    def _new_process_group_helper(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
        return original(group_size, group_rank, global_ranks_in_group, _rewrite_backend(backend), *args, **kwargs)

    c10d._new_process_group_helper = _new_process_group_helper
    _installed = True


def release_generation(generation: int) -> int:
    """Release the transports of ``generation`` and older (monitor thread, on a generation's end).

    A transport of a newer generation is left alone: the main thread may already
    have rebuilt by the time a slow monitor gets here.
    """
    global _released_through
    with _released_lock:
        _released_through = max(_released_through, generation)
    ending = [g for g in groups() if g.generation <= generation]
    # Every NCCL communicator of the generation in one group call: one by one can deadlock (nccl_transport).
    nccl_transport.abort_together([t.nccl for g in ending if (t := g._transport) is not None and t.nccl is not None and not t.released])
    connections = gloo_sockets.connected()
    return sum(g.release(nccl_aborted=True, connections=connections) for g in ending)


DEVICE_COPY_SETTLE_S = 0.2
"""How long a survivor waits for abandoned CUDA collectives to complete or fail before restoring its state
(see ``PendingWork.settle_device_copies``): one that has all its data completes in far less."""


def settle_device_copies() -> int:
    """On the training thread after a release: no abandoned CUDA collective's copy back overwrites what is restored next.

    Returns how many were still running after the bound (logged by the caller)."""
    return sum(t.pending.settle_device_copies(DEVICE_COPY_SETTLE_S) for g in groups() if (t := g._transport) is not None and t.released)


_released_lock = threading.Lock()
_released_through = -1
"""The newest generation released in this process: a rebuild of it gives up waiting for peers."""


def rebuild_all(base_store: dist.Store, generation: int, connect_timeout: timedelta) -> list[str]:
    """Give every group a transport for ``generation``; returns the group names in build order.

    The rendezvous goes through an :class:`~.rendezvous_store.InterruptibleStore`: a member
    that dies before it publishes its address ends the generation, and that ends the waits.
    """
    names = []
    for group in groups():
        group.release()
        prefix = dist.PrefixStore(f"torchpass/pg/{generation}/{group.group_name}/", base_store)
        store = InterruptibleStore(
            prefix, lambda: _released_through >= generation, f"building group {group.group_name!r} of generation {generation}", connect_timeout
        )
        group.connect(store, generation, connect_timeout)
        names.append(group.group_name)
    return names


_held = False


def hold(held: bool) -> None:
    """Answer every group's collectives locally (``True``) or on its transport again (step 5 of the protocol)."""
    global _held
    _held = held


def go_local_all() -> None:
    for group in groups():
        group.go_local()


def group_signature() -> list[tuple[str, list[int]]]:
    """(name, global ranks) of every group, in creation order: must match across a rank's incarnations."""
    return [(g.group_name, g.global_ranks) for g in groups()]

