"""Pending collectives of one transport, and abandoning them when its generation ends.

Releasing a transport (shutting down its sockets, :mod:`torchpass.core.comms`)
fails most pending gloo operations at once, but not all: gloo signals the
error to operations queued on a pair, not to one whose message was *in
transfer* when the socket went away (the receive being filled, the send being
written). Such an operation waits for the full process-group timeout —
minutes — and the survivor waiting on it never reports (measured: 3 of 28
SIGKILL runs of the megatron-core TP 2 x DP 2 job under load, always a
tensor-parallel collective in the forward pass).

So a live collective never hands its gloo ``Work`` to the caller. The caller
gets a ``Work`` over a future of ours that completes when gloo's does, or
fails at once with an error naming
:data:`~torchpass.core.failures.ABANDONED_MARKER` when the transport is
abandoned. Steps:

1. ``run(issue)`` issues the collective, registers a future and returns a
   ``Work`` over it. gloo's
   own future completes it (a callback in gloo's worker thread); for the
   operations gloo gives no future (send, recv, reduce-scatter) one waiter
   thread per transport waits on them in issue order.
2. ``abandon(reason)`` fails every registered future that has not completed
   and refuses new ones.

Invariants: every future completes exactly once (the first of gloo's
completion and the abandonment wins); no future is completed under the lock,
because callbacks chained on it may issue the next collective. An abandoned
gloo operation keeps running on its dead sockets until gloo's own timeout:
its buffers belong to a step the migration discards.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
from .failures import ABANDONED_MARKER

__all__ = ["PendingWork", "TrackedWork"]

_STOP = None


class TrackedWork(dist.Work):
    """The ``Work`` a live collective returns: it ends with its future, raising the collective's error.

    c10d's own future-backed work (``_create_work_from_future``) returns from
    ``wait()`` without raising when its future failed, which would let a caller
    read a buffer an abandoned collective never filled. C++ callers reach
    ``wait`` and ``get_future`` through c10d's ``PyWork`` trampoline (DDP's
    reducer, functional collectives); the other methods serve Python callers.
    """

    def __init__(self, fut: torch.futures.Future):
        super().__init__()
        self._fut = fut

    def wait(self, timeout: Any = None) -> bool:
        del timeout  # gloo's own timeout bounds the collective; the abandonment bounds the generation
        self._fut.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # the failure itself is what the caller asked about
            return False
        return True

    def exception(self) -> BaseException | None:
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except Exception as exc:  # returned, as c10d's Work.exception() does
            return exc
        return None

    def result(self) -> Any:
        return self._fut.wait()

    def synchronize(self) -> None:
        """CPU collectives have no stream to synchronize with."""


class PendingWork:
    """The futures of one transport's collectives that have not completed yet."""

    def __init__(self, name: str):
        self._name = name
        self._lock = threading.Lock()
        self._pending: set[torch.futures.Future] = set()
        self._abandoned: str | None = None
        self._waits: queue.SimpleQueue[tuple[dist.Work, torch.futures.Future] | None] | None = None

    def run(self, issue: Callable[[], dist.Work]) -> dist.Work:
        """Issue a collective; returns a ``Work`` that completes with it, or fails once the transport is abandoned.

        Nothing is issued on an abandoned transport: its sockets are gone.
        """
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            abandoned = self._abandoned
        if abandoned is not None:
            fut.set_exception(self._error(abandoned))
            return TrackedWork(fut)
        work = issue()
        with self._lock:
            abandoned = self._abandoned
            if abandoned is None:
                self._pending.add(fut)
        if abandoned is not None:
            fut.set_exception(self._error(abandoned))
            return TrackedWork(fut)
        try:
            inner = work.get_future()
        except RuntimeError:
            # gloo implements no future for this operation: wait for it on a thread.
            self._waiter().put((work, fut))
        else:
            inner.add_done_callback(lambda done: self._complete_from(fut, done))
        return TrackedWork(fut)

    def abandon(self, reason: str) -> int:
        """Fail every pending collective with ``reason``; returns how many were pending."""
        with self._lock:
            if self._abandoned is not None:
                return 0
            self._abandoned = reason
            pending, self._pending = self._pending, set()
            waits = self._waits
        if waits is not None:
            waits.put(_STOP)
        error = self._error(reason)
        for fut in pending:
            fut.set_exception(error)
        return len(pending)

    # ---- completion ---------------------------------------------------------
    def _claim(self, fut: torch.futures.Future) -> bool:
        """Whether the caller completes ``fut`` (False: it was abandoned first)."""
        with self._lock:
            if fut not in self._pending:
                return False
            self._pending.discard(fut)
            return True

    def _complete_from(self, fut: torch.futures.Future, done: torch.futures.Future) -> None:
        try:
            value = done.value()
        except Exception as exc:  # gloo's error is the collective's outcome: hand it to the waiter
            if self._claim(fut):
                fut.set_exception(exc)
            return
        if self._claim(fut):
            fut.set_result(value)

    def _waiter(self) -> queue.SimpleQueue[tuple[dist.Work, torch.futures.Future] | None]:
        with self._lock:
            if self._waits is None:
                self._waits = queue.SimpleQueue()
                threading.Thread(
                    target=self._wait_loop, args=(self._waits,), name=f"torchpass-wait-{self._name}", daemon=True
                ).start()
            return self._waits

    def _wait_loop(self, waits: queue.SimpleQueue[tuple[dist.Work, torch.futures.Future] | None]) -> None:
        while (item := waits.get()) is not _STOP:
            work, fut = item
            try:
                work.wait()
            except Exception as exc:  # the collective's outcome, handed to whoever waits on it
                if self._claim(fut):
                    fut.set_exception(exc)
                continue
            if self._claim(fut):
                # gloo's work had no future and implements no result(): there is no value to pass on.
                fut.set_result([])

    def _error(self, reason: str) -> RuntimeError:
        return RuntimeError(f"{ABANDONED_MARKER} on group {self._name!r}: {reason}")
