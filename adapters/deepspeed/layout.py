"""The job's parallel layout read from a DeepSpeed engine, checked against DeepSpeed's own process groups.

DeepSpeed numbers ranks with ``PipeModelDataParallelTopology`` (axes pipe,
data, model; model fastest), which is what
:func:`torchpass.core.topology.deepspeed_layout` encodes:

* ``PipelineEngine``: the pipeline grid's ``pipe x data x model`` sizes;
* ``DeepSpeedEngine``: ``data`` is the sequence-data-parallel size (the group
  ZeRO partitions over: data x Ulysses sequence ranks, which all hold the whole
  model), ``model`` the model-parallel size of the ``mpu``;
* ZeRO 0 replicates parameters and optimizer state along ``data``; ZeRO 1 and
  2 shard the optimizer partitions (fp32 master, moments); ZeRO 3 shards the
  parameters too. The ``"global"`` class (step counters, scheduler,
  hyper-parameters, loss scale) is identical on every rank.

Because an ``mpu`` may order ranks its own way, the layout is not trusted
blindly: this rank's data-parallel replica set must equal the ranks of the
group ZeRO actually reduces over, or the job is refused. The adapter also
checks that every process group DeepSpeed keeps a reference to (the ``groups``
module globals, the engine's cached groups, the ZeRO optimizer's
``dp_process_group`` / ``real_dp_process_group``, ZeRO-3 parameters' groups,
the pipeline grid's and module's groups) is a torchpass rebuildable group: those
keep their identity through a migration and are rebuilt in place, so nothing
DeepSpeed caches has to be re-pointed. ``deepspeed.comm``'s backend object
holds no group references.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.utils import groups

from torchpass.core.comms import RebuildableProcessGroup
from torchpass.core.topology import Layout, deepspeed_layout

__all__ = ["engine_layout", "referenced_groups", "check_groups"]


def engine_layout(engine: DeepSpeedEngine) -> Layout:
    """The layout of the job ``engine`` belongs to, verified against its data-parallel group."""
    stage = engine.zero_optimization_stage()
    if isinstance(engine, PipelineEngine):
        grid = engine.grid
        layout = deepspeed_layout(
            pipe=grid.pipe_parallel_size, data=grid.data_parallel_size, model=grid.model_parallel_size, zero_stage=stage
        )
    else:
        layout = deepspeed_layout(data=engine.seq_dp_world_size, model=engine.mp_world_size, zero_stage=stage)
    rank = dist.get_rank()
    expected = layout.grid().group(rank, ("data",))
    actual = sorted(dist.get_process_group_ranks(_replica_group(engine)))
    if expected != actual:
        raise ValueError(
            f"torchpass: rank {rank}'s data-parallel group in DeepSpeed is {actual}, but DeepSpeed's topology order "
            f"(pipe, data, model; model fastest) puts it in {expected}; an mpu with another rank order is not supported"
        )
    return layout


def _replica_group(engine: DeepSpeedEngine) -> dist.ProcessGroup:
    """The group whose ranks hold identical parameters (and, at ZeRO 0, optimizer state)."""
    if isinstance(engine, PipelineEngine):
        return engine.grid.get_data_parallel_group()
    return engine.seq_data_parallel_group


def _groups_in(label: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dist.ProcessGroup):
        yield label, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _groups_in(f"{label}[{key!r}]", item)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _groups_in(f"{label}[{i}]", item)


def referenced_groups(engine: DeepSpeedEngine) -> list[tuple[str, dist.ProcessGroup]]:
    """Every process group DeepSpeed holds a reference to for ``engine``, labelled by where it is kept."""
    found: list[tuple[str, Any]] = []
    for name in (
        "_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP",
        "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP", "_ALL_TO_ALL_GROUP",
    ):  # fmt: skip
        found += _groups_in(f"deepspeed.utils.groups.{name}", getattr(groups, name, None))
    for name in ("data_parallel_group", "seq_data_parallel_group", "local_all_to_all_group", "expert_parallel_group", "expert_data_parallel_group"):
        found += _groups_in(f"engine.{name}", getattr(engine, name, None))
    for name in ("dp_process_group", "real_dp_process_group", "expert_dp_process_group"):
        found += _groups_in(f"engine.optimizer.{name}", getattr(engine.optimizer, name, None))
    for pname, param in engine.module.named_parameters():
        found += _groups_in(f"parameter {pname}.ds_process_group", getattr(param, "ds_process_group", None))
    if isinstance(engine, PipelineEngine):
        for name in ("ds_model_proc_group", "dp_proc_group", "pp_proc_group", "slice_proc_group"):
            found += _groups_in(f"engine.grid.{name}", getattr(engine.grid, name, None))
        found += _groups_in("engine.module.world_group", getattr(engine.module, "world_group", None))
        for key, tie in getattr(engine.module, "tied_comms", {}).items():
            found += _groups_in(f"engine.module.tied_comms[{key!r}]", tie.get("group"))
    return found


def check_groups(engine: DeepSpeedEngine) -> None:
    """Refuse the job if DeepSpeed holds a process group torchpass cannot rebuild in place."""
    foreign = [f"{label} ({type(group).__name__})" for label, group in referenced_groups(engine) if not isinstance(group, RebuildableProcessGroup)]
    if foreign:
        raise ValueError(
            "torchpass: DeepSpeed holds process groups torchpass cannot rebuild after a failure: "
            + ", ".join(foreign)
            + "; create every group with the gloo backend (the default on CPU) after torchpass launch started the rank"
        )
