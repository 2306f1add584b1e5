"""A data iterator the runtime can rewind to a step boundary and fast-forward for a spare.

"Same step, same data" means a re-executed step must see exactly the batches
the interrupted one saw, and a spare must continue where the rank it replaces
stood. :class:`ReplayableData` wraps the user's iterable and

* counts batches handed out (``position``) and remembers where each recent
  step started, keeping the batches read since the oldest kept step start, so
  :meth:`seek` back to a kept step boundary replays them from memory;
* owns epochs: when the iterable is exhausted it starts the next epoch,
  calling ``set_epoch`` on the loader's sampler (or the iterable) first, as
  ``DistributedSampler`` requires;
* fast-forwards a fresh iterator to any (epoch, batch-in-epoch) position: a
  torch ``DataLoader`` over a map-style dataset, or a source that says how
  (:class:`PositionedSource`), opens the pass at that batch without loading
  the ones before it (:mod:`.dataloader_position`); any other source draws
  and drops them, which costs time proportional to the position inside the
  epoch. A spare pays it once, while its state is being fetched; with
  ``lazy_fast_forward`` it pays it at its first batch instead, so that
  per-epoch set-up the training loop does first, such as ``set_epoch``,
  applies to the fresh iterator;
* starts each epoch's iterator with the global torch RNG saved and restored
  around it: a DataLoader draws its workers' base seed there, and a step
  executed again replays its batches from memory without starting the
  iterator, so the draw must not move the RNG stream the step's forward uses.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable, Iterator, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader

from .dataloader_position import open_at

__all__ = ["ReplayableData", "DataPosition", "PositionedSource"]


@runtime_checkable
class PositionedSource(Protocol):
    """A re-iterable data source that can open a pass at a given batch without loading the ones before it."""

    def __iter__(self) -> Iterator[Any]: ...

    def open_at(self, skip: int) -> Iterator[Any]:
        """A new pass whose first batch is batch ``skip`` of the pass."""
        ...

DataPosition = dict[str, int]

_END = object()
"""Marks an exhausted epoch (and an empty primed slot)."""


class ReplayableData:
    """Wraps ``source`` (any re-iterable: a DataLoader, a list, a dataset)."""

    def __init__(self, source: Iterable[Any], keep_steps: int = 1, lazy_fast_forward: bool = False):
        if isinstance(source, Iterator):
            raise TypeError(
                "torchpass needs a re-iterable data source (a DataLoader, a dataset), not a one-shot iterator: "
                "a new epoch and a spare's fast-forward both start a fresh iteration"
            )
        self.source = source
        self.keep_steps = max(1, keep_steps)
        self.lazy_fast_forward = lazy_fast_forward
        self._skip_on_open = 0
        """Batches the next epoch iterator drops when it opens (a lazy fast-forward)."""
        self.epoch = 0
        self.in_epoch = 0
        """Batches read from the source in the current epoch."""
        self.read = 0
        """Batches read from the source in total."""
        self.position = 0
        """Batches handed to the training loop, replays excluded."""
        self._iter: Iterator[Any] | None = None
        self._primed: Any = _END
        """The epoch's first unread batch, read when the epoch's iterator started."""
        # (epoch, index in epoch, batch) of every batch read since the oldest kept step start.
        self._cache: deque[tuple[int, int, Any]] = deque()
        self._replay: deque[tuple[int, int, Any]] = deque()
        self._marks: deque[tuple[int, int]] = deque()

    # ---- the training loop's side ----------------------------------------
    def next_batch(self) -> Any:
        if self._replay:
            self.position += 1
            return self._replay.popleft()[2]
        entry = self._read()
        self._cache.append(entry)
        self.position += 1
        return entry[2]

    def replays_next(self, batch: Any) -> bool:
        """Whether the next batch handed out is ``batch`` itself, from memory."""
        return bool(self._replay) and self._replay[0][2] is batch

    @property
    def replaying(self) -> bool:
        """Whether the next batch comes from memory (a step executed again)."""
        return bool(self._replay)

    def _read(self) -> tuple[int, int, Any]:
        if self._iter is None:
            self._start_epoch(skip=self._skip_on_open)
            self._skip_on_open = 0
        batch = self._next_in_epoch()
        if batch is _END:
            self.epoch += 1
            self._start_epoch()
            batch = self._next_in_epoch()
            if batch is _END:
                raise RuntimeError("the data source yields no batches")
        self.in_epoch += 1
        self.read += 1
        return self.epoch, self.in_epoch - 1, batch

    def _next_in_epoch(self) -> Any:
        if self._primed is not _END:
            batch, self._primed = self._primed, _END
            return batch
        assert self._iter is not None
        return next(self._iter, _END)

    def _start_epoch(self, skip: int = 0) -> None:
        sampler = getattr(self.source, "sampler", None)
        for target in (sampler, getattr(self.source, "batch_sampler", None), self.source):
            set_epoch = getattr(target, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)
                break
        # The first batch is read here too: a lazy iterator (a generator over a
        # DataLoader) starts its DataLoader, and draws, only when first advanced.
        with torch.random.fork_rng(devices=[]):
            self._iter = self._open(skip)
            self._primed = next(self._iter, _END)
        self.in_epoch = skip

    def _open(self, skip: int) -> Iterator[Any]:
        if isinstance(self.source, PositionedSource):
            return self.source.open_at(skip)
        if isinstance(self.source, DataLoader):
            return open_at(self.source, skip)
        it = iter(self.source)
        for _ in range(skip):
            next(it)
        return it

    # ---- the runtime's side ----------------------------------------------
    def mark_step(self, step: int) -> None:
        """Record that ``step`` starts at the current position; drop batches no kept step needs.

        A re-executed step replaces its own mark and those of later steps, which did
        not happen as far as the data is concerned.
        """
        while self._marks and self._marks[-1][0] >= step:
            self._marks.pop()
        self._marks.append((step, self.position))
        while len(self._marks) > self.keep_steps:
            self._marks.popleft()
        oldest = self._marks[0][1]
        cached_from = self.read - len(self._cache)
        while self._cache and cached_from < oldest:
            self._cache.popleft()
            cached_from += 1

    def step_start(self, step: int) -> int | None:
        """Position at which a kept ``step`` started, if it is still kept."""
        for s, pos in self._marks:
            if s == step:
                return pos
        return None

    def snapshot(self) -> DataPosition:
        """Where the loop stands, for mirrors and for a spare to fast-forward to."""
        if self._replay:
            epoch, index, _ = self._replay[0]
            return {"position": self.position, "epoch": epoch, "in_epoch": index}
        return {"position": self.position, "epoch": self.epoch, "in_epoch": self.in_epoch}

    def seek(self, position: int) -> None:
        """Move to ``position`` (batches handed out), replaying cached batches or reading ahead."""
        cached_from = self.read - len(self._cache)
        if position < cached_from:
            raise RuntimeError(
                f"cannot rewind the data to batch {position}: only batches from {cached_from} on are kept"
            )
        if position > self.read:
            for _ in range(position - self.read):
                self._cache.append(self._read())
        self._replay = deque(list(self._cache)[position - cached_from :])
        self.position = position

    def fast_forward(self, target: DataPosition) -> None:
        """Position a fresh iterator at ``target`` (a spare joining mid-training)."""
        self.epoch = target["epoch"]
        self._cache.clear()
        self._replay.clear()
        self._marks.clear()
        if self.lazy_fast_forward:
            self._iter, self._primed = None, _END
            self._skip_on_open = self.in_epoch = target["in_epoch"]
        else:
            self._start_epoch(skip=target["in_epoch"])
        self.read = self.position = target["position"]
