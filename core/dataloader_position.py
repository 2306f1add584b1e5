"""Opening a pass of a torch ``DataLoader`` at batch ``n`` without loading the batches before it.

A spare joins where the job stands, often deep inside an epoch. Drawing and
dropping the batches before that point loads and collates every one of them
(a tokenized shard, decoded images): minutes on a large epoch, spent while
the job waits. For a map-style dataset the batches are fixed by the indices
the loader's (batch) sampler yields, so :func:`open_at` advances the
iterator's index stream instead: the sampler runs (a permutation for the
epoch, as it would), no sample is fetched.

* single-process loading: the index stream is advanced by ``n``;
* worker processes: the iterator has already sent its first
  ``prefetch_factor x num_workers`` indices to the workers when it is
  created; the stream is advanced past the rest of the first ``n``, then the
  prefetched batches are drawn and dropped (their slots refill from batch
  ``n`` on), so at most that many batches are loaded in vain;
* an iterable-style dataset, or an iterator without an index stream: the
  first ``n`` batches are drawn and dropped.

The index stream is advanced through the iterator's own ``_next_index`` and
its count of batches handed out (``_num_yielded``) moved on as if they had
been, so an iterator that keeps its position for a checkpoint (torchdata's
``StatefulDataLoader``) reports the position the pass really has. Relies on
the iterator internals of torch 2.13 (``_next_index``, ``_num_yielded``,
``_send_idx``, ``_rcvd_idx``), which the version pin fixes, and torchdata's
copies of them; ``tests/core/test_dataloader_position.py`` checks both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _DatasetKind

__all__ = ["open_at"]


def open_at(loader: DataLoader, skip: int, start: Callable[[DataLoader], Iterator[Any]] = DataLoader.__iter__) -> Iterator[Any]:
    """A new pass of ``loader`` whose first batch is batch ``skip`` of the pass (see the module docstring).

    ``start`` opens a pass: ``DataLoader.__iter__`` unless it is hooked.
    """
    it = start(loader)
    if skip <= 0:
        return it
    if loader._dataset_kind != _DatasetKind.Map or not hasattr(it, "_next_index"):
        for _ in range(skip):
            next(it)
        return it
    in_flight = it._send_idx - it._rcvd_idx if hasattr(it, "_send_idx") else 0
    advanced = max(0, skip - in_flight)
    for _ in range(advanced):
        it._next_index()
    it._num_yielded += advanced
    for _ in range(skip - advanced):
        next(it)
    return it
