"""A DeepSpeed engine's persistent state as the runtime's components, per ZeRO stage.

Components are DeepSpeed's own live tensors (no copies: the runtime serves and
receives them in place) and the small objects next to them:

* ``params`` (state class ``params``): ZeRO 0 the module parameters; ZeRO 1/2
  ``bit16_groups_flat``, the flat low-precision buffers holding every rank's
  partition (module parameters are views into them), a *derived* class: never
  snapshotted or moved, recomputed after a migration from the fp32 master
  partitions (:meth:`EngineState.rederive`); ZeRO 3 this rank's
  ``fp16_partitioned_groups_flat`` (every ``ds_tensor`` is a view into them);
* ``optimizer`` (state class ``optimizer``): the inner torch optimizer's
  per-parameter state (moments, step), plus the fp32 master partitions at ZeRO
  1/2 (``single_partition_of_fp32_groups``) and ZeRO 3
  (``fp32_partitioned_groups_flat``, left out where it is the ``params`` tensor
  itself, in fp32 training);
* ``engine`` (state class ``global``): ``global_steps``, ``global_samples``,
  ``micro_steps``, ``skipped_steps``, ``_step_applied``, the LR scheduler's
  ``state_dict()``, the inner optimizer's hyper-parameters and the loss
  scaler's state.

The classes are those of :func:`torchpass.core.topology.deepspeed_layout`.
The ZeRO-3 partitions include DeepSpeed's per-parameter padding, transferred
as is (its bytes are never read into real values). DeepSpeed allocates it
uninitialized, so :func:`zero_partition_padding` sets it to zeros once, when
the engine is hooked: the rank's whole state then has one fingerprint per
trajectory, and a fault campaign (which compares whole-state fingerprints
with the fault-free run's) can judge ZeRO-3 jobs.

The inner optimizer creates its per-parameter state lazily at its first step,
so an engine that has not stepped (a spare) has none: :meth:`EngineState.load`
creates it from what it received. Loading uses no collective.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

__all__ = ["COUNTERS", "EngineState", "STATE_CLASSES", "copy_into", "engine_state"]

COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps", "_step_applied")
"""The engine's step counters (``_step_applied`` is what ``was_step_applied()`` reports)."""

_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
"""The loss scaler fields that change during training (the rest is configuration)."""

STATE_CLASSES = {"params": "params", "optimizer": "optimizer", "engine": "global"}
"""Component -> state class of the layout."""


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def copy_into(live: torch.Tensor, received: torch.Tensor) -> None:
    """Copy a received tensor into the live one, unless the runtime received straight into it."""
    if not _same_storage(live, received) or live.storage_offset() != received.storage_offset():
        live.data.copy_(received)


