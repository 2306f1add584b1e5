"""PendingWork: a live collective's Work completes with gloo's, or fails at once when its transport is released.

The unit cases drive real gloo works of a one-rank group (and, for a collective
whose peer never answers, a work that behaves as gloo's and only the test completes). The two-process case
reproduces what made survivors go silent: a release that lands while a
collective's message is in transfer, which gloo never signals.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from datetime import timedelta
from functools import partial
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from torchpass.core.failures import ABANDONED_MARKER, is_comm_error
from torchpass.core.pending_work import PendingWork
from tests.support.harness import free_port


FREED_WITHIN_S = 5.0
"""How long a collective's tensor may take to be freed after its work completed (gloo's thread lets go of it)."""


@pytest.fixture(scope="module")
def gloo() -> ProcessGroupGloo:
    return ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))


class _PeerNeverAnswers(dist.Work):
    """A collective gloo is still working on, as gloo's AsyncWork behaves: a future, and a wait(timeout)
    that gives up the wait, not the operation. Only the test completes it."""

    def __init__(self) -> None:
        super().__init__()
        self.fut: torch.futures.Future = torch.futures.Future()

    def get_future(self) -> torch.futures.Future:
        return self.fut

    def wait(self, timeout: timedelta | None = None) -> bool:
        done = threading.Event()
        self.fut.add_done_callback(lambda _: done.set())
        if not done.wait(timeout.total_seconds() if timeout else None):
            raise RuntimeError("Operation timed out!")
        self.fut.wait()
        return True

    def is_completed(self) -> bool:
        return self.fut.done()


def test_a_collective_completes_with_gloos_result(gloo):
    pending = PendingWork("unit")
    t = torch.tensor([1.5, -2.0])
    work = pending.run(lambda: gloo.allreduce([t]))
    work.wait()
    assert t.tolist() == [1.5, -2.0]
    assert work.get_future().value()[0] is t


def _allreduce_of_a_fresh_tensor(pending: PendingWork, gloo: ProcessGroupGloo) -> tuple[Any, Callable[[], bool]]:
    """A collective on a tensor only its gloo work holds, and whether that tensor's memory was freed since.

    gloo's worker thread completes the work's future before it drops its own reference to the work, so
    "freed" is given a moment (a tensor something still holds is never freed, however long the wait)."""
    t = torch.ones(1024)
    ref = weakref.ref(t.untyped_storage())

    def freed() -> bool:
        deadline = time.monotonic() + FREED_WITHIN_S
        while gc.collect() >= 0 and ref() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        return ref() is None

    return pending.run(partial(gloo.allreduce, [t])), freed


def test_a_waited_collective_keeps_no_tensor_alive(gloo):
    """A collective's buffers are the caller's once it waited: holding the gloo work made every step
    allocate (and fault in) fresh memory; DeepSpeed's flat buffers are freed right after the wait."""
    pending = PendingWork("unit")
    work, freed = _allreduce_of_a_fresh_tensor(pending, gloo)
    work.wait()
    del work
    assert freed(), "the transport kept a waited collective's tensor alive"


def test_a_collective_nobody_waited_for_is_dropped_by_the_next_once_complete(gloo):
    """A work consumed through its future (DDP's reducer) is let go at the next collective once complete,
    while one still in flight is kept: ``quiet`` must see it until gloo is done with it."""
    pending = PendingWork("unit")
    work, freed = _allreduce_of_a_fresh_tensor(pending, gloo)
    work.get_future().wait()
    del work
    inner = _PeerNeverAnswers()
    pending.run(lambda: inner)
    assert freed(), "a completed collective was kept after the next one was issued"
    pending.abandon("generation 2 ended")
    assert not pending.quiet(), "a collective still in flight must keep the transport from being destroyed"
    inner.fut.set_result([])
    assert pending.quiet()


def test_an_operation_without_a_gloo_future_completes_through_the_waiter(gloo):
    pending = PendingWork("unit")
    out = torch.empty(2)
    # gloo's reduce-scatter work has no future ("Work::getFuture not implemented").
    with pytest.raises(RuntimeError, match="getFuture"):
        gloo._reduce_scatter_base(torch.empty(2), torch.tensor([3.0, 4.0])).get_future()
    work = pending.run(lambda: gloo._reduce_scatter_base(out, torch.tensor([3.0, 4.0])))
    work.wait()
    assert out.tolist() == [3.0, 4.0]


