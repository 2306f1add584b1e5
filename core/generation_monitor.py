"""The generation monitor: a worker's view of which generation it is in, and the moment that generation ends.

A generation ends when the controller, or any member, writes ``g/<g>/end``
(a fault, a drain, a transient failure). Every member must learn it at once,
wherever its training thread is: blocked in a collective on a dead peer,
waiting at a buddy gate, or computing. So a thread blocks on the key
(a server-side wait: nothing polls) and, when it appears while the worker is
still in that generation, sets ``ending`` and calls ``on_end``, which releases
the generation's process groups and gates so blocked calls return.

Invariant: ``on_end`` runs at most once per generation, and never for a
generation the worker has already left (its main thread may rebuild faster
than this thread wakes).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Callable

from .control import Keys, StoreAddress

__all__ = ["GenerationMonitor"]


class GenerationMonitor:
    """Holds the worker's generation and watches for its end (see the module docstring)."""

    def __init__(self, address: StoreAddress, wait_deadline: timedelta, on_end: Callable[[int, str], None]):
        self._address = address
        self._wait_deadline = wait_deadline
        self._on_end = on_end
        self._cv = threading.Condition()
        self.generation = 0
        self.ending = threading.Event()
        """Set once the current generation has ended (cleared when the worker enters the next)."""
        self.reason = ""
        """Why the last generation that ended did."""

    def start(self) -> None:
        threading.Thread(target=self._run, name="torchpass-monitor", daemon=True).start()

    def enter(self, generation: int) -> None:
        """The worker now belongs to ``generation``."""
        with self._cv:
            self.generation = generation
            self.ending.clear()
            self._cv.notify_all()

    def _run(self) -> None:
        store = self._address.connect()
        while True:
            g = self.generation
            key = Keys.end(g)
            store.wait([key], self._wait_deadline)
            reason = store.get(key).decode()
            if self.generation == g:
                self.reason = reason
                self.ending.set()
                self._on_end(g, reason)
            with self._cv:
                self._cv.wait_for(lambda: self.generation > g)
