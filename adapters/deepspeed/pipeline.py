"""``PipelineEngine.train_batch`` as a guarded step: the script's own loop, unchanged, becomes migratable.

DeepSpeed's pipeline engine runs a whole optimizer step per ``train_batch()``
call (its schedule of loads, forwards, sends, backwards, reductions and the
optimizer step), so torchpass owns that step without any change to the loop::

    for _ in range(num_steps):
        loss = engine.train_batch(data_iter)     # or engine.train_batch() with training_data=

Protocol, per call (:class:`TrainBatchGuard` replaces ``train_batch`` on the
engine instance):

1. the first call attaches the rank to the runtime; the n-th call executes the
   job's step ``start + n - 1`` (``start`` is ``engine.global_steps + 1`` at the
   first call);
2. each step is a core :class:`~torchpass.core.loop.Step` around DeepSpeed's
   own ``train_batch``. The micro-batches the schedule loads come through a
   recorder (:class:`PipelineBatches`), so a step executed again after a
   migration (or, after a rollback to a buddy copy, the step before it too) is
   fed exactly the micro-batches it had, and a spare's iterator is
   fast-forwarded to where the rank it replaces stood;
3. backward started is reported at the ``ReduceTiedGrads`` instruction, the
   first one after the step's last forward and backward, before any gradient
   leaves the rank;
4. the loss aggregation (an all-reduce over the last stage's data-parallel
   group and a broadcast over the pipe group) runs right before the
   ``OptimizerStep`` instruction instead of after the schedule. Its value does
   not depend on the update, and the step's last collectives then come before
   its commit: a failure there is a clean rollback that recomputes the loss,
   rather than a committed step whose loss was never delivered;
5. after a migration every rank redoes the pipeline's one-time p2p shape
   handshake (:func:`.step_reset.align_for_reexecution`), which a spare's fresh
   engine does anyway.

A hot spare runs the script from the top: its calls for steps the job already
ran return at once without training or communicating (a NaN loss), so a
``for _ in range(num_steps)`` loop and a ``while engine.global_steps <
num_steps`` loop both end on the job's last step. Hence code between
``train_batch`` calls must not issue collectives; pass the same iterator (or
none, with ``training_data=``) on every call, and prefer data iterators that do
not draw from the global RNG when they start a new pass.

``eval_batch`` is not guarded: its loads bypass the recorder.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from torchpass.core.data import ReplayableData
from torchpass.core.loop import Step

from .migration import EngineMigration

__all__ = ["DataExhausted", "PipelineBatches", "TrainBatchGuard"]


class DataExhausted(Exception):
    """The engine's data iterator ran out (re-raised to the caller as DeepSpeed's ``StopIteration``)."""


class _EngineIterator:
    """Draws from whatever iterator the engine currently trains on (``None`` on ranks that load no data)."""

    def __init__(self, engine: PipelineEngine):
        self._engine = engine

    def __iter__(self) -> "_EngineIterator":
        return self

    def __next__(self) -> Any:
        source = self._engine.data_iterator
        if source is None:
            return None
        try:
            return next(source)
        except StopIteration:
            # Not StopIteration: ReplayableData would take it for the end of an epoch.
            raise DataExhausted() from None


class _EngineStream:
    """A re-iterable over :class:`_EngineIterator` (the iterator itself belongs to the user's script)."""

    def __init__(self, engine: PipelineEngine):
        self._engine = engine

    def __iter__(self) -> _EngineIterator:
        return _EngineIterator(self._engine)


class PipelineBatches(ReplayableData):
    """The micro-batches the pipeline schedule loads, replayable per step.

    The stream never starts a new epoch (the user's iterator owns epochs), so a
    position is a count of micro-batches drawn, which is what a spare's
    fast-forward draws from its own iterator.
    """

    def __init__(self, engine: PipelineEngine, keep_steps: int):
        super().__init__(_EngineStream(engine), keep_steps=keep_steps)


class TrainBatchGuard:
    """``engine.train_batch`` replaced by guarded steps (see the module docstring)."""

    def __init__(self, engine: PipelineEngine, migration: EngineMigration):
        self.engine = engine
        self.migration = migration
        self.runtime = migration.runtime
        self.batches = PipelineBatches(engine, keep_steps=self.runtime.config.buddy_interval_steps + 1)
        self._train_batch = engine.train_batch
        self._next_step: int | None = None
        """The job's next step to execute; None until the first call attaches."""
        self._call_step = 0
        """The step the current call executes."""
        self._early_loss: torch.Tensor | None = None
        self._announced_catch_up = False

    def install(self) -> None:
        """Replace ``train_batch`` and the schedule hooks on the engine instance (DeepSpeed's classes are untouched)."""
        engine = self.engine
        instructions = dict(type(engine)._INSTRUCTION_MAP)
        instructions[schedule.ReduceTiedGrads] = self._reduce_tied_grads
        instructions[schedule.OptimizerStep] = self._optimizer_step
        # The schedule binds these functions to the engine itself (MethodType), so they take it first.
        engine._INSTRUCTION_MAP = instructions
        engine._aggregate_total_loss = self._aggregate_total_loss
        engine._next_batch = self._next_batch
        engine.train_batch = self

    # ---- the call ---------------------------------------------------------------
    def __call__(self, data_iter: Any = None) -> torch.Tensor:
        if data_iter is not None:
            # Before attaching: a spare fast-forwards this iterator while it joins.
            self.engine.set_dataiterator(data_iter)
        if self._next_step is None:
            start = self.engine.global_steps + 1
            self._call_step = start - 1
            self._next_step = self.runtime.attach(self.migration, self.batches, start, [])
        self._call_step += 1
        if self._call_step < self._next_step:
            return self._catch_up()
        loss: torch.Tensor | None = None
        while self._next_step <= self._call_step:
            rt = self.runtime
            if rt.ending.is_set():
                self._next_step = rt.recover(f"generation ended before step {self._next_step}: {rt.ending_reason}")
                continue
            step = Step(self._next_step, self.batches)
            self.migration.step_begins()
            self._early_loss = None
            try:
                with step:
                    loss = self._train_batch(data_iter)
            except DataExhausted:
                self.migration.step_ends()
                raise StopIteration from None
            if step.done:
                self.migration.step_ends()
            self._next_step = step.resume_at if step.resume_at is not None else self._next_step + 1
        assert loss is not None, "every call executes at least its own step"
        return loss

    def _catch_up(self) -> torch.Tensor:
        if not self._announced_catch_up:
            self._announced_catch_up = True
            print(
                f"[torchpass] rank {self.runtime.rank} joined at step {self._next_step}: train_batch calls for steps "
                f"{self._call_step}..{self._next_step - 1} return NaN at once (the job already ran them)",
                file=sys.stderr,
                flush=True,
            )
        return torch.tensor(float("nan"))

    # ---- the engine's hooks ------------------------------------------------------
    def _next_batch(self) -> Any:
        engine = self.engine
        if not self.migration.in_step:
            return type(engine)._next_batch(engine)  # eval_batch: not a training step
        batch = self.batches.next_batch()
        return engine.batch_fn(batch) if engine.batch_fn else batch

    def _reduce_tied_grads(self, engine: PipelineEngine) -> None:
        self.runtime.backward_started()
        type(engine)._exec_reduce_tied_grads(engine)

    def _optimizer_step(self, engine: PipelineEngine, lr_kwargs: Any = None) -> None:
        with torch.no_grad():
            self._early_loss = type(engine)._aggregate_total_loss(engine)
        type(engine)._exec_optimizer_step(engine, lr_kwargs)

    def _aggregate_total_loss(self) -> torch.Tensor:
        loss, self._early_loss = self._early_loss, None
        assert loss is not None, "the pipeline schedule ended without an OptimizerStep"
        return loss