class EngineState(ABC):
    """The persistent state of one engine (see the module docstring); subclasses know where each ZeRO stage keeps it."""

    def __init__(self, engine: DeepSpeedEngine):
        self.engine = engine

    # ---- what differs per stage ---------------------------------------------
    @property
    @abstractmethod
    def inner(self) -> torch.optim.Optimizer:
        """The torch optimizer that holds the moments and whose step is the commit."""

    @abstractmethod
    def _params(self) -> dict[str, Any]:
        """The ``params`` component: live low-precision model tensors."""

    @abstractmethod
    def _load_params(self, params: Mapping[str, Any]) -> None:
        """Copy a received ``params`` component into the live tensors."""

    def rederive(self) -> None:
        """Recompute the components the layout declares derived, from the rest (a collective where there are any).

        Runs on every member once a migration's generation is live. Stages without derived state do nothing.
        """

    @abstractmethod
    def _master_and_keys(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(fp32 master tensors this stage transfers, the tensors the inner optimizer's state is keyed by)."""

    # ---- shared ---------------------------------------------------------------
    def components(self) -> tuple[dict[str, Any], dict[str, str]]:
        masters, keys = self._master_and_keys()
        optimizer = {"master": masters, "state": [dict(self.inner.state.get(key, {})) for key in keys]}
        return {"params": self._params(), "optimizer": optimizer, "engine": self._engine_component()}, dict(STATE_CLASSES)

    def load(self, components: Mapping[str, Any]) -> None:
        """Install received components (any subset) into the live engine; no collectives."""
        if "params" in components:
            self._load_params(components["params"])
        if "optimizer" in components:
            masters, keys = self._master_and_keys()
            for live, received in zip(masters, components["optimizer"]["master"], strict=True):
                copy_into(live, received)
            for key, received in zip(keys, components["optimizer"]["state"], strict=True):
                self._load_param_state(key, received)
        if "engine" in components:
            self._load_engine_component(components["engine"])

    def _load_param_state(self, key: torch.Tensor, received: Mapping[str, Any]) -> None:
        live = self.inner.state.get(key)
        if live and set(live) == set(received):
            for name, value in received.items():
                if isinstance(value, torch.Tensor):
                    copy_into(live[name], value)
                else:
                    live[name] = value
        else:
            # A rank whose optimizer never stepped: create the state, owning its memory
            # (received buffers may belong to the runtime's receive pool).
            self.inner.state[key] = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in received.items()}

    def _scaler(self) -> Any:
        return getattr(self.engine.optimizer, "loss_scaler", None)

    def _engine_component(self) -> dict[str, Any]:
        engine = self.engine
        scaler = self._scaler()
        return {
            "counters": {name: getattr(engine, name) for name in COUNTERS},
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "hyperparameters": [{k: v for k, v in group.items() if k != "params"} for group in self.inner.param_groups],
            "loss_scaler": {f: getattr(scaler, f) for f in _SCALER_FIELDS if hasattr(scaler, f)} if scaler is not None else None,
        }

    def _load_engine_component(self, saved: Mapping[str, Any]) -> None:
        engine = self.engine
        for name, value in saved["counters"].items():
            setattr(engine, name, value)
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(copy.deepcopy(saved["lr_scheduler"]))
        for group, hyper in zip(self.inner.param_groups, saved["hyperparameters"], strict=True):
            group.update(copy.deepcopy(hyper))
        scaler = self._scaler()
        if scaler is not None and saved["loss_scaler"] is not None:
            for name, value in saved["loss_scaler"].items():
                setattr(scaler, name, value)


class _Zero0State(EngineState):
    """ZeRO 0: every rank holds the whole model and the whole optimizer state (fp32)."""

    @property
    def inner(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    def _params(self) -> dict[str, Any]:
        return dict(self.engine.module.named_parameters())

    def _load_params(self, params: Mapping[str, Any]) -> None:
        for name, live in self.engine.module.named_parameters():
            copy_into(live, params[name])

    def _master_and_keys(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [], [p for group in self.inner.param_groups for p in group["params"]]


class _Zero12State(EngineState):
    """ZeRO 1 and 2: replicated flat low-precision model, this rank's fp32 partition and its moments."""

    @property
    def optimizer(self) -> DeepSpeedZeroOptimizer:
        return self.engine.optimizer

    @property
    def inner(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer

    def _params(self) -> dict[str, Any]:
        return {"bit16_flat": list(self.optimizer.bit16_groups_flat)}

    def _load_params(self, params: Mapping[str, Any]) -> None:
        # Module parameters are views into these buffers, so they follow.
        for live, received in zip(self.optimizer.bit16_groups_flat, params["bit16_flat"], strict=True):
            copy_into(live, received)

    def _master_and_keys(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        masters = list(self.optimizer.single_partition_of_fp32_groups)
        return masters, masters

    def rederive(self) -> None:
        # The low-precision flats are derived (core.topology.deepspeed_layout): DeepSpeed's own
        # post-step update, each rank's fp32 partition cast into its share, then the all-gather
        # over each group's data-parallel group, gives back the bits its step wrote.
        self.optimizer.update_lp_params()


class _Zero3State(EngineState):
    """ZeRO 3: this rank's low-precision partitions, fp32 partitions and moments (all sharded)."""

    @property
    def optimizer(self) -> DeepSpeedZeroOptimizer_Stage3:
        return self.engine.optimizer

    @property
    def inner(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer

    def _params(self) -> dict[str, Any]:
        return {"bit16_partitions": list(self.optimizer.fp16_partitioned_groups_flat)}

    def _load_params(self, params: Mapping[str, Any]) -> None:
        # Every parameter's ds_tensor is a view into these flats, so they follow.
        for live, received in zip(self.optimizer.fp16_partitioned_groups_flat, params["bit16_partitions"], strict=True):
            copy_into(live, received)

    def _master_and_keys(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        keys = list(self.optimizer.fp32_partitioned_groups_flat)
        # fp32 training: the master partition is the params tensor itself; transfer it once.
        masters = [
            key for key, bit16 in zip(keys, self.optimizer.fp16_partitioned_groups_flat, strict=True) if not _same_storage(key, bit16)
        ]
        return masters, keys


def zero_partition_padding(optimizer: DeepSpeedZeroOptimizer_Stage3) -> None:
    """Zero the padding after each parameter's share in this rank's ZeRO-3 partitions (low-precision and fp32).

    Parameter ``p``'s partition on data-parallel rank ``r`` holds elements ``r * n .. (r + 1) * n`` of the
    flattened parameter (``n`` its partition size); those at or past ``p.ds_numel`` are padding.
    """
    dp_rank = dist.get_rank(group=optimizer.dp_process_group)
    with torch.no_grad():
        for i, params in enumerate(optimizer.fp16_groups):
            flats = {optimizer.fp16_partitioned_groups_flat[i], optimizer.fp32_partitioned_groups_flat[i]}
            offset = 0
            for param in params:
                part = param.ds_tensor.numel()
                valid = max(0, min(part, param.ds_numel - dp_rank * part))
                for flat in flats:
                    flat[offset + valid : offset + part].zero_()
                offset += part


def engine_state(engine: DeepSpeedEngine) -> EngineState:
    """The state accessor for ``engine``'s ZeRO stage (the engine was checked by :func:`.support.check_supported`)."""
    stage = engine.zero_optimization_stage()
    if stage == 0:
        return _Zero0State(engine)
    if stage in (1, 2):
        return _Zero12State(engine)
    return _Zero3State(engine)
