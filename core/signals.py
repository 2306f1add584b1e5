"""A worker's signal handlers: SIGTERM is a request to hand the rank over, SIGUSR1 dumps every thread's stack.

SIGTERM is what schedulers send before they take a node (Slurm, Kubernetes):
instead of dying, the rank asks the controller for a planned migration and
keeps training until a spare has its state. The agent sends SIGUSR1 right
before it fences a worker, so the log shows where a silent rank was blocked;
faulthandler writes from the signal handler itself, so a thread blocked in C
code is dumped too.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
from typing import Any, Callable

from .failures import FENCE_DUMP_SIGNAL

__all__ = ["install_handlers"]


def install_handlers(on_term: Callable[[], None]) -> None:
    """``on_term`` runs (in the main thread, between bytecodes) on each SIGTERM."""
    faulthandler.register(FENCE_DUMP_SIGNAL, all_threads=True, file=sys.stderr)

    def handler(signum: int, frame: Any) -> None:
        del signum, frame
        on_term()

    signal.signal(signal.SIGTERM, handler)
