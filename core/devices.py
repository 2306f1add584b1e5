"""Which GPU each process of a node owns, and what its environment says about it.

A node runs ``nproc`` active workers in slots ``0 .. nproc-1`` and its spares
in slots ``nproc .. nproc+spares-1``. Slot ``i`` owns the node's GPU ``i`` (the
``i``-th device the launcher sees, so ``CUDA_VISIBLE_DEVICES`` given to the
launcher still selects and orders them). The slot is the process's
``LOCAL_RANK`` for its whole life:

* a spare that takes over rank ``r`` keeps ``LOCAL_RANK`` = its own slot, so
  the framework's ``torch.cuda.set_device(LOCAL_RANK)`` lands on the spare's
  own GPU, never on the failed rank's (which may be the failed device);
  ``RANK`` becomes ``r`` and ``LOCAL_WORLD_SIZE`` stays ``nproc``, the ranks
  per node the job was written for;
* ``CUDA_VISIBLE_DEVICES`` is passed through unchanged, so a device index means
  the same GPU in every process of the node, the health watch's included
  (:mod:`torchpass.core.gpu_health` reads slot ``i``'s GPU ``i``);
* a spare makes its CUDA context on its GPU while it waits
  (:func:`warm_spare`), so joining does not pay the context's creation.

``--nproc-per-node``: ``gpu`` is the GPUs left after the spares' (each spare
owns one); ``auto`` is ``gpu`` where the node has GPUs and the CPU count
otherwise (torchrun's meaning); ``cpu`` is the CPU count.

A CUDA context that a sticky error broke (an illegal address, a device-side
assert, an uncorrectable ECC error, a GPU fallen off the bus) fails every
later CUDA call, so such a process must never survive a migration: a
survivor checks its context (:func:`cuda_context_error`) before it offers its
state, and leaves with :data:`CUDA_BROKEN_EXIT` if it is broken; its rank then
moves to a spare like any failed rank's. More slots than GPUs
is allowed (every rank of a gloo job may share one GPU) and said once: NCCL
refuses two ranks on one GPU.
"""

from __future__ import annotations

import torch

from .config import positive_int

__all__ = ["CUDA_BROKEN_EXIT", "cuda_context_error", "gpu_count", "nproc_per_node", "sharing_note", "warm_spare"]

CUDA_BROKEN_EXIT = 76
"""The exit code of a survivor whose CUDA context a sticky error broke: it leaves as a failed rank."""


def gpu_count() -> int:
    """GPUs this process sees (0 on a CPU build); creates no CUDA context."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nproc_per_node(value: str, spares: int, gpus: int, cpus: int) -> int:
    """Active workers per node for ``--nproc-per-node value``; raises ValueError naming what is wrong."""
    if value == "cpu" or (value == "auto" and gpus == 0):
        return cpus
    if value in ("gpu", "auto"):
        if gpus == 0:
            raise ValueError("--nproc-per-node gpu: this node has no GPU torch can use; give a number, 'cpu' or 'auto'")
        if gpus <= spares:
            raise ValueError(
                f"--nproc-per-node {value}: the node's {gpus} GPU(s) leave none for workers once each of the "
                f"{spares} spare(s) owns one; lower --spares-per-node or give a number of workers"
            )
        return gpus - spares
    return positive_int(value, "--nproc-per-node", ("gpu", "cpu", "auto"))


def sharing_note(nproc: int, spares: int, gpus: int) -> str | None:
    """A line naming the slots that have no GPU of their own, or None when every slot has one (or none has)."""
    slots = nproc + spares
    if gpus == 0 or slots <= gpus:
        return None
    return (
        f"{slots} processes ({nproc} worker(s), {spares} spare(s)) on {gpus} GPU(s): slots {gpus}..{slots - 1} "
        f"have no GPU of their own (LOCAL_RANK >= {gpus}); fine for gloo on a shared device, but NCCL refuses two "
        f"ranks on one GPU"
    )


def warm_spare(slot: int) -> bool:
    """Make this spare's CUDA context on its own GPU (slot ``slot``) while it waits; False where it has none."""
    if slot >= gpu_count():
        return False
    torch.cuda.set_device(slot)
    torch.empty(1, device=f"cuda:{slot}")
    return True



def cuda_context_error() -> str | None:
    """Why this process's CUDA context is unusable, or None (also when it has none).

    A sticky error makes every later CUDA call raise it again, a synchronize included;
    a recoverable one (out of memory) does not surface here."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    try:
        torch.cuda.synchronize()
    except RuntimeError as exc:  # CUDA errors surface as RuntimeError (torch.AcceleratorError is one)
        return str(exc).strip().splitlines()[0]
    return None
