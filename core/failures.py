"""Failure facts the worker and its agent share: what a failed collective's error says, how a fence asks for a stack.

A worker classifies an exception raised inside a step (migrate, or let it
propagate as a bug in the script); its agent classifies the uncaught exception
a worker died of (migrate the rank to a spare, or stop the job because a spare
would repeat it). Both must agree, or a worker dying of a gloo timeout would
be migrated by one reading and stop the job by the other.
"""

from __future__ import annotations

import signal

__all__ = [
    "ABANDONED_MARKER",
    "COMM_ERROR_MARKERS",
    "DEVICE_FAILURE_MARKERS",
    "FENCE_DUMP_SIGNAL",
    "is_comm_error",
    "is_device_failure",
]

FENCE_DUMP_SIGNAL = signal.SIGUSR1
"""Sent by an agent right before it fences a worker: the worker writes every thread's stack to its log."""

ABANDONED_MARKER = "torchpass: collective abandoned"
"""Opens the error of a collective that was pending when its generation ended (see ``comms``)."""

COMM_ERROR_MARKERS = (
    ABANDONED_MARKER,
    "gloo",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket Timeout",
    "Timed out waiting",
    "NCCL",
)
"""Substrings of the messages c10d, gloo and NCCL raise when a peer or the transport went away."""


def is_comm_error(message: str) -> bool:
    """Whether an error message says a collective failed because a peer or the transport went away."""
    return any(marker in message for marker in COMM_ERROR_MARKERS)


DEVICE_FAILURE_MARKERS = (
    "uncorrectable ECC error",
    "uncorrectable NVLink error",
    "hardware stack error",
    "GPU has fallen off the bus",
    "CUDA-capable device(s) is/are busy or unavailable",
)
"""Substrings of CUDA errors that a failing GPU raises, not the script: a spare on another GPU does not
repeat them. An illegal address or a device-side assert is the script's own (a spare would repeat it)."""


def is_device_failure(message: str) -> bool:
    """Whether an error message says the process's GPU failed (see :data:`DEVICE_FAILURE_MARKERS`)."""
    return any(marker in message for marker in DEVICE_FAILURE_MARKERS)
