"""The data iterator megatron-core's forward-backward function reads, replayable by the runtime.

megatron-core schedules hand ``forward_step_func`` a data iterator (one per
model chunk under virtual pipelining) and call it a fixed number of times per
step, in a fixed order, wherever a failure lands. So the micro-batches a step
read are exactly the batches handed out since the step started, and
re-executing the step with the same batches only needs the runtime's
:class:`~torchpass.core.data.ReplayableData` rewound to the step start.
"""

from __future__ import annotations

from typing import Any, Iterator

from torchpass.core.data import ReplayableData

__all__ = ["ReplayingIterator"]


class ReplayingIterator(Iterator[Any]):
    """An iterator over ``data``'s batches: after a rewind it replays the interrupted step's batches."""

    def __init__(self, data: ReplayableData):
        self.data = data

    def __next__(self) -> Any:
        return self.data.next_batch()


class StepReplay(Iterator[Any]):
    """A one-shot iterator whose recent steps can be read again: what Megatron-LM's data iterator wraps.

    Megatron-LM's ``train()`` reads micro-batches from an iterator over its own
    ``DataLoader`` (a ``RerunDataIterator`` around ``iter(loader)``): not
    re-iterable, and positioned by the consumed-samples count, so a spare builds
    its own at the right sample and needs no replay. A survivor executing a step
    again needs the batches the step read: this records what each of the last
    ``keep_steps`` steps drew from ``source`` and hands them out again after
    :meth:`rewind`.
    """

    def __init__(self, source: Iterator[Any], keep_steps: int):
        self.source = source
        self.keep_steps = keep_steps
        self._batches: list[Any] = []
        self._starts: dict[int, int] = {}
        """Step -> index in ``_batches`` of its first batch."""
        self._position = 0

    def __next__(self) -> Any:
        if self._position == len(self._batches):
            self._batches.append(next(self.source))
        batch = self._batches[self._position]
        self._position += 1
        return batch

    def mark_step(self, step: int) -> None:
        """``step`` starts at the current position; steps older than ``keep_steps`` are dropped."""
        self._starts[step] = self._position
        for old in [s for s in self._starts if s <= step - self.keep_steps]:
            del self._starts[old]
        first = min(self._starts.values())
        if first:
            del self._batches[:first]
            self._position -= first
            self._starts = {s: p - first for s, p in self._starts.items()}

    def rewind(self, step: int) -> None:
        """Hand out ``step``'s batches again, from its first."""
        if step not in self._starts:
            raise RuntimeError(f"torchpass: step {step}'s batches are no longer kept (kept: {sorted(self._starts)})")
        self._position = self._starts[step]
