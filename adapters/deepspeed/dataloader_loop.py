"""An unchanged forward/backward/step loop over the engine's own training dataloader, migratable.

A script written as DeepSpeed's documentation writes it::

    engine, _, trainloader, _ = deepspeed.initialize(..., training_data=dataset)
    for epoch in range(num_epochs):
        for batch in trainloader:
            loss = engine(batch)
            engine.backward(loss)
            engine.step()

needs no change, at every ZeRO stage: torchpass owns the step boundaries
through the loader the loop draws from. :class:`EngineLoaderLoop` switches the
engine's ``DeepSpeedDataLoader`` to a subclass (the script keeps its
reference) and wraps the engine instance's ``forward``, ``backward`` and
``step``.

Protocol:

1. *Step start* is the loader handing out the first micro-batch of an
   accumulation window: the first such call attaches the rank (a spare
   receives its state there), and each one begins a core step (RNG and data
   position marked, the engine's counters remembered) after acting on a
   generation that ended between steps.
2. *Step end* is the ``engine.step()`` call at the accumulation boundary
   returning.
3. A collective failing inside ``forward`` (ZeRO-3's parameter gathers, a
   model-parallel layer), ``backward`` or ``step`` runs the survivor side of
   the migration right there. Then:

   * a forward of a step's first micro-batch, when the step to execute again
     starts with the very micro-batch the loop holds (no rollback), runs again
     in the same call, with the RNG as it was when the call began, and returns
     its real output: the loop never notices;
   * otherwise the call returns without effect: a forward returns a stand-in
     (zeros shaped like its last output, :mod:`torchpass.core.stand_in`),
     ``backward`` the loss it was given, ``step`` nothing, and so does every
     ``forward``/``backward``/``step`` until the loop fetches its next
     micro-batch, which is the first micro-batch of the step to execute
     again: the loader replays the step's micro-batches from memory.
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
issues no collectives; what the loop computes from a forward's output it
only logs or passes to ``engine.backward`` (a stand-in's zeros must not reach
the training state). A loop that logs each call may log an interrupted
micro-batch once more (a stand-in's loss is 0); ``engine.global_steps``
advancing marks a completed step.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch
from deepspeed.runtime.dataloader import DeepSpeedDataLoader
from deepspeed.runtime.engine import DeepSpeedEngine

from torchpass.core.data import ReplayableData
from torchpass.core.dataloader_position import open_at
from torchpass.core.rng import capture_rng, restore_rng
from torchpass.core.stand_in import OutputShape

from .migration import EngineMigration

__all__ = ["EngineLoaderLoop", "GuardedDataLoader", "GuardedPass"]


class _EnginePasses:
    """Passes of DeepSpeed's own loader, bypassing the guarded subclass; a pass can open at any batch."""

    def __init__(self, loader: DeepSpeedDataLoader):
        self._loader = loader

    def __iter__(self) -> Iterator[Any]:
        return self.open_at(0)

    def open_at(self, skip: int) -> Iterator[Any]:
        loader = self._loader
        DeepSpeedDataLoader.__iter__(loader)
        if skip and not loader.curriculum_learning_enabled:
            # The pass DeepSpeed just set up, positioned by its torch DataLoader's index stream.
            loader.data = open_at(loader.dataloader, skip)
            skip = 0
        for _ in range(skip):
            DeepSpeedDataLoader.__next__(loader)
        while True:
            try:
                yield DeepSpeedDataLoader.__next__(loader)
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


class GuardedPass:
    """A pass over the script's own training DataLoader once :class:`EngineLoaderLoop` owns it."""

    def __init__(self, loop: "EngineLoaderLoop"):
        self._loop = loop

    def __iter__(self) -> "GuardedPass":
        return self

    def __next__(self) -> Any:
        return self._loop.next_micro_batch()


