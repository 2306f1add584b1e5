"""TorchTitan's ``Trainer``, migratable under ``torchpass launch``.

:class:`TorchPassTrainer` is run by TorchTitan's own ``main`` (see
:mod:`torchpass.adapters.torchtitan.train`) and keeps TorchTitan's ``train()``
loop (checkpoint saving, validation, profiling, the step-1 timeout
adjustment) unchanged. It joins the core's migration protocol at two methods:

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
  step the job stands at, and ``train()`` continues from it.

Protocol steps per executed step: ``step_begin`` (RNG snapshot, data mark,
small-state mirror), the provider remembers the token counters, TorchTitan's
``train_step`` (the backward start is reported by a hook on the model's
output; the optimizers container's ``step()`` is the commit), ``step_end``
(buddy copy of sharded state).

What this requires, and what it does not cover:

* ``[debug] seed`` is not required: a spare's own seeding is overwritten by
  the RNG state it receives.
* Pipeline parallelism is refused: an interrupted pipeline schedule leaves
  per-stage buffers that are not reset yet.
* Code ``train()`` runs between steps (checkpoint saving, validation, the
  step-1 ``set_pg_timeouts`` barrier) is outside the guarded step: a fault
  that surfaces there stops the job instead of migrating it. The timeouts that
  barrier sets apply to the first generation's communicators only; rebuilt
  ones use the timeout the groups were created with.

Without ``torchpass launch``, or when the job's config has no ``[torchpass]``
section or sets ``enabled = false``, this is TorchTitan's ``Trainer`` with no
hook of any kind (the section is still validated).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from torchpass.core import runtime
from torchpass.core.api import watch_backward
from torchpass.core.config import TorchPassConfig
from torchpass.core.loop import Step

from . import replicate
from .data import TitanData
from .job_config import resolve_config
from .state import TitanStateProvider

__all__ = ["TorchPassTrainer", "migration_config"]

def migration_config(job_config: JobConfig) -> TorchPassConfig | None:
    """The job's torchpass config when this process should migrate, else None.

    Validates the ``[torchpass]`` section whenever it exists (so a bad key fails
    the same way with or without ``torchpass launch``) and installs the result
    as the runtime's config, which rank 0 reports to the controller.
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
            "torchpass: the job config has no [torchpass] section: running without live migration, a failed rank "
            'stops the job. To make it migratable, add `[job] custom_config_module = "torchpass.adapters.torchtitan.'
            'job_config"` and a `[torchpass]` table to the TOML.'
        )
        return None
    if not config.enabled:
        logger.warning("torchpass: [torchpass] enabled = false: running without live migration, a failed rank stops the job")
        return None
    pp = job_config.parallelism.pipeline_parallel_degree
    if pp > 1:
        raise ValueError(
            f"torchpass: parallelism.pipeline_parallel_degree = {pp}: the TorchTitan adapter does not migrate "
            "pipeline-parallel jobs yet (an interrupted pipeline schedule leaves per-stage buffers it cannot reset); "
            "use 1, or set [torchpass] enabled = false to run without migration"
        )
    rt.config = config
    return config


class _Migration:
    """The trainer's side of the protocol: state provider, replayable data, attach and guarded steps."""

    def __init__(self, trainer: Trainer, rt: runtime.Runtime, config: TorchPassConfig):
        self.runtime = rt
        for part in trainer.model_parts:
            replicate.build_now(part)
        self.provider = TitanStateProvider(trainer)
        self.data = TitanData(trainer.dataloader, stream=_batch_stream(trainer), keep_steps=config.buddy_interval_steps + 1)
        watch_backward(trainer.model_parts[0], rt.backward_started)
        self._attached = False

    def batches(self) -> Iterator[Any]:
        """An endless iterator over the data's batches (a re-executed step's again)."""
        while True:
            yield self.data.next_batch()

    def execute(self, trainer: Trainer, train_step: Callable[[], None]) -> None:
        """Execute step ``trainer.step`` (the one ``train()`` asks for); return once it completed."""
        rt = self.runtime
        number = target = trainer.step
        if not self._attached:
            # An active rank starts at `target`; a spare fetches its state here and
            # learns the step the job stands at, which ``train()`` then continues from.
            number = target = rt.attach(self.provider, self.data, target, [trainer.optimizers])
            self._attached = True
        # A spare that joins after the last step committed has nothing left to execute.
        target = min(target, trainer.job_config.training.steps)
        while number <= target:
            if rt.ending.is_set():
                number = rt.recover(f"generation ended before step {number}: {rt.ending_reason}")
                continue
            trainer.step = number
            step = Step(number)
            with step:
                self.provider.begin_step()
                train_step()
            number = step.resume_at if step.resume_at is not None else number + 1
        trainer.step = target


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
        self._migration.execute(self, lambda: super(TorchPassTrainer, self).train_step(data_iterator))
