"""Early signals that a node or one of its GPUs is going away, turned into planned migrations.

A scheduler announces a node's end before it happens: Slurm marks it DRAIN (or
FAIL, or puts a maintenance reservation on it), Kubernetes cordons it. Each
launcher's agent polls its node's sources off the training processes, on a
thread of its own so a slow ``scontrol`` never delays a heartbeat, and the
launcher's main loop posts the first signal of each source as a
``node_drain`` report: the controller then migrates, planned, every rank of
that node to spares elsewhere and retires the node's spares (they would only
be taken away with it).

Invariants:

* a source is polled at most once per ``signals.poll_interval_s``; a poll that
  fails (the scheduler's client not answering) is logged once per episode and
  retried at the next interval: it never stops the job, never signals;
* a source reports each thing once (a GPU, the node): a node that drains
  stays drained for this job (a later "resume" does not bring its ranks
  back), and a source that announced the node's end is not asked again;
* the watcher does nothing the training processes could wait on.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

__all__ = ["NodeSignal", "NodeSignalSource", "NodeSignalWatcher"]


@dataclass(frozen=True)
class NodeSignal:
    """A node is going away: what said so and why."""

    cause: str
    """The ledger's cause for the planned migration it starts (``slurm-drain``, ``slurm-maint``)."""
    reason: str
    """The scheduler's own words (Slurm's node reason), shown to the operator and kept in the ledger."""
    detail: dict[str, Any] = field(default_factory=dict)
    """What the source read (the node's state, a reservation's name and start), for the ledger's ``trigger``."""
    gpu: int | None = None
    """The slot (``LOCAL_RANK``) whose GPU is failing: only the process there moves. None: the whole node."""


class NodeSignalSource(Protocol):
    """One scheduler's view of this launcher's node."""

    name: str
    """Shown in log lines (``slurm``)."""

    def poll(self) -> list[NodeSignal]:
        """What the source announces now (each thing once); raises ``OSError``/``RuntimeError`` if it cannot tell."""
        ...


class NodeSignalWatcher:
    """Polls sources on a daemon thread; the launcher takes what they found with :meth:`take`."""

    def __init__(self, sources: list[NodeSignalSource], interval_s: float, say: Callable[[str], None]):
        self._sources = list(sources)
        self._interval_s = interval_s
        self._say = say
        self._found: queue.SimpleQueue[tuple[str, NodeSignal]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchpass-node-signals", daemon=True)

    def start(self) -> None:
        if self._sources:
            self._say(f"watching this node's scheduler state: {', '.join(s.name for s in self._sources)}")
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def take(self) -> list[tuple[str, NodeSignal]]:
        """(source name, signal) pairs found since the last call."""
        out = []
        while True:
            try:
                out.append(self._found.get_nowait())
            except queue.Empty:
                return out

    def _run(self) -> None:
        failing: set[str] = set()
        while self._sources and not self._stop.is_set():
            for source in list(self._sources):
                try:
                    found = source.poll()
                except (OSError, RuntimeError) as exc:
                    if source.name not in failing:
                        failing.add(source.name)
                        self._say(f"cannot read this node's state from {source.name} ({exc}); retrying every poll")
                    continue
                if source.name in failing:
                    failing.discard(source.name)
                    self._say(f"{source.name} answers again")
                for signal in found:
                    self._found.put((source.name, signal))
                if any(signal.gpu is None for signal in found):
                    self._sources.remove(source)  # the whole node goes: nothing more to watch there
            self._stop.wait(self._interval_s)
