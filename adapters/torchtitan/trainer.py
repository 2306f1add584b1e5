"""TorchTitan's ``Trainer``, migratable under ``torchpass launch``.

:class:`TorchPassTrainer` is run by TorchTitan's own ``main`` (see
:mod:`torchpass.adapters.torchtitan.train`) and keeps TorchTitan's ``train()``
loop (checkpoint cadence, validation, profiling, the step-1 timeout
adjustment) unchanged. It joins the core's migration protocol at three points:

* ``batch_generator``: TorchTitan's own generator (token counting, data
  timing) over :class:`~torchpass.adapters.torchtitan.data.TitanData`, so a
  re-executed step is fed the same batches and a spare resumes the stream of
  the rank it replaces;
* ``train_step``: each call executes the step ``train()`` asks for as a
  guarded :class:`~torchpass.core.loop.Step` around TorchTitan's own
  ``train_step``. If a collective fails inside it, the runtime migrates
  (survivors keep their processes, spares join) and the step is executed again
  through ``train_step`` with the same batches; after a rollback to a buddy
  copy the steps before it are executed again first. The first call attaches
  the rank to the runtime: a spare fetches its state there and executes the
  step the job stands at, and ``train()`` continues from it;
* ``checkpointer.save`` / ``load``: TorchTitan's checkpoint save is guarded
  the same way, and a save a fault interrupted is executed again by every
  rank, the spare included; a spare never loads (see
  :mod:`~torchpass.adapters.torchtitan.checkpointing`).

Protocol steps per executed step: ``step_begin`` (RNG snapshot, data mark,
small-state mirror), the provider remembers the token counters, TorchTitan's
``train_step`` (the backward start is reported by a hook on the model's
output; the optimizers container's ``step()`` is the commit), ``step_end``
(buddy copy of sharded state); then the save, if due.

What this requires, and what it does not cover:

* ``[debug] seed`` is not required: a spare's own seeding is overwritten by
  the RNG state it receives.
* Refused at start-up, naming the setting: pipeline parallelism (an
  interrupted pipeline schedule leaves per-stage buffers that are not reset
  yet), ``[compile] enable`` (not verified), an asynchronous checkpointer (a
  save that spans steps cannot be re-executed consistently) and TorchTitan's
  own ``[fault_tolerance]`` (two recovery mechanisms for one failure).
* Code ``train()`` runs between steps besides the save (validation, the
  step-1 ``set_pg_timeouts`` barrier) is outside the guarded step: a fault
  that surfaces there stops the job instead of migrating it. That barrier and
  the timeouts it sets are for the first generation only (every rank can tell
  alone whether it is in it): rebuilt communicators keep the timeout their
  groups were created with.

Without ``torchpass launch``, or with ``[torchpass] enable = false``, this is
TorchTitan's ``Trainer`` with no hook of any kind (the section is still
validated).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from torchpass.core import runtime
from torchpass.core.api import watch_backward
from torchpass.core.config import ConfigError, TorchPassConfig
from torchpass.core.loop import Step

from . import replicate
from .checkpointing import Checkpoints
from .data import TitanData
from .job_config import resolve_config
from .state import TitanStateProvider

__all__ = ["TorchPassTrainer", "migration_config"]

def migration_config(job_config: JobConfig) -> TorchPassConfig | None:
    """The job's torchpass config when this process should migrate, else None.

    Validates the ``[torchpass]`` section whenever it exists (so a bad key fails
    the same way with or without ``torchpass launch``), refuses what cannot be
    migrated (pipeline parallelism, TorchTitan's own fault tolerance, an
    asynchronous checkpointer) naming the setting, and installs the result as
    the runtime's config, which rank 0 reports to the controller.
    """
    section = getattr(job_config, "torchpass", None)
    rt = runtime.current()
    config = None
    if section is not None:
        source = f"[torchpass] section of {job_config.job.config_file or 'the job config'}"
        config = resolve_config(section, rt.config if rt is not None else TorchPassConfig(), source)
    if rt is None:
        return None
    if config is None:
        logger.warning(
            "torchpass: the job's config module declares no [torchpass] section: TorchTitan trains without live "
            "migration and a failed rank stops the job (declare the section in it, see docs/adapters/torchtitan.md)"
        )
        return None
    if not config.enabled:
        off = "the job config sets [torchpass] enable = false" if not section.enable else "torchpass launch was given enabled=false"
        logger.warning(
            f"torchpass: {off}: TorchTitan trains without live migration and a failed rank stops the job "
            "(set enable = true to make it migratable)"
        )
        return None
    _refuse_unsupported(job_config)
    rt.config = config
    return config


def _refuse_unsupported(job_config: JobConfig) -> None:
    """Fail before training, naming the setting, for what the adapter cannot migrate."""
    off = "or set [torchpass] enable = false to run without migration"
    pp = job_config.parallelism.pipeline_parallel_degree
    if pp > 1:
        raise ConfigError(
            f"torchpass: parallelism.pipeline_parallel_degree = {pp}: the TorchTitan adapter does not migrate "
            f"pipeline-parallel jobs yet (an interrupted pipeline schedule leaves per-stage buffers it cannot reset); use 1, {off}"
        )
    ft = getattr(job_config, "fault_tolerance", None)
    if ft is not None and ft.enable:
        raise ConfigError(
            "torchpass: [fault_tolerance] enable = true and [torchpass] enable = true: only one of them can drive "
            "recovery. TorchTitan's fault tolerance (torchft) drops a failed replica group and continues without it, "
            "healing it later from a peer; torchpass replaces the failed rank with a spare at the same step and world "
            "size. Both would react to the same failure with different process groups and different data. Set "
            f"[fault_tolerance] enable = false to migrate, {off}"
        )
    compile_config = getattr(job_config, "compile", None)
    if compile_config is not None and compile_config.enable:
        raise ConfigError(
            "torchpass: [compile] enable = true: the TorchTitan adapter does not migrate compiled models yet (a "
            "spare would compile on its first step, and compiled graphs that capture DDP buckets or process groups "
            f"are not verified to stay bitwise identical across a migration); set [compile] enable = false, {off}"
        )
    ckpt = job_config.checkpoint
    if ckpt.enable and ckpt.async_mode != "disabled":
        raise ConfigError(
            f"torchpass: checkpoint.async_mode = {ckpt.async_mode!r}: an asynchronous save runs on past the step that "
            "started it, so a migration cannot re-execute it consistently on every rank; use "
            f"async_mode = \"disabled\", {off}"
        )


_STEP, _SAVE = 0, 1
"""What a position names: executing a step, or TorchTitan's checkpoint save after it."""


