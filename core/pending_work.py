"""Pending collectives of one transport, and abandoning them when its generation ends.

Releasing a transport (shutting down its sockets, :mod:`torchpass.core.comms`)
fails most pending gloo operations at once, but not all: gloo signals the
error to operations queued on a pair, not to one whose message was *in
transfer* when the socket went away (the receive being filled, the send being
written). Such an operation waits for the full process-group timeout —
minutes — and the survivor waiting on it never reports (measured: 3 of 28
SIGKILL runs of the megatron-core TP 2 x DP 2 job under load, always a
tensor-parallel collective in the forward pass).

So a live collective never hands its gloo ``Work`` to the caller; it hands a
:class:`TrackedWork`, which ends with gloo's or raises an error naming
:data:`~torchpass.core.failures.ABANDONED_MARKER` once the transport is
abandoned. Steps:

1. ``PendingWork.run(issue)`` issues the collective and wraps its gloo work.
2. ``TrackedWork.wait()`` waits on gloo's work in slices of
   :data:`ABANDON_CHECK_S` (for the operations gloo gives a future, its
   ``wait(timeout)`` gives up the wait, not the operation), so a collective
   that completes costs what gloo's own wait costs, and an abandoned one
   returns within a slice. The others (send, recv, reduce-scatter: their
   timed-out wait closes every pair of the context) are waited on through
   the future of step 3.
3. ``TrackedWork.get_future()`` (DDP's reducer and comm hooks chain on it)
   makes a future of ours on first use, fulfilled from gloo's future by a
   callback, or, for the operations gloo gives no future (send, recv,
   reduce-scatter), by one waiter thread per transport in issue order.
4. ``PendingWork.abandon(reason)`` marks the transport abandoned, fails
   every such future that has not completed, and refuses new collectives.

Invariants: every future completes exactly once (the first of gloo's
completion and the abandonment wins); no future is completed under the lock,
because callbacks chained on it may issue the next collective. An abandoned
gloo operation keeps running on its dead sockets until gloo's own timeout:
its buffers belong to a step the migration discards.
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .failures import ABANDONED_MARKER

__all__ = ["ABANDON_CHECK_S", "PendingWork", "TrackedWork"]

ABANDON_CHECK_S = 0.05
"""How often a wait on a pending collective looks for the abandonment: bounds how long a survivor stays
blocked after its generation ended, at the cost of one C++ timeout every slice of a long wait."""

_SLICE = timedelta(seconds=ABANDON_CHECK_S)
_PRUNE_AT = 256
"""CUDA works kept before completed ones are dropped from their list (amortized: a few checks per collective)."""
_STOP = None

_Waits = queue.SimpleQueue  # of (gloo work, trigger future, CUDA device or None), or _STOP


def _without_frames(exc: Exception) -> Exception:
    """gloo's error with no Python traceback, to be stored in the future it fails.

    Its traceback holds the frame that caught it, whose locals hold that very future and the transport's
    gloo works: a reference cycle that only the cyclic collector frees, and until it runs, the released
    group's gloo device (its sockets, its loop thread) stays alive. The error is raised in C++; its message
    is all it carries."""
    return exc.with_traceback(None)


def _outcome(trigger: torch.futures.Future) -> Any:
    """The collective's value, or its error raised (see ``PendingWork.future_of``)."""
    ok, payload = trigger.value()
    if not ok:
        raise payload
    return payload


def _future_or_none(work: dist.Work | None) -> torch.futures.Future | None:
    """gloo's future of ``work``; None for the operations gloo implements none for (send, recv, reduce-scatter)."""
    if work is None:
        return None
    try:
        return work.get_future()
    except RuntimeError:
        return None


