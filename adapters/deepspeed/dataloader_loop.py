"""An unchanged forward/backward/step loop over the engine's own training dataloader, migratable.

A script written as DeepSpeed's documentation writes it::

    engine, _, trainloader, _ = deepspeed.initialize(..., training_data=dataset)
    for epoch in range(num_epochs):
        for batch in trainloader:
            loss = engine(batch)
            engine.backward(loss)
            engine.step()

needs no change: torchpass owns the step boundaries through the loader the
loop draws from. :class:`EngineLoaderLoop` switches the engine's
``DeepSpeedDataLoader`` to a subclass (the script keeps its reference) and
wraps the engine instance's ``backward`` and ``step``.

Protocol:

1. *Step start* is the loader handing out the first micro-batch of an
   accumulation window: the first such call attaches the rank (a spare
   receives its state there), and each one begins a core step (RNG and data
   position marked, the engine's counters remembered) after acting on a
   generation that ended between steps.
2. *Step end* is the ``engine.step()`` call at the accumulation boundary
   returning.
3. A collective failing inside ``backward`` or ``step`` runs the survivor
   side of the migration right there. The interrupted call then returns
   without effect (``backward`` returns the loss it was given), and so does
   every ``backward``/``step`` until the loop fetches its next micro-batch,
   which is the first micro-batch of the step to execute again: the loader
   replays the step's micro-batches from memory.
4. Passes over the loader follow the data: a pass ends when the epoch's
   batches are handed out (not counting replays), and the next pass starts the
   next epoch. A spare's loop starts at the first pass: passes before the
   job's epoch end at once, and the loader opens the job's epoch only when the
   loop reaches it, so per-epoch calls such as ``data_sampler.set_epoch`` made
   by the loop apply, as they did on the rank it replaces.

Requires of the loop: micro-batches come from the engine's training
dataloader (``training_data=``), each one is followed by ``engine(...)``,
``engine.backward(...)`` and ``engine.step()`` as DeepSpeed documents; the
loop is bounded by the data (epochs) or by ``engine.global_steps``, not by a
counter of its own (a spare's counter starts at zero); code between steps
issues no collectives. ZeRO stage 3 gathers parameters inside the forward,
where a failure cannot be turned into a step executed again without the
loop's help, so ZeRO-3 loops use :func:`~.loop.steps`. A loop that logs each
call may log an interrupted micro-batch once more; ``engine.global_steps``
advancing marks a completed step.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from deepspeed.runtime.dataloader import DeepSpeedDataLoader
from deepspeed.runtime.engine import DeepSpeedEngine

from torchpass.core.data import ReplayableData

from .migration import EngineMigration

__all__ = ["EngineLoaderLoop", "GuardedDataLoader"]


class _RawPasses:
    """One pass of DeepSpeed's own loader per ``iter()``, bypassing the guarded subclass."""

    def __init__(self, loader: DeepSpeedDataLoader):
        self._loader = loader

    def __iter__(self) -> Iterator[Any]:
        DeepSpeedDataLoader.__iter__(self._loader)
        while True:
            try:
                yield DeepSpeedDataLoader.__next__(self._loader)
            except StopIteration:
                return


class GuardedDataLoader(DeepSpeedDataLoader):
    """The engine's training dataloader once :class:`EngineLoaderLoop` owns it (see the module docstring)."""

    _torchpass_loop: "EngineLoaderLoop"

    def __iter__(self) -> "GuardedDataLoader":
        loop = self._torchpass_loop
        if loop.delegating:
            return DeepSpeedDataLoader.__iter__(self)
        loop.passes_started += 1
        return self

    def __next__(self) -> Any:
        loop = self._torchpass_loop
        if loop.delegating:
            return DeepSpeedDataLoader.__next__(self)
        return loop.next_micro_batch()