class _Migration:
    """The trainer's side of the protocol: state provider, replayable data, attach, guarded steps and saves.

    The job's progress is a position ``(step, what)``, ordered: ``(k, _STEP)``
    then ``(k, _SAVE)`` then ``(k + 1, _STEP)``. TorchTitan's ``train()`` asks
    for a step (``train_step``) or a save (``checkpointer.save``), and
    :meth:`drive` performs every action from the current position up to the one
    asked for. A migration moves the position: to the save of the target version
    when that save is owed (see :mod:`.checkpointing`), else to the step after it,
    which may be behind (a rollback: the steps are executed again) or ahead (the
    fault came after the step's commit) of where ``train()`` stands.
    """

    def __init__(self, trainer: Trainer, rt: runtime.Runtime, config: TorchPassConfig):
        self.runtime = rt
        self.trainer = trainer
        for part in trainer.model_parts:
            replicate.build_now(part)
        self.checkpoints = Checkpoints(
            trainer.checkpointer, last_step=trainer.job_config.training.steps, device=trainer.device, joining=rt.role == "spare"
        )
        self.provider = TitanStateProvider(trainer, on_resume=self._on_resume)
        self.data = TitanData(trainer.dataloader, stream=_batch_stream(trainer), keep_steps=config.buddy_interval_steps + 1)
        watch_backward(trainer.model_parts[0], rt.backward_started)
        self._train_step: Callable[[], None] | None = None
        self._attached = False
        self._position = (1, _STEP)
        trainer.checkpointer.save = self.save
        _first_generation_only_pg_timeouts(rt)

    def batches(self) -> Iterator[Any]:
        """An endless iterator over the data's batches (a re-executed step's again)."""
        while True:
            yield self.data.next_batch()

    def execute(self, train_step: Callable[[], None]) -> None:
        """``train_step`` for the step ``train()`` asks for; returns once it (and all before it) completed."""
        trainer = self.trainer
        self._train_step = train_step
        goal = trainer.step
        if not self._attached:
            # An active rank starts at `trainer.step`; a spare fetches its state here and learns
            # where the job stands, which ``train()`` then continues from.
            first = self.runtime.attach(self.provider, self.data, trainer.step, [trainer.optimizers])
            self._attached = True
            self._migrated(first)
            # A spare that joins after the last step committed has only the last save left, if owed.
            goal = min(first, trainer.job_config.training.steps)
        self.drive((goal, _STEP))
        trainer.step = goal

    def save(self, curr_step: int, last_step: bool = False) -> None:
        """``checkpointer.save`` as ``train()`` calls it after each step: guarded, at most once per step."""
        del last_step  # the checkpointer's own rule decides (Checkpoints.due)
        self.drive((curr_step, _SAVE))

    def drive(self, goal: tuple[int, int]) -> None:
        """Perform every action from the current position up to and including ``goal``."""
        rt = self.runtime
        while self._position <= goal:
            number, what = self._position
            if rt.ending.is_set():
                action = "step" if what == _STEP else "the checkpoint save of step"
                self._migrated(rt.recover(f"generation ended before {action} {number}: {rt.ending_reason}"))
                continue
            if what == _STEP:
                assert self._train_step is not None
                self.trainer.step = number
                step = Step(number)
                with step:
                    self.provider.begin_step()
                    self._train_step()
                if step.resume_at is not None:
                    self._migrated(step.resume_at)
                    continue
                self._position = (number, _SAVE)
                continue
            # TorchTitan saves the trainer's own state too ({"step": trainer.step, ...}): a spare
            # writing an interrupted save before its first step must save that step, not its own.
            self.trainer.step = number
            try:
                self.checkpoints.write(number)
            except (Exception, CheckpointException) as exc:
                # DCP raises CheckpointException (a BaseException) for failures it gathered from ranks.
                if not rt.is_comm_failure(exc):
                    raise
                self._migrated(rt.recover(f"checkpoint save of step {number}: {type(exc).__name__}: {str(exc)[:300]}"))
                continue
            self._position = (number + 1, _STEP)

    def _on_resume(self) -> None:
        # Every member, after the rebuild: agree whether the save of the target version is owed.
        self.checkpoints.agree(self.runtime.version, joining=not self._attached)

    def _migrated(self, resume_at: int) -> None:
        target = resume_at - 1
        self._position = (target, _SAVE) if self.checkpoints.pending == target else (resume_at, _STEP)


