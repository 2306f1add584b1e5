"""NCCL inner groups: built per generation, released by abort, never shut down on a survivor.

A :class:`~torchpass.core.comms.RebuildableProcessGroup` whose CUDA tensors go
over NCCL gets, each generation, a fresh ``ProcessGroupNCCL`` from
:func:`connect`:

1. on the generation's own store prefix, with the same ranks (the spare in the
   dead rank's place): a new NCCL unique id, so no communicator of an older
   generation is ever reused;
2. *nonblocking* (``config.blocking = 0``): NCCL documents ``ncclCommAbort``
   as safe only on nonblocking communicators, and a nonblocking communicator
   never holds a thread inside NCCL waiting on a peer;
3. connected eagerly on the process's current device (the one the framework
   selected with ``set_device``), so the rebuild pays the communicator set-up
   and the first step does not.

Release (:func:`abort_together`) aborts every NCCL communicator of the ending
generation inside one ``ncclGroupStart``/``ncclGroupEnd``, from the thread that
detected the end (never the training thread, which may be blocked in a
``wait``): aborting communicators one by one can deadlock, because a kernel of
one waits on a peer that is blocked in another. Abort makes stuck kernels exit
and fails their works, so a survivor blocked on a dead peer returns with an
error the runtime classifies as a transport failure. ``shutdown()`` and
``destroy_process_group`` are never called on a survivor's group: both wait
for kernels that a dead peer never completes.

The watchdog: ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` decides what torch does when
a collective fails or times out. Its modes 1 and 3 terminate the process, which
would turn every survivor of a failure into a failed rank; :func:`worker_environment`
sets 0 (torchpass aborts) unless the user set it, and :func:`check_environment`
names a value that would kill survivors.

Requires of the training loop: ``torch.cuda.set_device`` before the group's
first generation is built (what every framework does before
``init_process_group``); one GPU per process (NCCL refuses two ranks on one
GPU).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "ERROR_HANDLING_ENV",
    "available",
    "abort_together",
    "check_environment",
    "connect",
    "worker_environment",
]

ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_SAFE_ERROR_HANDLING = ("0", "2")
"""0: no handling (torchpass aborts); 2: abort the communicator only. 1 and 3 end the process."""


def available() -> bool:
    """Whether this torch build has NCCL (the CPU wheel has not)."""
    return dist.is_nccl_available()


def worker_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What a worker's environment needs for NCCL groups torchpass can release: added only where unset."""
    return {} if ERROR_HANDLING_ENV in env else {ERROR_HANDLING_ENV: "0"}


def check_environment(env: Mapping[str, str]) -> str | None:
    """A warning naming a watchdog setting that would terminate survivors, or None."""
    value = env.get(ERROR_HANDLING_ENV)
    if value is None or value in _SAFE_ERROR_HANDLING:
        return None
    return (
        f"{ERROR_HANDLING_ENV}={value} makes torch terminate a process whose NCCL collective fails: every survivor "
        f"of a failure would die with it. Unset it (torchpass then sets 0 and aborts communicators itself) or set 0 or 2."
    )


def connect(
    store: dist.Store, rank: int, size: int, timeout: timedelta, group_name: str, global_ranks: Sequence[int]
) -> dist.ProcessGroup:
    """A nonblocking ``ProcessGroupNCCL`` on ``store``, connected on the current CUDA device before it returns."""
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts.config.blocking = 0
    opts._timeout = timeout
    opts.group_name = group_name
    opts.global_ranks_in_group = list(global_ranks)
    backend = ProcessGroupNCCL(store, rank, size, opts)
    backend.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
    return backend


def abort_together(backends: Sequence[dist.ProcessGroup]) -> None:
    """Abort ``backends`` (``ProcessGroupNCCL``) inside one NCCL group call; returns once each abort is issued."""
    if not backends:
        return
    backends[0]._group_start()
    try:
        for backend in backends:
            backend.abort()
    finally:
        backends[0]._group_end()
