"""The plain-PyTorch API: a DDP training loop becomes migratable with a few lines.

::

    import torchpass

    model = DistributedDataParallel(net)
    run = torchpass.Run(model=model, optimizer=opt, scheduler=sched, data=loader)
    for step in run.steps(num_steps):
        with step:
            x, y = step.batch()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()

What each line buys:

* ``Run`` names the state a spare must receive (model, optimizer, scheduler and
  any other ``state_dict``/``load_state_dict`` object passed in ``extra``) and
  wraps ``data`` so batches can be replayed and fast-forwarded; the model's
  persistent buffers (BatchNorm statistics) are per-rank state
  (:mod:`torchpass.core.buffers`), the rest of the model is replicated;
* ``run.steps`` owns the step counter: after a migration it yields the step to
  re-execute, and on a spare it starts where the job stands;
* ``with step`` delimits the step: a collective failing inside it starts the
  survivor side of the migration, and the block is re-executed;
* ``step.batch()`` hands out the step's batches (call it once per micro-batch).

The optimizer step is the commit point: the persistent state must change only
inside ``optimizer.step()`` (and the scheduler step right after it, with no
collective in between). Keep the whole step, logging included, inside the
``with`` block: code after the block also runs for an interrupted step (whose
``step.done`` is False) before the loop re-executes it. Without
``torchpass launch`` the same loop runs as a plain loop.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from . import ddp as ddp_support
from . import runtime
from .buffers import ModuleBuffers
from .data import ReplayableData
from .loop import Step, steps
from .topology import Layout, StateClass, ddp_layout

__all__ = ["Run", "Step", "watch_backward"]


def watch_backward(module: torch.nn.Module, callback: Any) -> None:
    """Call ``callback`` when a backward pass reaches ``module``'s outputs (the forward is then complete).

    A forward hook puts a gradient hook on the output tensors; neither changes
    any value, so results stay bitwise identical.
    """

    def on_forward(mod: torch.nn.Module, args: Any, output: Any) -> None:
        del mod, args
        fired = [False]

        def on_grad(grad: torch.Tensor) -> None:
            if not fired[0]:
                fired[0] = True
                callback()

        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(on_grad)

    module.register_forward_hook(on_forward)


def _local(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state this rank holds: ZeroRedundancyOptimizer's local shard optimizer.

    Its own ``state_dict`` consolidates every rank's shard with collectives, which a
    migration can neither afford nor rely on.
    """
    return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


class Run:
    """The state and data of a plain PyTorch training job (a :class:`~torchpass.core.adapter.StateProvider`)."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        scheduler: Any = None,
        data: Iterable[Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        layout: Layout | None = None,
    ):
        self.model = model
        self.optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        self.scheduler = scheduler
        rt = runtime.current()
        keep = rt.config.buddy_interval_steps + 1 if rt is not None else 1
        self.data = ReplayableData(data, keep_steps=keep) if data is not None else None
        self.extra = dict(extra or {})
        self._layout = layout
        self._ddps = ddp_support.find_ddp(model)
        self._buffers = ModuleBuffers(model)
        if rt is not None:
            for d in self._ddps:
                ddp_support.check_supported(d)
            watch_backward(model, rt.backward_started)

    # ---- the loop ---------------------------------------------------------
    def steps(self, num_steps: int, start: int = 1) -> Iterator[Step]:
        """Yield steps ``start..num_steps``; after a migration, the step to execute next."""
        return steps(self, data=self.data, optimizers=self.optimizers, start=start, stop=num_steps)

    # ---- StateProvider ------------------------------------------------------
    def layout(self) -> Layout:
        if self._layout is not None:
            return self._layout
        layout = ddp_layout(dist.get_world_size())
        if any(isinstance(opt, ZeroRedundancyOptimizer) for opt in self.optimizers):
            # ZeRO-1: each rank's optimizer state covers its own partition of the parameters.
            grid = layout.grid()
            classes = dict(layout.state_classes)
            classes["optimizer"] = StateClass(grid.name, ())
            layout = Layout("ddp+zero1", layout.grids, classes)
        return layout

    def state_components(self) -> tuple[dict[str, Any], dict[str, str]]:
        buffers = self._buffers.names()
        components: dict[str, Any] = {
            # Parameters only: the buffers are per rank and travel as small state.
            "model": {k: v for k, v in self.model.state_dict().items() if k not in buffers},
            "optimizer": [_local(opt).state_dict() for opt in self.optimizers],
            "ddp": [ddp_support.bucket_layout(d) for d in self._ddps],
        }
        classes = {"model": "params", "optimizer": "optimizer", "ddp": "global"}
        zero = [opt for opt in self.optimizers if isinstance(opt, ZeroRedundancyOptimizer)]
        if zero:
            # The hyper-parameters schedulers write live in the wrapper's param_groups,
            # which overwrite the shard optimizer's at every step.
            components["zero_groups"] = [[_hyper(g) for g in opt.param_groups] for opt in zero]
            classes["zero_groups"] = "global"
        if self.scheduler is not None:
            components["scheduler"] = self.scheduler.state_dict()
            classes["scheduler"] = "global"
        for name, obj in self.extra.items():
            components[f"extra/{name}"] = obj.state_dict()
            classes[f"extra/{name}"] = "global"
        return components, classes

    def load_components(self, components: Mapping[str, Any], *, joining: bool) -> None:
        if "model" in components:
            # The live buffers complete the received parameters: the load stays strict for them.
            live = self.model.state_dict()
            buffers = {k: live[k] for k in self._buffers.names() if k in live}
            self.model.load_state_dict({**buffers, **components["model"]})
        if "optimizer" in components:
            for opt, state in zip(self.optimizers, components["optimizer"]):
                _local(opt).load_state_dict(state)
        if "zero_groups" in components:
            zero = [opt for opt in self.optimizers if isinstance(opt, ZeroRedundancyOptimizer)]
            for opt, groups in zip(zero, components["zero_groups"]):
                for group, saved in zip(opt.param_groups, groups):
                    group.update(saved)
        if "scheduler" in components and self.scheduler is not None:
            self.scheduler.load_state_dict(components["scheduler"])
        for name, obj in self.extra.items():
            if f"extra/{name}" in components:
                obj.load_state_dict(components[f"extra/{name}"])
        if "ddp" in components:
            for d, layout in zip(self._ddps, components["ddp"]):
                ddp_support.adopt_layout(d, layout)

    # ---- SmallStateProvider: persistent buffers ---------------------------------
    def small_state(self) -> dict[str, torch.Tensor] | None:
        """Copies of this rank's persistent module buffers (BatchNorm statistics): each rank's forward updates its own."""
        return self._buffers.copy() if self._buffers else None

    def load_small_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self._buffers.load(state)

    def discard_step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        rt = runtime.current()
        for d in self._ddps:
            ddp_support.settle_after_abort(d, rt.version if rt is not None else 0)
