"""The user-owned DeepSpeed loop (forward, backward, step per micro-batch), migratable.

::

    from torchpass.adapters.deepspeed import steps

    engine, *_ = deepspeed.initialize(model=net, config="ds_config.json", training_data=dataset)
    for step in steps(engine, num_steps):
        with step:
            for batch in step.micro_batches():      # gradient_accumulation_steps of them
                loss = engine(batch)
                engine.backward(loss)
                engine.step()

What each line buys:

* ``steps(engine, num_steps)`` yields the optimizer steps ``engine.global_steps
  + 1 .. num_steps`` (a job resumed from a DeepSpeed checkpoint continues where
  it stands); after a migration it yields the step to execute next, and on a
  hot spare it starts where the job stands. It is built on the core's guarded
  loop (:func:`torchpass.core.loop.steps`), which attaches the rank at the
  first step boundary;
* ``with step`` delimits the step: a collective failing inside it starts the
  survivor side of the migration, and the block runs again;
* ``step.micro_batches()`` hands out the step's micro-batches from the data
  (``data=`` any re-iterable, default: the engine's own training dataloader),
  replayed identically when the step is executed again, and fast-forwarded on a
  spare (a one-shot iterator is refused: both need a fresh pass). The data
  source's epochs are owned by the wrapper (``set_epoch`` is called on the
  sampler as a ``DistributedSampler`` needs).

Every step must run exactly ``gradient_accumulation_steps`` micro-batches of
forward, backward and ``engine.step()``; a step that does not is refused with
an error, since it would leave the engine between accumulation boundaries.
Keep the whole step, logging included, inside the ``with`` block: code after
the block also runs for an interrupted step (``step.done`` is then False).

Without ``torchpass launch``, or with the ``"torchpass"`` block absent or
disabled, this is a plain loop over the same micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any

from deepspeed.runtime.dataloader import DeepSpeedDataLoader
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

from torchpass.core import loop
from torchpass.core.data import ReplayableData

from .install import migration_of
from .migration import EngineMigration

__all__ = ["DeepSpeedStep", "steps"]


class _Reiterable:
    """A re-iterable view of a ``DeepSpeedDataLoader``: it is its own iterator, and ``iter()`` on it starts a new pass."""

    def __init__(self, loader: DeepSpeedDataLoader):
        self._loader = loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self._loader)

    def set_epoch(self, epoch: int) -> None:
        sampler = getattr(self._loader, "data_sampler", None)
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


def _replayable(source: Iterable[Any], keep_steps: int) -> ReplayableData:
    # ReplayableData refuses one-shot iterators, which DeepSpeedDataLoader looks like.
    return ReplayableData(_Reiterable(source) if isinstance(source, DeepSpeedDataLoader) else source, keep_steps=keep_steps)


class DeepSpeedStep:
    """One optimizer step of a user-owned loop; use as a context manager around the step's body."""

    def __init__(
        self,
        number: int,
        engine: DeepSpeedEngine,
        data: ReplayableData | None,
        guarded: loop.Step | None = None,
        migration: EngineMigration | None = None,
    ):
        self.number = number
        self.engine = engine
        self._data = data
        self._guarded = guarded
        self._migration = migration
        self._counters = (engine.global_steps, engine.micro_steps)
        """``(global_steps, micro_steps)`` when the body began: a step advances them by 1 and by GA."""
        self.done = False
        """True once the body completed; False after a migration interrupted it (it runs again)."""

    def micro_batches(self) -> Iterator[Any]:
        """This step's ``gradient_accumulation_steps`` micro-batches (the same ones again if it is re-executed)."""
        if self._data is None:
            raise RuntimeError(
                "torchpass: this loop has no data: pass data= to steps(), or training_data= to deepspeed.initialize"
            )
        for _ in range(self.engine.gradient_accumulation_steps()):
            yield self._data.next_batch()

    def __enter__(self) -> "DeepSpeedStep":
        self._counters = (self.engine.global_steps, self.engine.micro_steps)
        if self._guarded is not None:
            assert self._migration is not None
            self._migration.step_begins()
            self._guarded.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if exc is None:
            self._check_one_optimizer_step()
        if self._guarded is None:
            self.done = exc is None
            return False
        assert self._migration is not None
        handled = self._guarded.__exit__(exc_type, exc, tb)
        self.done = self._guarded.done
        if not handled:
            self._migration.step_ends()
        return handled

    def _check_one_optimizer_step(self) -> None:
        global_steps, micro_steps = self._counters
        gas = self.engine.gradient_accumulation_steps()
        optimizer_steps = self.engine.global_steps - global_steps
        micro_batches = self.engine.micro_steps - micro_steps
        if optimizer_steps != 1 or micro_batches != gas:
            raise RuntimeError(
                f"torchpass step {self.number}: a step must run gradient_accumulation_steps ({gas}) micro-batches, each "
                f"forward, engine.backward() and engine.step(); this one called engine.step() {micro_batches} time(s) "
                f"and took {optimizer_steps} optimizer step(s)"
            )


def steps(engine: DeepSpeedEngine, num_steps: int, *, data: Iterable[Any] | None = None) -> Iterator[DeepSpeedStep]:
    """Yield the optimizer steps ``engine.global_steps + 1 .. num_steps`` of a user-owned loop (see the module docstring).

    ``data``: a re-iterable of micro-batches (a DataLoader, a dataset); default
    the engine's training dataloader (``training_data=`` of ``deepspeed.initialize``).
    """
    if isinstance(engine, PipelineEngine):
        raise TypeError(
            "torchpass: a PipelineEngine runs its own schedule: call engine.train_batch() in a plain loop, "
            "torchpass guards each call (steps() is for forward/backward/step loops)"
        )
    source = data if data is not None else engine.training_dataloader
    migration = migration_of(engine)
    start = engine.global_steps + 1
    if migration is None:
        batches = _replayable(source, keep_steps=1) if source is not None else None
        for number in range(start, num_steps + 1):
            yield DeepSpeedStep(number, engine, batches)
        return
    if migration.loader_loop is not None:
        migration.loader_loop.delegate()
    keep = migration.runtime.config.buddy_interval_steps + 1
    batches = _replayable(source, keep_steps=keep) if source is not None else None
    for guarded in loop.steps(migration, data=batches, optimizers=[], start=start, stop=num_steps):
        yield DeepSpeedStep(guarded.number, engine, batches, guarded, migration)
