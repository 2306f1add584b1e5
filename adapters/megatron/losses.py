"""Megatron-LM's reduction of a step's losses, as its ``train_step`` and ``training_log`` see them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

__all__ = ["reduce_losses"]


def reduce_losses(outputs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Megatron-LM's ``train_step`` loss reduction: ``[sum, count]`` pairs summed over micro-batches and
    all-reduced over the data-parallel (with context-parallel) group, else a mean over micro-batches."""
    losses: dict[str, torch.Tensor] = {}
    for key in outputs[0] if outputs else ():
        values = [output[key].view(-1) for output in outputs]
        if values[0].numel() == 2:
            total = torch.vstack(values).sum(dim=0)
            dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
            losses[key] = total[0] / total[1]
        elif values[0].numel() == 1:
            losses[key] = torch.cat(values).mean()
        else:
            raise ValueError(f"loss {key!r}: expected one value or a [sum, count] pair per micro-batch, got {tuple(values[0].shape)}")
    return losses