def test_a_gloo_error_reaches_the_waiter():
    pending = PendingWork("unit")
    inner = _PeerNeverAnswers()
    work = pending.run(lambda: inner)
    chained = work.get_future()
    inner.fut.set_exception(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        work.wait()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        chained.wait()


def test_abandon_fails_a_pending_collective_and_its_future_and_ignores_a_late_completion():
    pending = PendingWork("tp")
    inner = _PeerNeverAnswers()
    work = pending.run(lambda: inner)
    chained = work.get_future()  # as DDP's reducer chains on it
    raised: list[BaseException] = []

    def training_thread() -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raised.append(exc)

    waiter = threading.Thread(target=training_thread)
    waiter.start()  # blocked in the wait, as the training thread is
    pending.abandon("generation 3 ended")
    waiter.join(30)
    assert not waiter.is_alive(), "the abandonment did not end a wait in progress"
    assert len(raised) == 1 and ABANDONED_MARKER in str(raised[0]), raised
    with pytest.raises(RuntimeError) as raised:
        work.wait()
    message = str(raised.value)
    assert ABANDONED_MARKER in message and "'tp'" in message and "generation 3 ended" in message
    assert is_comm_error(message), "the runtime must read an abandoned collective as a comm failure"
    with pytest.raises(RuntimeError, match=ABANDONED_MARKER):
        chained.wait()
    inner.fut.set_result([])  # gloo finishing late changes nothing
    pending.abandon("again")
    assert "generation 3 ended" in str(pending.error())


def test_a_collective_that_completes_as_a_slice_runs_out_is_a_success():
    """gloo's wait(timeout) raised "Operation timed out!", and the collective completed right after."""

    class _CompletesAsTheSliceEnds(_PeerNeverAnswers):
        def wait(self, timeout: timedelta | None = None) -> bool:
            if timeout is not None and not self.fut.done():
                self.fut.set_result([])
                raise RuntimeError("Operation timed out!")
            return super().wait(timeout)

    pending = PendingWork("unit")
    assert pending.run(_CompletesAsTheSliceEnds).wait() is True


def test_nothing_is_issued_on_an_abandoned_transport():
    pending = PendingWork("dp")
    pending.abandon("generation 0 ended")
    issued = []
    work = pending.run(lambda: issued.append(1) or _PeerNeverAnswers())
    assert issued == []
    with pytest.raises(RuntimeError, match=ABANDONED_MARKER):
        work.wait()
    with pytest.raises(RuntimeError, match=ABANDONED_MARKER):
        work.get_future().wait()


def test_an_operation_on_the_waiter_is_abandoned_too():
    pending = PendingWork("pp")
    gate: torch.futures.Future = torch.futures.Future()

    class _NoFuture:
        """A Work gloo gives no future for (send/recv), here one that never completes."""

        def get_future(self):
            raise RuntimeError("Work::getFuture not implemented.")

        def wait(self):
            gate.wait()

    work = pending.run(_NoFuture)
    pending.abandon("generation 1 ended")
    with pytest.raises(RuntimeError, match=ABANDONED_MARKER):
        work.wait()
    gate.set_result(None)  # the waiter thread gets out and stops


def test_a_callback_chained_on_completion_may_issue_the_next_collective(gloo):
    """Futures complete outside the lock: DDP's and FSDP's chained callbacks issue collectives."""
    pending = PendingWork("unit")
    t = torch.ones(2)
    second: list[dist.Work] = []
    first = pending.run(lambda: gloo.allreduce([t]))
    done = threading.Event()

    def chain(_):
        second.append(pending.run(lambda: gloo.allreduce([t])))
        done.set()

    first.get_future().add_done_callback(chain)
    assert done.wait(10)
    second[0].wait()


# ---- the silent-survivor case: a release while a message is in transfer ------------------
# Without PendingWork both ranks stay blocked until gloo's timeout (measured: 15 s of 15 s).

_TWO_RANKS = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torchpass.core import comms

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    comms.install()
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    # A process-group timeout past the test's: a collective the release misses hangs the test.
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=900))
    big = torch.ones(128 * 1024 * 1024)  # 512 MB: moving it takes far longer than 0.1 s
    store.set(f"pid{rank}", str(os.getpid()))
    peer = int(store.get("pid1"))
    dist.all_reduce(torch.ones(1))  # both ranks are connected and idle

    def monitor():  # what the runtime's monitor thread does when the generation ends
        own = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))  # a client per thread
        own.wait(["end"], timedelta(seconds=600))
        comms.release_generation(0)
    threading.Thread(target=monitor, daemon=True).start()
    if rank == 0:
        def freeze_then_end():
            # The peer stops mid-message (a SIGSTOPped or overloaded rank), the generation ends,
            # and the peer resumes into a released generation.
            time.sleep(0.1)
            os.kill(peer, signal.SIGSTOP)
            time.sleep(0.5)
            store.set("end", "rank 1 stopped")
            time.sleep(0.5)
            os.kill(peer, signal.SIGCONT)
        freezer = threading.Thread(target=freeze_then_end)
        freezer.start()
    try:
        # One message, and it is in transfer when the generation ends: gloo signals
        # queued operations on a failed pair, never the one being transferred.
        dist.recv(big, src=1) if rank == 0 else dist.send(big, dst=0)
        outcome = "completed"
    except Exception as exc:
        outcome = str(exc)
    if rank == 0:
        freezer.join()  # the peer runs again before this rank leaves
    print("RESULT" + json.dumps({"rank": rank, "outcome": outcome}), flush=True)
    os._exit(0)
    """
)


def test_a_release_during_a_transfer_fails_the_collective_at_once():
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, "-c", _TWO_RANKS, str(r), str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]  # a hang fails here
    finally:
        for p in procs:
            p.kill()
    results = {}
    for (out, err), p in zip(outs, procs):
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT")), None)
        assert line is not None, err[-3000:]
        result = json.loads(line[len("RESULT") :])
        results[result["rank"]] = result
    for rank, result in results.items():
        assert result["outcome"] != "completed", result
        assert is_comm_error(result["outcome"]), result
