"""A Megatron rank's migratable state: the :class:`~torchpass.core.adapter.StateProvider` of the adapter.

Components and their state classes (see :mod:`.layout` for the replica sets):

============== ========== ==========================================================
component      class      what
============== ========== ==========================================================
``model/<i>``  params     model chunk ``i``'s ``state_dict()`` (parameters, buffers)
``optimizer``  optimizer  ``optimizer.state_dict()``: a torch optimizer's, or a Megatron
                          optimizer's own (its torch optimizers' states; the fp32 master
                          weights and loss scaler of mixed-precision optimizers). The
                          distributed optimizer's is per part of a chain: its
                          ``state_dict()`` (param groups, step, loss scaler) and this
                          rank's shard: each parameter's main-param and moment slices
                          (``_get_main_param_and_optimizer_states``), both read without
                          collectives; sharded over each optimizer instance's ranks
``scheduler``  global     ``OptimizerParamScheduler.state_dict()``
``progress``   global     iteration and consumed training samples (they drive the
                          number-of-microbatches calculator)
``ddp``        global     torch DDP bucket layouts, adopted by whoever fetches state
small state    per rank   the model-parallel RNG tracker's streams (Python, NumPy and
                          torch generators and the data position: the runtime's own)
============== ========== ==========================================================

Step phases (set by :class:`~.run.MegatronRun`): a step is *computing* from its
start to the first change of persistent state, *committing* from there to the
end of its scheduler and progress update, then *idle*. ``discard_step`` uses
the phase: a computing step is undone completely (the runtime rewinds the
global RNG streams and the data, this class the RNG tracker and the
gradients); a committing step leaves the rank dirty, and its state is then
replaced from a replica; an idle rank only drops gradients.

Requirements on the training loop: the state changes only between
``commit_started`` and ``step_finished``; the tracker streams are drawn only
by the step's forward passes.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import torch
from megatron.core import num_microbatches_calculator
from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from torch.nn.parallel import DistributedDataParallel

from torchpass.core import ddp as ddp_support
from torchpass.core.topology import Layout

from .layout import layout_from_parallel_state

__all__ = ["MegatronState", "Progress", "StepPhase"]


class StepPhase(enum.Enum):
    """Where the rank is in a step, as ``discard_step`` needs to know it (see the module docstring)."""

    IDLE = "idle"
    COMPUTING = "computing"
    COMMITTING = "committing"


@dataclass
class Progress:
    """Megatron's training counters (Megatron-LM keeps them in ``args``)."""

    iteration: int = 0
    """Completed steps."""
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    """Megatron-LM: samples a step dropped (``--decrease-batch-size-if-needed``)."""
    consumed_valid_samples: int = 0
    """Megatron-LM: validation samples read, as of the step's start (it positions a spare's validation data)."""
    floating_point_operations: float = 0.0
    """Megatron-LM: ``num_floating_point_operations_so_far`` (logged, and saved in checkpoints)."""


