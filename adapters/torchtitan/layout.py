"""The migration layout of a TorchTitan job, read from its ``ParallelDims``.

TorchTitan unflattens one world mesh into ``pp, dp_replicate, fsdp, tp``
(dense parameters; ``fsdp = dp_shard x cp``), ``pp, batch, cp, tp`` (data;
``batch = dp_replicate x dp_shard``) and ``pp, dp_replicate, efsdp, ep, etp``
(expert parameters), always with ``dp_replicate`` second: in every one of
them, ranks that differ only in their ``dp_replicate`` coordinate hold the
same shard of every parameter and of its optimizer state (HSDP replicates
along it, DDP is the case ``dp_shard = cp = tp = 1``). Everything else
(``dp_shard``, ``cp``, ``tp``, ``ep``, which only regroups ``dp_shard x cp [x
tp]`` ranks, and ``pp``) splits state. Hence the core's
:func:`~torchpass.core.topology.torchtitan_layout` over ``pp, dp_replicate,
dp_shard, cp, tp``: parameters and optimizer state are identical along
``dp_replicate`` and sharded otherwise, so without ``dp_replicate`` (FSDP
only, TP x FSDP) they are covered by buddy copies (``redundancy: auto``).
"""

from __future__ import annotations

from typing import Any

from torchpass.core.topology import Layout, torchtitan_layout

__all__ = ["layout_of"]


def layout_of(parallel_dims: Any) -> Layout:
    """The layout of a TorchTitan ``ParallelDims`` (after its degrees were resolved, e.g. ``dp_shard = -1``)."""
    pd = parallel_dims
    if pd.dp_shard < 1:
        raise ValueError(f"ParallelDims.dp_shard is {pd.dp_shard}: read the layout after TorchTitan resolved it")
    if pd.ep > 1 and (pd.dp_shard * pd.cp * pd.tp) % (pd.ep * pd.etp):
        raise ValueError(
            f"expert parallelism ep={pd.ep} x etp={pd.etp} does not divide dp_shard x cp x tp = "
            f"{pd.dp_shard * pd.cp * pd.tp}: the expert mesh would not regroup the dense ranks"
        )
    layout = torchtitan_layout(pp=pd.pp, dp_replicate=pd.dp_replicate, dp_shard=pd.dp_shard, cp=pd.cp, tp=pd.tp)
    if layout.world_size != pd.world_size:
        raise ValueError(f"ParallelDims degrees span {layout.world_size} ranks, its world size is {pd.world_size}")
    return layout
