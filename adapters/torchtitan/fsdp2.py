"""Undo what an interrupted forward or backward left in FSDP2's per-iteration state.

A collective failing mid-backward leaves FSDP2 mid-iteration: parameter
groups unsharded (plain unsharded tensors registered on the modules instead of
the sharded DTensors), reduce-scatter states queued, the root's end-of-backward
callback marked as queued, training states not IDLE. Re-executing the step on
top of that fails (``clip_grad_norm_`` then mixes plain tensors and DTensors)
or reduces stale gradients.

torch 2.13 provides the recovery itself: ``FSDPModule.reset_iter_state()`` on
the root waits on in-flight events, reshards every group and clears the
iteration trackers, without a collective. It keeps unreduced gradients on the
unsharded parameters, which autograd would accumulate into during the
re-execution (those parameters are not registered on the modules once
resharded, so ``zero_grad`` does not reach them): :func:`reset_after_abort`
drops them too.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

__all__ = ["reset_after_abort"]


def reset_after_abort(model_part: torch.nn.Module) -> None:
    """Bring an FSDP2 root module (a TorchTitan model part) back to a clean, sharded, idle state."""
    if not isinstance(model_part, FSDPModule):
        return
    model_part.reset_iter_state()
    for module in model_part.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                # Exists once the group was first unsharded.
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