class TrackedWork(dist.Work):
    """The ``Work`` a live collective returns: gloo's, unless the transport was abandoned first.

    A Python subclass, because c10d's future-backed work
    (``_create_work_from_future``) returns from ``wait()`` without raising when
    its future failed, which would let a caller read a buffer an abandoned
    collective never filled. C++ callers reach ``wait`` and ``get_future``
    through c10d's ``PyWork`` trampoline (DDP's reducer, functional
    collectives); the other methods serve Python callers.
    """

    def __init__(self, inner: dist.Work | None, pending: "PendingWork", device: torch.device | None = None):
        super().__init__()
        self._inner = inner
        self._pending = pending
        self._device = device
        self._gloo_future = _future_or_none(inner)
        self._fut: torch.futures.Future | None = None

    def wait(self, timeout: Any = None) -> bool:
        del timeout  # gloo's own timeout bounds the collective; the abandonment bounds the generation
        inner = self._inner
        if inner is not None and self._gloo_future is None:
            # send, recv, reduce-scatter: their wait(timeout) times out the whole context
            # ("Application timeout caused pair closure"), so they are waited on via our future.
            self.get_future().wait()
            return True
        while True:
            if inner is None or self._pending.abandoned is not None and not inner.is_completed():
                raise self._pending.error()
            try:
                inner.wait(_SLICE)
                self.synchronize()
                self._pending.finished(inner)
                return True
            except RuntimeError:
                if inner.is_completed():
                    # Failed, or completed just after the slice ran out: a wait now gives the
                    # collective's own outcome (returns, or raises gloo's error), never the slice's.
                    inner.wait()
                    self.synchronize()
                    self._pending.finished(inner)
                    return True
                # Only the slice ran out: look for the abandonment, then wait on.

    def get_future(self) -> torch.futures.Future:
        if self._fut is None:
            self._fut = self._pending.future_of(self._inner, self._gloo_future, self._device)
        return self._fut

    def is_completed(self) -> bool:
        return self._inner is None or self._inner.is_completed() or self._pending.abandoned is not None

    def is_success(self) -> bool:
        return self.exception() is None and self._inner is not None and self._inner.is_completed()

    def exception(self) -> BaseException | None:
        if not self.is_completed():
            return None
        try:
            self.wait()
        except Exception as exc:  # returned, as c10d's Work.exception() does
            return exc
        return None

    def result(self) -> Any:
        self.wait()
        assert self._inner is not None
        return self._inner.result()

    def synchronize(self) -> None:
        """Make the current stream wait for a CUDA collective's copy back to the device (a CPU one has none).

        gloo makes only its worker thread's current stream wait for that copy; a caller training on
        another stream must wait too before it reads the result."""
        if self._inner is not None and self._device is not None:
            self._inner.synchronize()


