"""What the Megatron adapter migrates: the torch optimizers whose ``step`` starts a commit, and the set-ups it refuses."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from megatron.core import parallel_state as ps
from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer
from torch.nn.parallel import DistributedDataParallel

__all__ = ["check_supported", "torch_optimizers"]


def torch_optimizers(optimizer: torch.optim.Optimizer | MegatronOptimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers whose ``step()`` changes the state (inside a Megatron optimizer, the wrapped ones)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if isinstance(optimizer, ChainedOptimizer):
        return [inner for chained in optimizer.chained_optimizers for inner in torch_optimizers(chained)]
    if isinstance(optimizer, MegatronOptimizer):
        # A stub optimizer (a rank without trainable parameters) wraps none.
        return [optimizer.optimizer] if optimizer.optimizer is not None else []
    raise TypeError(
        f"torchpass: unsupported optimizer {type(optimizer).__name__}; expected a torch or a Megatron optimizer"
    )


def check_supported(chunks: Sequence[torch.nn.Module], optimizer: Any) -> None:
    """Refuse set-ups the adapter cannot migrate, or that silently train wrong, before anything runs."""
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if len(chunks) != (vpp or 1):
        raise ValueError(
            f"torchpass: got {len(chunks)} model chunk(s) but the virtual pipeline size is {vpp}; pass every chunk"
        )
    if ps.get_pipeline_model_parallel_world_size() > 1 and any(
        isinstance(m, DistributedDataParallel) for chunk in chunks for m in chunk.modules()
    ):
        raise ValueError(
            "torchpass: torch DistributedDataParallel under megatron-core's pipeline schedules never all-reduces "
            "gradients (the schedule enters no_sync before the forwards); wrap the chunks in "
            "megatron.core.distributed.DistributedDataParallel instead"
        )
    torch_optimizers(optimizer)  # raises TypeError for an optimizer that is neither torch's nor Megatron's
