"""The job's parallel layout, read from megatron-core's ``parallel_state`` and checked against its groups.

megatron-core lays ranks out with two ``RankGenerator``s over one order string
(``tp-cp-ep-dp-pp`` by default, fastest first): a dense one (tp, cp, dp, pp)
and an expert one (expert tp, ep, expert dp, pp).
:func:`~torchpass.core.topology.megatron_layout` encodes that order;
this module fills it with the sizes ``parallel_state`` was initialized with.

Replica sets (who can give a lost rank its state):

* model parameters: the ranks with the same tp, pp (and ep) coordinates, i.e.
  the rank's data-parallel-with-context-parallel group;
* optimizer state: the same, unless the distributed optimizer shards it over
  that group: then each shard is sharded state, covered by buddy copies, or by
  the other optimizer instances when ``num_distributed_optimizer_instances > 1``;
* expert parameters: the expert-data-parallel group;
* the scheduler and progress counters: every rank.

``parallel_state`` does not keep the order string, so the caller passes the
one it gave ``initialize_model_parallel``; the layout is then checked against
the groups ``parallel_state`` actually built for this rank, and a mismatch
(a wrong order) is an error, not a silent choice of wrong replicas.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state as ps

from torchpass.core.topology import Layout, megatron_layout

__all__ = ["DEFAULT_ORDER", "LayoutMismatch", "layout_from_parallel_state", "check_against_parallel_state"]

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
"""megatron-core's default; Megatron-LM uses ``tp-cp-ep-pp-dp`` with ``--use-tp-pp-dp-mapping``."""


class LayoutMismatch(ValueError):
    """The layout built from the sizes and order disagrees with a group ``parallel_state`` built."""


def layout_from_parallel_state(*, order: str = DEFAULT_ORDER, distributed_optimizer: bool = False) -> Layout:
    """This job's layout from the initialized ``parallel_state`` (sizes) and ``order``.

    ``distributed_optimizer``: optimizer state is sharded over each optimizer
    instance's data-parallel ranks (Megatron's ``DistributedOptimizer``).
    """
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("megatron-core's parallel_state is not initialized: call initialize_model_parallel first")
    dp, cp = ps.get_data_parallel_world_size(), ps.get_context_parallel_world_size()
    in_instance = ps.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True)
    layout = megatron_layout(
        tp=ps.get_tensor_model_parallel_world_size(),
        cp=cp,
        ep=ps.get_expert_model_parallel_world_size(),
        dp=dp,
        pp=ps.get_pipeline_model_parallel_world_size(),
        order=order,
        expert_tp=ps.get_expert_tensor_parallel_world_size(),
        distributed_optimizer=distributed_optimizer,
        num_distributed_optimizer_instances=dp * cp // in_instance,
    )
    check_against_parallel_state(layout, dist.get_rank(), order)
    return layout


def check_against_parallel_state(layout: Layout, rank: int, order: str) -> None:
    """Raise :class:`LayoutMismatch` unless ``layout`` yields the groups ``parallel_state`` gave ``rank``."""
    dense = layout.grid("dense")
    checks: list[tuple[str, list[int], object]] = [
        ("tensor-parallel", dense.group(rank, ["tp"]), ps.get_tensor_model_parallel_group()),
        ("pipeline-parallel", dense.group(rank, ["pp"]), ps.get_pipeline_model_parallel_group()),
        (
            "data-parallel (with context parallel)",
            layout.replica_set(rank, "params"),
            ps.get_data_parallel_group(with_context_parallel=True),
        ),
    ]
    if "cp" in (d.name for d in dense.dims):
        # With several distributed-optimizer instances the grid splits dp x cp into
        # instance blocks instead; the data-parallel check above covers cp then.
        checks.append(("context-parallel", dense.group(rank, ["cp"]), ps.get_context_parallel_group()))
    if "expert_params" in layout.state_classes:
        expert = layout.grid("expert")
        checks += [
            ("expert-parallel", expert.group(rank, ["ep"]), ps.get_expert_model_parallel_group()),
            ("expert-data-parallel", layout.replica_set(rank, "expert_params"), ps.get_expert_data_parallel_group()),
        ]
    for name, expected, group in checks:
        if not isinstance(group, dist.ProcessGroup):
            continue  # parallel_state keeps a list when several pipeline groups contain this rank
        actual = sorted(dist.get_process_group_ranks(group))
        if actual != expected:
            raise LayoutMismatch(
                f"rank {rank}: megatron-core's {name} group is {actual}, but order {order!r} with "
                f"{_sizes(layout)} gives {expected}; pass the order given to initialize_model_parallel"
            )


def _sizes(layout: Layout) -> str:
    return " x ".join(f"{d.name}={d.size}" for d in layout.grid("dense").dims)