class MegatronState:
    """The model chunks, optimizer, scheduler and counters of one Megatron rank."""

    def __init__(
        self,
        *,
        model: Sequence[torch.nn.Module],
        optimizer: torch.optim.Optimizer | MegatronOptimizer,
        scheduler: OptimizerParamScheduler | None,
        progress: Progress,
        order: str,
    ):
        self.model = list(model)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.progress = progress
        self.phase = StepPhase.IDLE
        self._order = order
        self._ddps: list[DistributedDataParallel] = [d for chunk in self.model for d in ddp_support.find_ddp(chunk)]
        self._distributed = [o for o in _chain(optimizer) if isinstance(o, DistributedOptimizer)]
        self._tracker_at_step_start: dict[str, torch.Tensor] = {}

    # ---- step phases (driven by MegatronRun) ---------------------------------
    def step_started(self) -> None:
        self.phase = StepPhase.COMPUTING
        self._tracker_at_step_start = _tracker_states()

    def commit_started(self) -> None:
        self.phase = StepPhase.COMMITTING

    def step_finished(self) -> None:
        self.phase = StepPhase.IDLE

    def advance(self, global_batch_size: int, *, update_calculator: bool = True) -> None:
        """Count one completed step, as Megatron-LM's ``train()`` does after ``train_step``.

        ``update_calculator``: also move the number-of-microbatches calculator on
        (a megatron-core loop; Megatron-LM's ``train()`` does it itself before each step).
        """
        self.progress.iteration += 1
        self.progress.consumed_train_samples += global_batch_size
        if update_calculator:
            num_microbatches_calculator.update_num_microbatches(
                self.progress.consumed_train_samples, consistency_check=True
            )

    def zero_grad(self) -> None:
        """Drop every gradient: Megatron DDP's grad buffers (``main_grad``), ``.grad`` and the optimizer's."""
        for chunk in self.model:
            # Megatron's DDP (and FSDP) accumulate into grad buffers that only zero_grad_buffer() clears.
            zero_grad_buffer = getattr(chunk, "zero_grad_buffer", None)
            if callable(zero_grad_buffer):
                zero_grad_buffer()
            else:
                chunk.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)

    # ---- StateProvider -------------------------------------------------------
    def layout(self) -> Layout:
        return layout_from_parallel_state(order=self._order, distributed_optimizer=bool(self._distributed))

    def state_components(self) -> tuple[dict[str, Any], dict[str, str]]:
        components: dict[str, Any] = {f"model/{i}": chunk.state_dict() for i, chunk in enumerate(self.model)}
        classes = {name: "params" for name in components}
        components["optimizer"] = self._optimizer_state()
        classes["optimizer"] = "optimizer"
        if self.scheduler is not None:
            components["scheduler"] = self.scheduler.state_dict()
            classes["scheduler"] = "global"
        components["progress"] = asdict(self.progress)
        classes["progress"] = "global"
        components["ddp"] = [ddp_support.bucket_layout(d) for d in self._ddps]
        classes["ddp"] = "global"
        return components, classes

    def load_components(self, components: Mapping[str, Any], *, joining: bool) -> None:
        for i, chunk in enumerate(self.model):
            if f"model/{i}" in components:
                chunk.load_state_dict(components[f"model/{i}"])
        if "optimizer" in components:
            self._load_optimizer_state(components["optimizer"])
        if "scheduler" in components and self.scheduler is not None:
            # load_state_dict() *adds* the saved num_steps (it calls step(increment=num_steps)).
            self.scheduler.num_steps = 0
            self.scheduler.load_state_dict(components["scheduler"])
        if "progress" in components:
            self.progress = Progress(**components["progress"])
            num_microbatches_calculator.update_num_microbatches(
                self.progress.consumed_train_samples, consistency_check=False
            )
        if "ddp" in components:
            # A spare's reducer is fresh and a lagging survivor's may differ: both take the source's buckets.
            for d, layout in zip(self._ddps, components["ddp"]):
                ddp_support.adopt_layout(d, layout)

    def _optimizer_state(self) -> Any:
        if not self._distributed:
            return self.optimizer.state_dict()
        parts = []
        for part in _chain(self.optimizer):
            if isinstance(part, DistributedOptimizer):
                # Its state_dict() needs a step taken (it reads the step count off the moments).
                stepped = any("step" in moments for moments in part.optimizer.state.values())
                common = part.state_dict() if stepped else None
                parts.append({"common": common, "shard": [part._get_main_param_and_optimizer_states(p) for p in _shard_order(part)]})
            else:
                parts.append({"common": part.state_dict(), "shard": None})
        return parts

    def _load_optimizer_state(self, state: Any) -> None:
        if not self._distributed:
            self.optimizer.load_state_dict(state)
            return
        for part, saved in zip(_chain(self.optimizer), state, strict=True):
            if saved["common"] is not None:
                # Allocates the moments of this rank's shard, then loads param groups and step. Before the
                # first step the shard's tensors (main params, moments as initialized) are all there is.
                part.load_state_dict(saved["common"])
            if saved["shard"] is not None:
                with torch.no_grad():  # fp32 main params are views of the model's parameters
                    for param, tensors in zip(_shard_order(part), saved["shard"], strict=True):
                        group, order = part.model_param_group_index_map[param]
                        moments = part.optimizer.state[part.optimizer.param_groups[group]["params"][order]]
                        for name, value in tensors.items():
                            # Storage of this parameter's own: load_state_dict() allocates no moments for a
                            # spare, and gives every parameter one shared step tensor, which Adam would
                            # then advance once per parameter on CPU.
                            if name != "param":
                                moments[name] = torch.empty_like(value)
                        part._set_main_param_and_optimizer_states(param, tensors)

    def discard_step(self) -> None:
        if self.phase is StepPhase.COMPUTING:
            # The runtime rewinds the global generators and the data; the tracker is ours.
            get_cuda_rng_tracker().set_states(_copy(self._tracker_at_step_start))
        self.zero_grad()
        for d in self._ddps:
            # The reducer as the fault-free run has it before the next step (buckets rebuilt or not).
            ddp_support.reset_after_abort(d)
            # Pipeline schedules enter no_sync() by hand and exit it only on success: an
            # interrupted step would leave gradient synchronization off for good.
            d.require_backward_grad_sync = True
        self.phase = StepPhase.IDLE

    # ---- SmallStateProvider -------------------------------------------------
    def small_state(self) -> dict[str, Any]:
        return {"rng_tracker": _tracker_states()}

    def load_small_state(self, state: Mapping[str, Any]) -> None:
        get_cuda_rng_tracker().set_states(_copy(state["rng_tracker"]))


def _chain(optimizer: Any) -> list[Any]:
    """The parts of a ``ChainedOptimizer``, or the optimizer itself."""
    return list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def _shard_order(optimizer: DistributedOptimizer) -> list[torch.nn.Parameter]:
    """The model parameters with a slice in this rank's shard, in the inner optimizer's order (the same at every
    rank of the same model-parallel coordinates and data-parallel position)."""
    index = optimizer.model_param_group_index_map
    return sorted(index, key=lambda param: index[param])


def _tracker_states() -> dict[str, torch.Tensor]:
    """A copy of the model-parallel RNG tracker's streams (CPU tensors, a few KB)."""
    states = get_cuda_rng_tracker().get_states()
    for name, value in states.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"torchpass: the RNG tracker's stream {name!r} is a {type(value).__name__}, not a state tensor "
                "(a CUDA-graph-safe tracker?); only trackers that store generator states are supported"
            )
    return {name: value.detach().cpu().clone() for name, value in states.items()}


def _copy(states: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in states.items()}
