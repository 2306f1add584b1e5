"""One TorchTitan rank's migratable state, through the trainer's own stateful components.

Implements the core's :class:`~torchpass.core.adapter.StateProvider` over a
TorchTitan ``Trainer``:

=================  ==============  ===============================================================
component          state class     what
=================  ==============  ===============================================================
``model``          ``params``      every model part's DCP state dict (``get_model_state_dict``),
                                   DTensors as their local shards
``optimizer``      ``optimizer``   the inner optimizers' state (moments as local shards, fused
                                   AdamW's ``step``) and param groups (learning rates)
``lr_scheduler``   ``global``      ``LRSchedulersContainer.state_dict()``
``train_state``    ``global``      ``ntokens_seen`` (the step number is the runtime's)
``ddp``            ``global``      DDP's bucket layout, when the job is data parallel by replicate
=================  ==============  ===============================================================

The dataloader's state travels with the rank's small state (see
:mod:`torchpass.adapters.torchtitan.data`): it differs per batch rank.

Invariants and why they hold:

* *Live tensors, no copies, no collectives.* The model state dict is taken once:
  FSDP2 keeps each sharded parameter in one persistent storage and DDP updates
  parameters in place, so its local shards keep referencing the live values;
  DCP's model state-dict API issues no collective with default options.
  Received tensors land directly in that storage (the transfer receives into
  the rank's own capture), and installing them copies only what did not.
* *The optimizer's own state dict, not DCP's.* ``get_optimizer_state_dict``
  (and ``OptimizersContainer.state_dict()``, built on it) runs a hidden
  zero-learning-rate ``step()`` on an optimizer that has no state yet, to
  create it; called at attach, before the first step, that would change
  AdamW's step count and every later result. The plain ``state_dict()`` of the
  inner optimizers has no such side effect; DTensor moments are stored as their
  local shards and re-wrapped with their parameter's mesh and placements on
  install.
* *Sharded state.* Under FSDP/TP each rank's local shards are unique
  (``layout`` says which ranks replicate them); the runtime covers them with
  buddy copies.
* *Discarding a step* undoes what the trainer's ``train_step`` leaves before
  its optimizer step (the commit): partial gradients, FSDP2's or DDP's
  per-iteration state, and the token counters its batch iterator advanced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from torchpass.core import ddp as ddp_support
from torchpass.core import runtime
from torchpass.core.topology import Layout

from . import fsdp2
from .layout import layout_of
from .replicate import replicated_ddp

__all__ = ["TitanStateProvider"]


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _copy_into(live: torch.Tensor, received: torch.Tensor, name: str) -> None:
    if live.shape != received.shape or live.dtype != received.dtype:
        raise RuntimeError(
            f"torchpass: received {name} as {tuple(received.shape)} {received.dtype}; "
            f"this rank holds {tuple(live.shape)} {live.dtype} (a different model or parallel layout?)"
        )
    if live.data_ptr() != received.data_ptr():
        live.copy_(received)


class TitanStateProvider:
    """The state provider of one rank of a TorchTitan ``Trainer`` (see the module docstring).

    Requires of the training loop: :meth:`begin_step` before each step's
    ``train_step``; the optimizers container's ``step()`` is the commit.
    """

    def __init__(self, trainer: Any, on_resume: Callable[[], None] | None = None):
        self._trainer = trainer
        self._on_resume = on_resume
        self._model_parts: list[torch.nn.Module] = list(trainer.model_parts)
        self._ddps = [d for d in map(replicated_ddp, self._model_parts) if d is not None]
        for d in self._ddps:
            ddp_support.check_supported(d)
        with torch.no_grad():
            self._model = {
                fqn: _local(value).detach()
                for part in self._model_parts
                for fqn, value in get_model_state_dict(part).items()
            }
        self._counters_at_step_start: tuple[int, int] | None = None
        trainer.optimizers.register_step_post_hook(self._on_commit)

    # ---- the step ------------------------------------------------------------
    def begin_step(self) -> None:
        """Remember what the step's batches will advance, so an interrupted step can be undone."""
        t = self._trainer
        self._counters_at_step_start = (t.ntokens_seen, t.metrics_processor.ntokens_since_last_log)

    def _on_commit(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        del optimizer, args, kwargs
        self._counters_at_step_start = None

    # ---- StateProvider ---------------------------------------------------------
    def layout(self) -> Layout:
        return layout_of(self._trainer.parallel_dims)

    def state_components(self) -> tuple[dict[str, Any], dict[str, str]]:
        t = self._trainer
        components: dict[str, Any] = {
            "model": self._model,
            "optimizer": [self._local_optimizer_state(opt) for opt in t.optimizers.optimizers],
            "lr_scheduler": t.lr_schedulers.state_dict(),
            "train_state": {"ntokens_seen": t.ntokens_seen},
        }
        classes = {"model": "params", "optimizer": "optimizer", "lr_scheduler": "global", "train_state": "global"}
        if self._ddps:
            components["ddp"] = [ddp_support.bucket_layout(d) for d in self._ddps]
            classes["ddp"] = "global"
        return components, classes

    def load_components(self, components: Mapping[str, Any], *, joining: bool) -> None:
        t = self._trainer
        if "model" in components:
            received = components["model"]
            if received.keys() != self._model.keys():
                missing, extra = sorted(self._model.keys() - received.keys()), sorted(received.keys() - self._model.keys())
                raise RuntimeError(f"torchpass: received model state does not match this rank's: missing {missing}, unexpected {extra}")
            with torch.no_grad():
                for fqn, live in self._model.items():
                    _copy_into(live, received[fqn], f"model parameter {fqn}")
        if "optimizer" in components:
            for opt, state in zip(t.optimizers.optimizers, components["optimizer"], strict=True):
                opt.load_state_dict(self._global_optimizer_state(opt, state))
        if "lr_scheduler" in components:
            t.lr_schedulers.load_state_dict(components["lr_scheduler"])
        if "train_state" in components:
            t.ntokens_seen = components["train_state"]["ntokens_seen"]
            self._counters_at_step_start = None
        if "ddp" in components:
            for d, layout in zip(self._ddps, components["ddp"], strict=True):
                ddp_support.adopt_layout(d, layout)

    def resume(self) -> None:
        """After the rebuild, on every member: the trainer's own resume work (see ``on_resume``)."""
        if self._on_resume is not None:
            self._on_resume()

    def discard_step(self) -> None:
        for part in self._model_parts:
            fsdp2.reset_after_abort(part)
            part.zero_grad(set_to_none=True)
        rt = runtime.current()
        for d in self._ddps:
            ddp_support.settle_after_abort(d, rt.version if rt is not None else 0)
        if self._counters_at_step_start is not None:
            # The step did not commit: its batches are read again when it is re-executed.
            t = self._trainer
            t.ntokens_seen, t.metrics_processor.ntokens_since_last_log = self._counters_at_step_start
            self._counters_at_step_start = None

    # ---- optimizer state -----------------------------------------------------------
    @staticmethod
    def _local_optimizer_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
        sd = opt.state_dict()
        state = {index: {k: _local(v) for k, v in entry.items()} for index, entry in sd["state"].items()}
        return {"state": state, "param_groups": sd["param_groups"]}

    @staticmethod
    def _global_optimizer_state(opt: torch.optim.Optimizer, local: Mapping[str, Any]) -> dict[str, Any]:
        """``local`` with the per-element state of DTensor parameters re-wrapped like the parameter.

        A state tensor shaped like its parameter's local shard (AdamW's moments) was a
        DTensor with the parameter's placements; others (fused AdamW's 0-dim ``step``) stay plain.
        """
        params = [p for group in opt.param_groups for p in group["params"]]
        state: dict[int, dict[str, Any]] = {}
        for index, entry in local["state"].items():
            param = params[index]
            state[index] = dict(entry)
            if not isinstance(param, DTensor):
                continue
            shard_shape = param.to_local().shape
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.shape == shard_shape:
                    state[index][key] = DTensor.from_local(
                        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
                    )
        return {"state": state, "param_groups": local["param_groups"]}
