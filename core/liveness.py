"""Liveness: heartbeats, staleness judged on the observer's clock, and the bound on losing the store.

Three rules hold for every process of a job:

* **A writer's clock is never compared with a reader's.** A heartbeat carries a
  sequence number; the reader (:class:`BeatWatch`) notes, on its own monotonic
  clock, when the number last grew. *Grew*, not changed: a stranger can copy
  genuine sealed beats and write them back later (docs/design.md, section
  12b), and replaying old beats in turn must not keep a dead process alive. Node 0's controller reads agents and
  workers on other hosts, whose wall clocks may be seconds apart or step under
  NTP; a monotonic clock read by one process is the only safe measure. The
  cost: a beat is judged from when the reader first saw it, so a silence is
  caught at most one reading interval later than the timeout.
* **No process outlives the store by more than** ``store_timeout_s``. The store
  lives in node 0's launcher with the controller; if node 0 is killed,
  stopped or cut off, every other process must go, or its GPUs stay held by a
  job nobody runs. A TCPStore client gives no such bound itself (a request to a
  stopped server blocks for good, whatever the client's timeout), so each
  process runs a :class:`StoreWatchdog`: the store operation it does anyway at
  a fixed rate (a heartbeat) marks the store alive, and a silence past the
  bound ends the process with :data:`STORE_LOST_EXIT` and a message (an
  agent first kills its workers).
* **A silent heartbeat alone does not make a local worker hung.** A worker's
  heartbeat thread needs the GIL, and an import that loads a large extension
  holds it through the load: on a loaded machine (5 processes importing
  DeepSpeed on 2 cores) a healthy worker once went 3.1 s without a beat and was
  fenced before its first step. Its agent also reads the worker's CPU time
  (:func:`cpu_ticks`, another beat; :class:`HangWatch`): a worker is hung only when both have stood
  still past the timeout. A stopped process (SIGSTOP) or one blocked with the
  GIL held uses no CPU and is caught as fast as before; one that spins without
  beating is left to the hang timeout on step progress.
* **A worker never outlives its agent** (see ``core/worker.py``: the parent-death
  signal), so a killed agent leaves no orphan behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Hashable

import torch.distributed as dist

from .control import Heartbeat, Keys, StoreAddress, put

__all__ = ["STORE_LOST_EXIT", "BeatWatch", "HangWatch", "cpu_ticks", "StoreWatchdog", "Heartbeater", "die_with_parent"]

STORE_LOST_EXIT = 75
"""Exit code of a worker or launcher that lost the store (EX_TEMPFAIL: node 0 went away, not this process's fault)."""


class BeatWatch:
    """How long each heartbeat has gone without growing, on this process's monotonic clock.

    A beat is anything ordered that its writer only ever increases (a sequence
    number; a ``(generation, step)`` pair for the job's progress). A beat no
    greater than the largest seen is a replay or a rollback: it does not count.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._seen: dict[Hashable, tuple[Any, float]] = {}

    def age(self, who: Hashable, beat: Any) -> float:
        """Seconds since ``who``'s beat last grew past what this watch saw (0 when it just did)."""
        now = self._clock()
        seen = self._seen.get(who)
        if seen is None or beat > seen[0]:
            self._seen[who] = (beat, now)
            return 0.0
        return now - seen[1]

    def forget(self, who: Hashable) -> None:
        self._seen.pop(who, None)


def cpu_ticks(pid: int) -> int | None:
    """User plus system CPU time a local process has used, in clock ticks; None where /proc cannot tell
    (the process is gone, or the platform has no /proc), and the caller judges by heartbeats alone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; the fields after its last ')' start at 3.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


class HangWatch:
    """Whether a local worker is hung: its heartbeat and its CPU time both stood still past the timeout.

    Both are read on every scan, so that the CPU's silence is dated as precisely as the heartbeat's.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, ticks: Callable[[int], int | None] = cpu_ticks):
        self._beats = BeatWatch(clock)
        self._cpu = BeatWatch(clock)
        self._ticks = ticks

    def hung(self, who: Hashable, pid: int, seq: int, timeout_s: float) -> str | None:
        """Why ``who`` (process ``pid``, last heartbeat ``seq``) is hung, or None while either still moves."""
        age = self._beats.age(who, seq)
        ticks = self._ticks(pid)
        idle = age if ticks is None else self._cpu.age(who, ticks)
        if min(age, idle) <= timeout_s:
            return None
        return f"stopped heartbeating {age:.1f} s ago and used no CPU for {idle:.1f} s (hung)"


