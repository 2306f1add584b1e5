"""TorchTitan's dataloader as the runtime's replayable data, with the loader's own state in snapshots.

The core's :class:`~torchpass.core.data.ReplayableData` replays a
re-executed step's batches from memory, and positions a spare's fresh
iterator by drawing and dropping batches. TorchTitan's text loaders never end
an epoch, so that would cost the spare a pass over every batch since the
start of training. TorchTitan's loaders are stateful instead
(``StatefulDataLoader``: a few KB of ``sample_idx`` and token buffer, which
differ per batch rank), so this subclass

* remembers, for each batch read, the loader state it was drawn from (taken
  when the next batch is requested, so no extra iterator is created and no
  RNG is drawn);
* adds to every snapshot the loader state from which the next batch to hand
  out is drawn, and the batch rank whose stream it is;
* fast-forwards a spare by loading that state into its loader, after checking
  the stream is its own;
* answers the loader's ``state_dict()`` with that same state, the position of
  the next batch the job trains on, so TorchTitan's own checkpoint records
  what a fault-free run would, even where this class has read ahead of it (a
  spare's fresh iterator holds its first batch as soon as it opens); and takes
  the state TorchTitan's checkpointer loads into the loader (a job resumed
  from its checkpoint) as where its stream starts.

A loader that runs out raises TorchTitan's ``DataloaderExhaustedError``
instead of starting a new epoch, so TorchTitan's ``train()`` ends training
exactly as without torchpass.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchpass.core.data import DataPosition, ReplayableData

__all__ = ["TitanData"]


class _Reiterable:
    """A re-iterable whose iterators come from ``start()`` (ReplayableData refuses one-shot iterators)."""

    def __init__(self, start: Any):
        self._start = start

    def __iter__(self) -> Iterator[Any]:
        return self._start()


class TitanData(ReplayableData):
    """Replayable batches of a TorchTitan dataloader (a ``Stateful``: ``state_dict``/``load_state_dict``).

    ``stream`` names the batch rank whose data the loader reads (e.g. ``"batch rank 1 of 2"``);
    a spare only accepts a data position of the same stream.
    """

    def __init__(self, loader: Any, *, stream: str, keep_steps: int):
        self.loader = loader
        self._loader_state = loader.state_dict
        self._load_loader_state = loader.load_state_dict
        # What TorchTitan's checkpointer saves and loads (it calls the loader's own methods).
        loader.state_dict = self.loader_state
        loader.load_state_dict = self.load_loader_state
        self.stream = stream
        self._start_state: Any = None
        """The loader state a fresh iterator starts from: None for the beginning, else what a spare loaded."""
        self._iterating = False
        self._drawn_from: dict[int, Any] = {}
        """Read index -> the loader state that batch was drawn from, for the batches still replayable."""
        self._marked: list[int] = []
        super().__init__(_Reiterable(self._iterate_loader), keep_steps=keep_steps)

    def _iterate_loader(self) -> Iterator[Any]:
        # Create the loader's iterator now, as iterating a DataLoader does: it draws
        # from the global RNG, which must happen where it happened in the original run.
        batches = iter(self.loader)
        self._iterating = True
        return self._draw(batches, self._start_state)

    def _draw(self, batches: Iterator[Any], state: Any) -> Iterator[Any]:
        from torchtitan.components.dataloader import DataloaderExhaustedError

        while True:
            self._drawn_from[self.read] = state
            try:
                batch = next(batches)
            except StopIteration:
                raise DataloaderExhaustedError() from None
            yield batch
            state = self._loader_state()

    def _next_state(self) -> Any:
        """The loader state the batch at ``position`` is drawn from."""
        if self.position in self._drawn_from:
            # Drawn already: a batch replayed, or read ahead of the position.
            return self._drawn_from[self.position]
        assert self.position >= self.read, f"batch {self.position} was read but its loader state was dropped"
        return self._loader_state() if self._iterating else self._start_state

    def loader_state(self) -> Any:
        """The loader's ``state_dict()`` as TorchTitan sees it: the state the next batch the job trains on is drawn from."""
        return self._next_state()

    def load_loader_state(self, state: Any) -> None:
        """The loader's ``load_state_dict()`` (TorchTitan resuming from its checkpoint): the stream starts there."""
        self._load_loader_state(state)
        self._start_state = state

    # ---- the runtime's side ----------------------------------------------
    def mark_step(self, step: int) -> None:
        super().mark_step(step)
        # The steps the base class keeps marks for: a re-executed step replaces later ones.
        self._marked = ([s for s in self._marked if s < step] + [step])[-self.keep_steps :]
        oldest = min((p for p in map(self.step_start, self._marked) if p is not None), default=self.position)
        for index in [i for i in self._drawn_from if i < oldest]:
            del self._drawn_from[index]

    def snapshot(self) -> DataPosition:
        return {**super().snapshot(), "loader": self._next_state(), "stream": self.stream}  # type: ignore[dict-item]

    def fast_forward(self, target: DataPosition) -> None:
        stream = target.get("stream")
        if stream != self.stream:
            raise RuntimeError(
                f"torchpass: this rank reads the data of {self.stream}, but the data position it was given is "
                f"that of {stream}: the small state came from a rank of another batch coordinate"
            )
        state = target["loader"]
        if state is not None:
            self._load_loader_state(state)
        self._start_state = state
        self._iterating = False
        self._drawn_from.clear()
        self._marked.clear()
        # The loaded state already stands at the target: the fresh iterator has nothing to skip.
        super().fast_forward({**target, "in_epoch": 0})
        self.in_epoch = target["in_epoch"]
        if self._drawn_from:
            # Opening the iterator drew the batch at the target already (before the
            # position was set, so under the wrong index): it was drawn from `state`.
            self._drawn_from = {self.read: state}
