"""A worker waiting for the controller's answers: its assignment, a generation's plan, and ``go``.

The controller always answers each of these keys, with the answer or with a
notice that the job stopped, so a worker blocks on a server-side store wait
(nothing polls). The wait is bounded all the same: a dead store fails it, and a
stopped or unreachable one ends the process through the worker's
:class:`~torchpass.core.liveness.StoreWatchdog` within ``store_timeout_s``.
When the answer is that the job stopped, the worker exits with
:data:`STOPPED_EXIT` and the controller's reason.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from .control import Keys, Plan

__all__ = ["ControllerAnswers", "STOPPED_EXIT", "UNTIL_ANSWERED"]

STOPPED_EXIT = 3
"""Exit code of a worker whose job the controller stopped while it waited for an answer."""

UNTIL_ANSWERED = timedelta(days=365)
"""The deadline of a wait for a key that is always written in the end (see the module docstring for the real bound)."""


class ControllerAnswers:
    """The waits of one worker; ``who()`` names it in the messages (its rank may change when a spare is assigned)."""

    def __init__(self, store: dist.Store, who: Callable[[], str]):
        self._store = store
        self._who = who

    def _wait(self, key: str) -> bytes:
        self._store.wait([key], UNTIL_ANSWERED)
        return self._store.get(key)

    def assignment(self, wid: str) -> dict[str, Any]:
        """A spare's assignment: ``{"rank", "generation"}``, or ``{"exit": why}`` when the job ends without it."""
        return json.loads(self._wait(Keys.assign(wid)))

    def plan(self, generation: int) -> Plan:
        data = json.loads(self._wait(Keys.plan(generation)))
        if "shutdown" in data:
            self.exit_stopped(data["shutdown"])
        return Plan(**data)

    def go(self, generation: int) -> bool:
        """True on ``go``; False when this attempt was aborted (the controller plans again)."""
        outcome = self._wait(Keys.go(generation)).decode()
        if outcome.startswith("abort") and self._store.check([Keys.shutdown]):
            self.exit_stopped(self._store.get(Keys.shutdown).decode())
        return outcome == "go"

    def exit_stopped(self, reason: str) -> None:
        print(f"[torchpass] {self._who()}: job stopped by the controller: {reason}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(STOPPED_EXIT)
