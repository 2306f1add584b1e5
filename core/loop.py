"""The guarded step loop every integration shares: steps delimited, failures turned into migrations.

::

    for step in steps(provider, data=data, optimizers=[opt], start=1, stop=n):
        with step:
            ...            # one training step; a collective failing in here is migrated,
                           # and the loop then yields the step to execute next

``steps`` attaches the process to the runtime at the first step boundary (a
spare fetches its state there and starts where the job stands), and re-yields
a step that a migration interrupted. The plain-PyTorch API and the framework
adapters drive their loops through it. Without ``torchpass launch`` it is a
plain counting loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from . import runtime
from .adapter import StateProvider
from .data import ReplayableData

__all__ = ["Step", "steps"]


class Step:
    """One training step; use as a context manager around the step's body."""

    def __init__(self, number: int, data: ReplayableData | None = None):
        self.number = number
        self.data = data
        self.resume_at: int | None = None
        self.done = False
        """True once the body completed; False after a migration interrupted it (it runs again)."""

    def batch(self) -> Any:
        """The next batch of this step (the same ones again if the step is re-executed)."""
        if self.data is None:
            raise RuntimeError("this loop has no replayable data source; pass data= to get batches from the step")
        return self.data.next_batch()

    def __enter__(self) -> "Step":
        rt = runtime.current()
        if rt is not None:
            rt.step_begin(self.number)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        rt = runtime.current()
        if rt is None:
            self.done = exc is None
            return False
        if exc is None:
            rt.step_end(self.number)
            self.done = True
            return False
        if not isinstance(exc, Exception) or not rt.is_comm_failure(exc):
            return False
        self.resume_at = rt.recover(f"step {self.number}: {type(exc).__name__}: {str(exc)[:300]}")
        return True


def steps(
    provider: StateProvider,
    *,
    data: ReplayableData | None,
    optimizers: Sequence[torch.optim.Optimizer],
    start: int,
    stop: int,
) -> Iterator[Step]:
    """Yield steps ``start..stop``; after a migration, the step to execute next.

    ``optimizers`` mark the commit point through their step hooks; pass none and
    call ``runtime.current().commit_started()`` / ``commit_finished()`` around the
    state update when the framework's step is not an optimizer ``step()`` call.
    """
    rt = runtime.current()
    number = rt.attach(provider, data, start, list(optimizers)) if rt is not None else start
    while number <= stop:
        if rt is not None and rt.ending.is_set():
            number = rt.recover(f"generation ended before step {number}: {rt.ending_reason}")
            continue
        step = Step(number, data)
        yield step
        number = step.resume_at if step.resume_at is not None else number + 1
    if rt is not None:
        rt.finish()
