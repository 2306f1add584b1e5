"""Device state to page-locked host memory, copied off the training stream.

Everything the migration protocol moves (published copies, buddy snapshots,
fingerprints, the wire) works on host bytes. A capture therefore stages each
CUDA tensor into page-locked (pinned) host memory:

1. per device, a side stream first waits for the device's current stream, so
   it sees every kernel queued before the capture (the state at this version);
2. every tensor of the capture is copied device-to-host on that stream,
   asynchronously, into pinned buffers from torch's caching host allocator
   (reused across captures: no ``cudaHostAlloc`` per step once warm);
3. one event per device is waited on before the copies are handed out.

The training stream never waits on the side stream: only the capturing thread
waits, and only for its own copies. A buddy snapshot (:mod:`torchpass.core.buddy`)
does not make the training thread wait at all: its capture keeps the live CUDA
tensors with an event per device (:func:`mark_ready`), and the buddy thread
stages them later, its side stream waiting on those events, while the next
step's forward and backward run; the gate before that step's optimizer update
(``wait_copied``) keeps the update from overwriting them first.

Pinned memory is what lets the copy run at the link's speed and asynchronously;
pageable memory makes each copy synchronous and bounces it through a driver
buffer (measured on an H200: 1.1-1.3 GB/s pageable against 54 GB/s pinned).

A receiver restores through the framework's own ``load_state_dict`` (or the
provider's in-place copy), which copies host tensors onto the parameters'
devices: the host copy it received is the staging buffer.

Requires of the training loop: nothing; a capture may run on any thread that
has the capture's devices available.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

__all__ = ["StagingFigures", "mark_ready", "measure", "pinned_like", "stage_to_host"]

_streams: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


def pinned_like(t: torch.Tensor) -> torch.Tensor:
    """An empty page-locked host tensor of ``t``'s shape and dtype (torch's caching host allocator)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


def mark_ready(devices: Iterable[torch.device]) -> dict[torch.device, torch.cuda.Event]:
    """An event on each of ``devices``' current stream: the point a later :func:`stage_to_host` must see."""
    return {device: torch.cuda.current_stream(device).record_event() for device in devices}


def stage_to_host(
    tensors: Sequence[torch.Tensor],
    into: Sequence[torch.Tensor] | None = None,
    after: dict[torch.device, torch.cuda.Event] | None = None,
) -> list[torch.Tensor]:
    """Pinned host copies of contiguous CUDA ``tensors``, returned once complete.

    ``into``: pinned host buffers of the same shapes and dtypes to copy into (new ones when None).
    ``after``: the per-device events (:func:`mark_ready`) the copies wait for, when they are issued
    from another thread later than the point they must see; by default they see everything queued on
    the devices' current streams now.
    """
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.device.type != "cuda":
            raise TypeError(f"stage_to_host: tensor {i} is on {t.device}, not a CUDA device")
        if not t.is_contiguous():
            raise ValueError(f"stage_to_host: tensor {i} is not contiguous")
        by_device.setdefault(t.device, []).append(i)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    events = []
    for device, indices in by_device.items():
        side = _side_stream(device)
        if after is not None:
            side.wait_event(after[device])
        else:
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for i in indices:
                host = into[i] if into is not None else pinned_like(tensors[i])
                host.copy_(tensors[i], non_blocking=True)
                out[i] = host
        events.append(side.record_event())
    for event in events:
        event.synchronize()
    return out  # type: ignore[return-value]


@dataclass
class StagingFigures:
    """Device-to-host throughput of one size: staged (this module), a bare ``cudaMemcpy`` into a
    pinned buffer allocated once (the bound), and a pageable ``.cpu()``."""

    nbytes: int
    staged_gbps: float
    memcpy_pinned_gbps: float
    pageable_gbps: float

    @property
    def ratio(self) -> float:
        """Staged against the bare copy: 1.0 means staging costs nothing beyond the copy."""
        return self.staged_gbps / self.memcpy_pinned_gbps


def measure(nbytes: int, device: torch.device, repeats: int = 5) -> StagingFigures:
    """Median GB/s over ``repeats`` of the three copies of :class:`StagingFigures` (benchmarks, GPU tests)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def timed(fn) -> float:
        fn()  # warm: the host allocator's first pinned block, the copy engines' first launch
        torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return nbytes / sorted(times)[len(times) // 2] / 1e9

    return StagingFigures(
        nbytes,
        staged_gbps=timed(lambda: stage_to_host([src])),
        memcpy_pinned_gbps=timed(lambda: pinned.copy_(src)),
        pageable_gbps=timed(lambda: src.cpu()),
    )