class EngineLoaderLoop:
    """Owns the step boundaries of an unchanged loop over the engine's or the script's training loader."""

    def __init__(self, engine: DeepSpeedEngine, migration: EngineMigration):
        self.engine = engine
        self.migration = migration
        self.runtime = migration.runtime
        self.delegating = False
        """True once a ``steps()`` loop drives the engine: the loader is then plain again."""
        self.passes_started = 0
        self.loader: Any = None
        """The training loader, once known: the engine's ``DeepSpeedDataLoader`` or the script's DataLoader."""
        self.data: ReplayableData | None = None
        self._pass_length = 0
        self._attached = False
        self._number = 0
        self._skipping = False
        self._drawn: Any = None
        """The micro-batch the loader handed out last."""
        self._output: OutputShape | None = None
        """The structure of the last forward's output, for a stand-in."""
        self._forward = engine.forward
        self._backward = engine.backward
        self._step = engine.step

    def install(self) -> None:
        """Take over the engine's ``forward``, ``backward`` and ``step``, and its training dataloader if it has one."""
        loader = self.engine.training_dataloader
        if isinstance(loader, DeepSpeedDataLoader):
            self.adopt(loader, _EnginePasses(loader))
            loader.__class__ = GuardedDataLoader
            loader._torchpass_loop = self  # type: ignore[attr-defined]
        # Instance attributes: nn.Module.__call__ finds ``forward`` on the instance first.
        self.engine.forward = self._guarded_forward  # type: ignore[method-assign]
        self.engine.backward = self._guarded_backward  # type: ignore[method-assign]
        self.engine.step = self._guarded_step  # type: ignore[method-assign]

    def adopt(self, loader: Any, passes: Any) -> None:
        """Make ``loader`` the training loader; ``passes`` iterates it without the guards, one pass per ``iter()``."""
        try:
            self._pass_length = len(loader)
        except TypeError as exc:
            raise TypeError(
                f"torchpass: the training loader ({type(loader).__name__}) has no len(): an unchanged loop ends its "
                "epochs with the data, so torchpass must know where a pass ends. Give the dataset a __len__, or "
                "iterate torchpass.adapters.deepspeed.steps(engine, num_steps, data=...)"
            ) from exc
        self.loader = loader
        keep = self.runtime.config.buddy_interval_steps + 1
        self.data = ReplayableData(passes, keep_steps=keep, lazy_fast_forward=True)

    @property
    def trains(self) -> bool:
        """Whether the engine is training: its module in training mode, autograd on."""
        return self.engine.module.training and torch.is_grad_enabled()

    def delegate(self) -> None:
        """Hand the engine to a ``steps()`` loop: undo the wrappers, the loader behaves as DeepSpeed's."""
        if self._attached:
            raise RuntimeError(
                "torchpass: steps() was called after the loop already trained from its data loader; "
                "use one loop style per engine"
            )
        self.delegating = True
        self.engine.forward = self._forward  # type: ignore[method-assign]
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
        assert self.data is not None
        self._drawn = self.data.next_batch()
        return self._drawn

    def _pass_is_over(self) -> bool:
        assert self.data is not None
        if self.passes_started <= self.data.epoch:
            return True  # a spare's loop catching up with the job's epoch
        if self.data.replaying:
            return False
        return self.passes_started == self.data.epoch + 1 and self.data.in_epoch >= self._pass_length

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
    def _guarded_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._skipping:
            return self._stand_in()
        engine = self.engine
        first = engine.micro_steps % engine.gradient_accumulation_steps() == 0
        # The loop may draw random numbers between fetching the micro-batch and this call
        # (masking tokens, say): a forward run again in place starts from the RNG as here.
        rng = capture_rng() if first and self.migration.in_step else None
        if self.migration.in_step and engine.is_gradient_accumulation_boundary():
            self.runtime.last_forward_started()
        while True:
            drawn = self._drawn
            try:
                output = self._forward(*args, **kwargs)
            except Exception as exc:
                self._interrupted("forward", exc)
                if rng is None or self.data is None or not self.data.replays_next(drawn):
                    return self._stand_in()
                # The step starts again with the micro-batch the loop holds: begin it
                # (the loader hands that batch out again, from memory) and run the forward again.
                self.next_micro_batch()
                restore_rng(rng)
                continue
            self._output = OutputShape.of(output)
            return output

    def _stand_in(self) -> Any:
        if self._output is None:
            raise RuntimeError(
                "torchpass: engine.forward() was interrupted before any forward of this process returned, and the "
                "step to execute again does not start with the micro-batch the loop holds: there is nothing to "
                "return in its place"
            )
        return self._output.zeros()

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
            f"[torchpass] rank {rt.rank}: engine.{where}() was interrupted by a migration; step {self._number} "
            "starts again from its first micro-batch",
            file=sys.stderr,
            flush=True,
        )

