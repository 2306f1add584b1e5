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