class PendingWork:
    """One transport's collectives: issued through ``run``, failed together by ``abandon``."""

    def __init__(self, name: str):
        self._name = name
        self._lock = threading.Lock()
        self._futures: set[torch.futures.Future] = set()
        self.abandoned: str | None = None
        """Why the transport was abandoned; None while it is live."""
        self._waits: _Waits | None = None
        self._waiter_thread: threading.Thread | None = None
        self._issued: list[dist.Work] = []
        """gloo works issued and not yet seen completed (see ``run`` and ``quiet``)."""
        self._on_device: list[dist.Work] = []
        """gloo works on CUDA tensors not yet seen completed: each copies its result back to the
        device on gloo's own stream when it completes (see ``settle_device_copies``)."""

    def run(self, issue: Callable[[], dist.Work], device: torch.device | None = None) -> TrackedWork:
        """Issue a collective (nothing is issued on an abandoned transport: its sockets are gone).

        ``device``: the CUDA device of the collective's tensors, if any; its future then carries
        CUDA events, so a consumer's stream waits for gloo's copies back to the device."""
        if self.abandoned is not None:
            return TrackedWork(None, self, device)
        work = TrackedWork(issue(), self, device)
        if device is not None:
            self._on_device.append(work._inner)
            if len(self._on_device) >= _PRUNE_AT:
                self._on_device = [w for w in self._on_device if not w.is_completed()]
        if work._gloo_future is not None:
            # The others (send, recv, reduce-scatter) are waited on by the waiter thread, which
            # quiet() waits for; holding them here too made reduce-scatter 4x slower (measured).
            # A gloo work holds its tensors: one kept after it completed keeps the caller's buffers
            # alive, so the caller's next step allocates fresh memory and faults it in (measured on
            # the DeepSpeed ZeRO-1 benchmark, keeping up to 256: twice the page faults of torchrun
            # and 1.7x its step time). Hence only works in flight are kept: completed ones are
            # dropped here, and a work its caller waited for is dropped by that wait (``finished``).
            self._issued = [w for w in self._issued if not w.is_completed()]
            self._issued.append(work._inner)
        return work

    def finished(self, inner: dist.Work) -> None:
        """``inner`` completed and its caller waited for it: it is no longer in flight."""
        issued = self._issued
        if inner in issued:  # not when a later collective's pruning dropped it, or gloo gave it no future
            issued.remove(inner)

    def quiet(self) -> bool:
        """Whether gloo has nothing of this transport's in flight: every issued operation completed
        (abandoned ones complete with an error at gloo's own timeout) and the waiter thread has ended.

        Only then can the transport be destroyed: gloo's destructor waits for its work queue to
        drain and joins its threads, which would block on an operation still running.
        """
        if self.abandoned is None:
            return False
        self._issued = [w for w in self._issued if not w.is_completed()]
        waiter = self._waiter_thread
        return not self._issued and (waiter is None or not waiter.is_alive())

    def abandon(self, reason: str) -> None:
        """Fail every pending collective with ``reason`` (the first reason stays)."""
        with self._lock:
            if self.abandoned is not None:
                return
            self.abandoned = reason
            futures, self._futures = self._futures, set()
            waits = self._waits
        if waits is not None:
            waits.put(_STOP)
        error = self.error()
        for trigger in futures:
            trigger.set_result((False, error))

    def settle_device_copies(self, bound_s: float) -> int:
        """After :meth:`abandon`, on the thread that will restore state: order this thread's stream after
        every copy back to the device an abandoned CUDA collective still makes; returns the ones still
        running after ``bound_s``.

        gloo copies a CUDA collective's result back on its own stream once the collective completes,
        which may be after the survivor has queued the restore of its state on the training stream:
        that copy would then overwrite restored tensors. A collective still running once the sockets
        are shut down either completes within moments (its data had arrived) or fails, and a failed
        one copies nothing back; so this waits up to ``bound_s`` for them, then makes the current
        stream wait for the copies of every one that completed."""
        deadline = time.monotonic() + bound_s
        works, self._on_device = self._on_device, []
        while any(not w.is_completed() for w in works) and time.monotonic() < deadline:
            time.sleep(0.005)
        running = 0
        for w in works:
            if not w.is_completed():
                running += 1
                continue
            try:
                w.synchronize()
            except RuntimeError:
                pass  # it failed: nothing was copied back
        return running

    def error(self) -> RuntimeError:
        return RuntimeError(f"{ABANDONED_MARKER} on group {self._name!r}: {self.abandoned}")

    # ---- futures ------------------------------------------------------------
    # A future handed out is ``trigger.then(_outcome)``, never one completed with set_exception():
    # that one holds the exception as its *value* for C++, and DDP's reducer, reading tensors out
    # of it, crashes the process (measured: SIGSEGV in backward). An exception raised inside a
    # then() callback is a real error to C++ and to Python alike.
    def future_of(
        self, inner: dist.Work | None, gloo_future: torch.futures.Future | None, device: torch.device | None = None
    ) -> torch.futures.Future:
        """A future that completes with ``inner`` (through ``gloo_future`` when gloo gives one), or fails once
        the transport is abandoned.

        For a CUDA collective (``device``) the future is CUDA-aware: it is completed from gloo's callback,
        whose current stream waits for gloo's events, and records events there that a consumer's
        ``wait()`` makes its own stream wait for. A plain future would hand out tensors whose
        copy back to the device may still be running."""
        trigger: torch.futures.Future = torch.futures.Future(devices=[device]) if device is not None else torch.futures.Future()
        fut = trigger.then(_outcome)
        with self._lock:
            live = inner is not None and self.abandoned is None
            if live:
                self._futures.add(trigger)
        if not live:
            trigger.set_result((False, self.error()))
            return fut
        assert inner is not None
        if gloo_future is None:
            self._waiter().put((inner, trigger, device))
        else:
            gloo_future.add_done_callback(lambda done: self._complete_from(trigger, done))
        return fut

    def _settle(self, trigger: torch.futures.Future, ok: bool, payload: Any) -> None:
        """Complete ``trigger`` unless the abandonment got there first."""
        with self._lock:
            if trigger not in self._futures:
                return
            self._futures.discard(trigger)
        trigger.set_result((ok, payload))

    def _complete_from(self, trigger: torch.futures.Future, done: torch.futures.Future) -> None:
        try:
            value = done.value()
        except Exception as exc:  # gloo's error is the collective's outcome: hand it to the waiter
            self._settle(trigger, False, _without_frames(exc))
            return
        self._settle(trigger, True, value)

    def _waiter(self) -> _Waits:
        with self._lock:
            if self._waits is None:
                self._waits = queue.SimpleQueue()
                self._waiter_thread = threading.Thread(
                    target=self._wait_loop, args=(self._waits,), name=f"torchpass-wait-{self._name}", daemon=True
                )
                self._waiter_thread.start()
            return self._waits

    def _wait_loop(self, waits: _Waits) -> None:
        while (item := waits.get()) is not _STOP:
            work, trigger, device = item
            try:
                work.wait()
                if device is not None:
                    # The future carries no tensor to record events on: the copy back to the
                    # device is complete before it is fulfilled.
                    work.synchronize()
                    torch.cuda.current_stream(device).synchronize()
            except Exception as exc:  # the collective's outcome, handed to whoever waits on it
                self._settle(trigger, False, _without_frames(exc))
                continue
            # gloo's work had no future and implements no result(): there is no value to pass on.
            self._settle(trigger, True, [])
