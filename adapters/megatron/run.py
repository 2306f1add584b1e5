"""A megatron-core training loop made migratable: :class:`MegatronRun` and its guarded ``train_step``.

::

    args = add_torchpass_args(parser).parse_args()          # --torchpass, --torchpass-*
    run = MegatronRun(model=model_chunks, optimizer=optimizer, scheduler=scheduler,
                      data=train_loader, seq_length=seq_length, train_iters=train_iters,
                      torchpass=config_from_args(args))
    while run.iteration < train_iters:
        losses = run.train_step(forward_step_func)           # Megatron-LM's train_step, guarded

``train_step`` is Megatron-LM's ``train_step`` for a megatron-core loop:
zero the gradients, run ``get_forward_backward_func()`` over the model chunks
with a replaying data iterator, average the losses, step the optimizer and
the ``OptimizerParamScheduler`` (by ``num_microbatches x micro_batch_size x
data-parallel size`` samples), count the iteration and the consumed samples.
With ``--torchpass`` under ``torchpass launch`` it returns only once a step
completed: when a collective fails because a rank was lost, the survivors'
side of the migration runs inside it and the interrupted step is executed
again, with the same micro-batches and RNG streams; on a spare, the first
call fetches the state and continues where the job stands. Without
``--torchpass`` it is the plain step: no hooks, no extra collectives.

Protocol per step (guarded):

1. ``step_begin`` (core): global RNG snapshot, data mark; the adapter snapshots
   the model-parallel RNG tracker.
2. Forward and backward. Every model chunk is watched, and the step's last
   backward start (micro-batches x chunks of them: it follows the last forward,
   under every schedule) calls ``backward_started`` (core): the small-state
   record of the step's end (RNG, tracker, data position) is then durable
   before the rank's next collective, so before its gradients can let any
   peer commit the step. Earlier backward starts would only write records the
   last one supersedes, each waited for before the next collective.
3. Losses averaged over micro-batches and, for ``[sum, count]`` losses, all-reduced
   over the data-parallel (with context-parallel) group; ``record_losses`` is called.
4. A one-element all-reduce over the model-parallel group (and the expert
   model-parallel group with expert parallelism). A rank commits step k only
   after every rank of its model replica finished step k's gradient reduction,
   so no rank can commit while a whole replica set (the data-parallel copies of
   some model-parallel coordinates) is still at step k-1: the plan would need a
   copy that does not exist. Megatron's own optimizers do this anyway (their
   gradient-norm all-reduce); torch optimizers do not.
5. Commit: ``commit_started`` (core) fires from a step pre-hook on the torch
   optimizer(s) that hold the state, so the collectives a Megatron optimizer runs
   before it changes anything (found-inf, gradient norm) stay outside; the commit
   spans the optimizer step, the scheduler step and the counters, and
   ``commit_finished`` (core) is called explicitly at its end. The explicit
   markers (rather than the optimizer's post-hook) are needed because Megatron's
   step does more after the torch optimizer's step.

Requirements on the loop: call ``train_step`` for training steps only (the
state must not change elsewhere); keep collectives out of the code between
steps (a collective failing there is not guarded); the data source is
re-iterable (a DataLoader, a dataset), not a one-shot iterator.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from megatron.core import num_microbatches_calculator
from megatron.core import parallel_state as ps
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from torchpass.core import ddp as ddp_support
from torchpass.core import runtime
from torchpass.core.api import watch_backward
from torchpass.core.config import TorchPassConfig
from torchpass.core.data import ReplayableData
from torchpass.core.loop import Step, steps

from .data import ReplayingIterator
from .flags import warn_without_launcher
from .layout import DEFAULT_ORDER
from .losses import reduce_losses
from .optimizers import check_supported, torch_optimizers
from .state import MegatronState, Progress

__all__ = ["MegatronRun", "RecordLosses"]

RecordLosses = Callable[[int, Mapping[str, float]], None]
"""``(step, losses)``: called once a step's losses are final, before its commit."""