class StoreWatchdog(threading.Thread):
    """Calls ``on_lost`` once no store operation has succeeded (``alive()``) for ``bound_s`` seconds.

    ``on_lost`` must end the process: the thread that should have marked the
    store alive is blocked in a request that will never return.
    """

    def __init__(self, bound_s: float, on_lost: Callable[[float], None], name: str = "torchpass-store-watchdog"):
        super().__init__(name=name, daemon=True)
        self.bound_s = bound_s
        self._on_lost = on_lost
        self._last = time.monotonic()
        self.start()

    def alive(self) -> None:
        """A store operation just succeeded."""
        self._last = time.monotonic()

    def run(self) -> None:
        period = min(1.0, self.bound_s / 4)
        while True:
            time.sleep(period)
            silent = time.monotonic() - self._last
            if silent > self.bound_s:
                self._on_lost(silent)
                return


class Heartbeater(threading.Thread):
    """Writes a worker's ``hb/<wid>`` every ``interval_s`` on its own connection, and marks the store alive.

    ``state()`` gives the worker's (step, generation, phase) at each beat: the
    controller reads the step for progress and the phase to say where a
    silent rank was. A TCPStore ``set`` returns once the request is in the
    socket's buffer, answered or not, so it proves nothing about the store: every
    few beats (a quarter of the watchdog's bound) a beat is followed by a request
    that waits for its answer, and only that marks the store alive.
    """

    def __init__(
        self,
        address: StoreAddress,
        wid: str,
        interval_s: float,
        state: Callable[[], tuple[int, int, str]],
        watchdog: StoreWatchdog,
    ):
        super().__init__(name="torchpass-heartbeat", daemon=True)
        self._address = address
        self._key = Keys.heartbeat(wid)
        self._wid = wid
        self._interval_s = interval_s
        self._state = state
        self._watchdog = watchdog
        # A round trip a quarter of the watchdog's bound apart: one extra request per several beats.
        self._probe_every = max(1, int(watchdog.bound_s / 4 / interval_s))
        self._stopped = threading.Event()
        self.start()

    def stop(self) -> None:
        """End the thread after its current beat (a worker's heartbeats last as long as the process)."""
        self._stopped.set()

    def run(self) -> None:
        store = self._address.connect()
        seq = 0
        while not self._stopped.is_set():
            seq += 1
            step, generation, phase = self._state()
            try:
                put(store, self._key, Heartbeat(time.time(), step, generation, phase, seq))
                if seq % self._probe_every == 0:
                    store.check([self._key])
                    self._watchdog.alive()
            except dist.DistError as exc:
                # The watchdog ends the process if this lasts; until then, say why and retry.
                print(f"[torchpass] {self._wid}: heartbeat to the store failed: {exc}; reconnecting", file=sys.stderr, flush=True)
                self._stopped.wait(self._interval_s)
                try:
                    store = self._address.connect(timeout=self._interval_s * 4)
                except dist.DistError as again:
                    print(f"[torchpass] {self._wid}: cannot reach the store: {again}", file=sys.stderr, flush=True)
                continue
            self._stopped.wait(self._interval_s)


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent (the agent) dies; exit now if it already has.

    Workers run in their own session (so a fence can kill a worker's whole
    process group), which also detaches them from the agent's fate: without
    this, an agent killed outright would leave its workers running. Linux
    only; elsewhere the store watchdog still ends them within ``store_timeout_s``.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        # The agent died before the request took effect.
        print(f"[torchpass] worker {os.getpid()}: its launcher (pid {parent_pid}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(STORE_LOST_EXIT)