class EngineLoaderLoop:
    """Owns the step boundaries of an unchanged loop over ``engine.training_dataloader``."""

    def __init__(self, engine: DeepSpeedEngine, migration: EngineMigration):
        self.engine = engine
        self.migration = migration
        self.runtime = migration.runtime
        self.delegating = False
        """True once a ``steps()`` loop drives the engine: the loader is then plain DeepSpeed."""
        self.passes_started = 0
        self._loader: DeepSpeedDataLoader = engine.training_dataloader
        keep = self.runtime.config.buddy_interval_steps + 1
        self.data = ReplayableData(_RawPasses(self._loader), keep_steps=keep, lazy_fast_forward=True)
        self._attached = False
        self._number = 0
        self._skipping = False
        self._backward = engine.backward
        self._step = engine.step

    def install(self) -> None:
        self._loader.__class__ = GuardedDataLoader
        self._loader._torchpass_loop = self  # type: ignore[attr-defined]
        self.engine.backward = self._guarded_backward  # type: ignore[method-assign]
        self.engine.step = self._guarded_step  # type: ignore[method-assign]

    def delegate(self) -> None:
        """Hand the engine to a ``steps()`` loop: undo the wrappers, the loader behaves as DeepSpeed's."""
        if self._attached:
            raise RuntimeError(
                "torchpass: steps() was called after the loop already trained from engine.training_dataloader; "
                "use one loop style per engine"
            )
        self.delegating = True
        self.engine.backward = self._backward  # type: ignore[method-assign]
        self.engine.step = self._step  # type: ignore[method-assign]

    # ---- the loader's side ----------------------------------------------------
    def next_micro_batch(self) -> Any:
        self._skipping = False
        engine = self.engine
        starts_step = not self.migration.in_step and engine.micro_steps % engine.gradient_accumulation_steps() == 0
        if starts_step and not self._attached:
            self._attach()
        if self._pass_is_over():
            raise StopIteration
        if starts_step:
            self._begin_step()
        return self.data.next_batch()

    def _pass_is_over(self) -> bool:
        if self.passes_started <= self.data.epoch:
            return True  # a spare's loop catching up with the job's epoch
        if self.data.replaying:
            return False
        return self.passes_started == self.data.epoch + 1 and self.data.in_epoch >= len(self._loader)

    def _attach(self) -> None:
        self._attached = True
        rt = self.runtime
        self._number = rt.attach(self.migration, self.data, self.engine.global_steps + 1, [])

    def _begin_step(self) -> None:
        rt = self.runtime
        while rt.ending.is_set():
            self._number = rt.recover(f"generation ended before step {self._number}: {rt.ending_reason}")
        self.migration.step_begins()
        rt.step_begin(self._number)

    # ---- the engine's side ----------------------------------------------------
    def _guarded_backward(self, loss: Any, *args: Any, **kwargs: Any) -> Any:
        if self._skipping:
            return loss
        try:
            return self._backward(loss, *args, **kwargs)
        except Exception as exc:
            self._interrupted("backward", exc)
            return loss

    def _guarded_step(self, *args: Any, **kwargs: Any) -> None:
        if self._skipping:
            return
        boundary = self.engine.is_gradient_accumulation_boundary()
        try:
            self._step(*args, **kwargs)
        except Exception as exc:
            self._interrupted("step", exc)
            return
        if boundary and self.migration.in_step:
            self.runtime.step_end(self._number)
            self.migration.step_ends()
            self._number += 1

    def _interrupted(self, where: str, exc: Exception) -> None:
        rt = self.runtime
        if not self.migration.in_step or not rt.is_comm_failure(exc):
            raise exc
        cause = f"step {self._number} ({where}): {type(exc).__name__}: {str(exc)[:300]}"
        self._number = rt.recover(cause)
        self._skipping = True
        print(
            f"[torchpass] rank {rt.rank}: engine.{where}() was interrupted by a migration; the loop's calls return "
            f"without effect until its next micro-batch, the first of step {self._number}",
            file=sys.stderr,
            flush=True,
        )