class MegatronRun:
    """The model chunks, optimizer, scheduler and data of a megatron-core training job.

    ``model``: the model chunk(s), wrapped in megatron-core's or torch's
    ``DistributedDataParallel`` (or with a ``finalize_model_grads_func`` in the
    model config); one chunk per virtual pipeline stage. ``optimizer``: a torch
    optimizer or a Megatron optimizer (the distributed optimizer included).
    ``data``: a re-iterable source of micro-batches for this rank.
    ``torchpass``: the config from :func:`~.flags.config_from_args`; None (no
    ``--torchpass``) runs the plain loop. ``order``: the order string given to
    ``initialize_model_parallel``. ``iteration`` and ``consumed_train_samples``:
    where a resumed run starts. The number-of-microbatches calculator must be
    initialized (``init_num_microbatches_calculator``).
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        optimizer: torch.optim.Optimizer | MegatronOptimizer,
        scheduler: OptimizerParamScheduler | None = None,
        data: Iterable[Any],
        seq_length: int,
        train_iters: int,
        torchpass: TorchPassConfig | None,
        order: str = DEFAULT_ORDER,
        iteration: int = 0,
        consumed_train_samples: int = 0,
        decoder_seq_length: int | None = None,
    ):
        chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
        check_supported(chunks, optimizer)
        self.model = chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.seq_length = seq_length
        self.decoder_seq_length = decoder_seq_length
        self.train_iters = train_iters
        self._runtime = runtime.current() if torchpass is not None else None
        if torchpass is not None:
            if self._runtime is None:
                warn_without_launcher()
            else:
                # The runtime reports rank 0's config to the controller when it attaches: the flags govern the job.
                self._runtime.config = torchpass
        keep = self._runtime.config.buddy_interval_steps + 1 if self._runtime is not None else 1
        self.data = ReplayableData(data, keep_steps=keep)
        self.data_iterator = ReplayingIterator(self.data)
        """The iterator ``forward_step_func`` receives (the same one for every virtual pipeline chunk)."""
        self.state = MegatronState(
            model=chunks,
            optimizer=optimizer,
            scheduler=scheduler,
            progress=Progress(iteration, consumed_train_samples),
            order=order,
        )
        self._loop: Iterator[Step] | None = None
        self._backward_starts = 0
        self._backwards_per_step = 0
        if self._runtime is not None:
            for ddp in (d for chunk in chunks for d in ddp_support.find_ddp(chunk)):
                ddp_support.check_supported(ddp)
            for chunk in chunks:
                watch_backward(chunk, self._on_backward_start)
            for opt in torch_optimizers(optimizer):
                opt.register_step_pre_hook(lambda *_: self._commit_started())

    @property
    def iteration(self) -> int:
        """Completed training steps (a spare's first ``train_step`` sets it to where the job stands)."""
        return self.state.progress.iteration

    @property
    def consumed_train_samples(self) -> int:
        return self.state.progress.consumed_train_samples

    def train_step(
        self, forward_step_func: Callable[..., Any], record_losses: RecordLosses | None = None
    ) -> dict[str, float]:
        """Execute the next training step; returns its losses (averaged as Megatron-LM does).

        The losses are empty off the last pipeline stage.

        ``record_losses(step, losses)`` is called before the step's commit: a
        record written there survives a migration that lands after the commit
        (a re-executed step calls it again, with the same values).
        """
        if self.iteration >= self.train_iters:
            raise RuntimeError(f"train_step: all {self.train_iters} training steps are done")
        if self._runtime is None:
            number = self.iteration + 1
            self.data.mark_step(number)
            return self._execute(number, forward_step_func, record_losses)
        if self._loop is None:
            # The first next() attaches to the runtime; a spare fetches its state there.
            self._loop = steps(
                self.state, data=self.data, optimizers=[], start=self.iteration + 1, stop=self.train_iters
            )
        step: Step
        for step in self._loop:
            if step.number != self.iteration + 1:
                raise RuntimeError(
                    f"torchpass: step {step.number} follows iteration {self.iteration}; the counters diverged"
                )
            with step:
                losses = self._execute(step.number, forward_step_func, record_losses)
            if step.done:
                if self.iteration == self.train_iters:
                    next(self._loop, None)  # let the loop tell the runtime the job is done
                return losses
        raise RuntimeError("torchpass: the step loop ended before the step completed")

    # ---- one execution of a step ---------------------------------------------
    def _execute(
        self, number: int, forward_step_func: Callable[..., Any], record_losses: RecordLosses | None
    ) -> dict[str, float]:
        self.state.step_started()
        self.state.zero_grad()
        num_microbatches = num_microbatches_calculator.get_num_microbatches()
        self._backward_starts = 0
        self._backwards_per_step = num_microbatches * len(self.model)
        forward_backward = get_forward_backward_func()
        outputs = forward_backward(
            forward_step_func=forward_step_func,
            data_iterator=self.data_iterator if len(self.model) == 1 else [self.data_iterator] * len(self.model),
            model=self.model,
            num_microbatches=num_microbatches,
            seq_length=self.seq_length,
            micro_batch_size=num_microbatches_calculator.get_micro_batch_size(),
            decoder_seq_length=self.decoder_seq_length,
            forward_only=False,
        )
        losses = {k: v.item() for k, v in reduce_losses(outputs).items()} if ps.is_pipeline_last_stage(ignore_virtual=True) else {}
        if record_losses is not None:
            record_losses(number, losses)
        if self._runtime is not None:
            _couple_model_replica()
        # Megatron-LM's scheduler increment and consumed-samples count.
        global_batch_size = (
            num_microbatches * num_microbatches_calculator.get_micro_batch_size() * ps.get_data_parallel_world_size()
        )
        result = self.optimizer.step()
        # Megatron optimizers report (update_successful, grad_norm, num_zeros); found-inf is
        # already reduced over the model-parallel group inside, so all ranks agree.
        updated = result[0] if isinstance(result, tuple) else True
        self._commit_started()  # no-op unless the update was skipped: the counters still move
        if updated and self.scheduler is not None:
            self.scheduler.step(increment=global_batch_size)
        self.state.advance(global_batch_size)
        if self._runtime is not None:
            self._runtime.commit_finished()
        self.state.step_finished()
        return losses

    def _on_backward_start(self) -> None:
        self._backward_starts += 1
        if self._runtime is not None and self._backward_starts == self._backwards_per_step:
            self._runtime.backward_started()

    def _commit_started(self) -> None:
        self.state.commit_started()
        if self._runtime is not None:
            self._runtime.commit_started()


def _couple_model_replica() -> None:
    """A one-element all-reduce over the model-parallel group(s) (see step 4 of the module docstring)."""
    groups = [ps.get_model_parallel_group()]
    if ps.get_expert_model_parallel_world_size() > 1:
        groups.append(ps.get_expert_tensor_model_pipeline_parallel_group())
    for group in groups:
        if group.size() > 1:
            dist.all_reduce(torch.zeros(1), group=group)