def _first_generation_only_pg_timeouts(rt: runtime.Runtime) -> None:
    """Run TorchTitan's step-1 ``set_pg_timeouts`` only on ranks that have never migrated.

    ``train()`` calls it once, after step 1: a barrier on the world, then shorter
    timeouts on the groups. Ranks must agree on whether they reach it. A spare
    always returns to ``train()`` at the step it joins at, so one that joins at
    step 1 would call it while survivors that rolled back to step 0 (a buddy copy)
    re-execute steps 1 and 2 without returning there: a barrier nobody else enters.
    The rule every rank can follow alone: the first generation calls it, later ones
    do not. Nothing is lost: rebuilt communicators keep the timeout their groups
    were created with in any case. ``train()`` looks the function up on
    ``torchtitan.distributed.utils`` at call time, hence the module attribute.
    """
    from torchtitan.distributed import utils as dist_utils

    set_pg_timeouts = dist_utils.set_pg_timeouts

    def first_generation_only(*args: Any, **kwargs: Any) -> None:
        if rt.generation == 0:
            set_pg_timeouts(*args, **kwargs)
        else:
            logger.info("torchpass: process-group timeouts stay as created: this rank's groups were rebuilt by a migration")

    dist_utils.set_pg_timeouts = first_generation_only


def _batch_stream(trainer: Trainer) -> str:
    """Which data-parallel stream this rank's loader reads, as TorchTitan's ``Trainer.__init__`` assigns it."""
    pd = trainer.parallel_dims
    if not pd.dp_enabled:
        return "batch rank 0 of 1"
    mesh = pd.get_mesh("batch")
    return f"batch rank {mesh.get_local_rank()} of {mesh.size()}"


class TorchPassTrainer(Trainer):
    """TorchTitan's ``Trainer``; under ``torchpass launch`` with a ``[torchpass]`` section, migratable."""

    def __init__(self, job_config: JobConfig):
        config = migration_config(job_config)
        super().__init__(job_config)
        rt = runtime.current()
        self._migration = _Migration(self, rt, config) if config is not None and rt is not None else None

    def batch_generator(self, data_iterable: Iterable[Any]) -> Iterator[Any]:
        if self._migration is None:
            return super().batch_generator(data_iterable)
        return super().batch_generator(self._migration.batches())

    def train_step(self, data_iterator: Iterator[Any]) -> None:
        if self._migration is None:
            super().train_step(data_iterator)
            return
        self._migration.execute(lambda: super(TorchPassTrainer, self).train_step(data_iterator))
