"""TorchTitan's DDP: the ``DistributedDataParallel`` behind torch's composable ``replicate``.

TorchTitan applies DDP with ``replicate(model, device_mesh=..., bucket_cap_mb=100)``,
which builds its ``DistributedDataParallel`` lazily, in the first forward, and
keeps it in ``replicate.state(model)._ddp``; the core's ``find_ddp`` (which
looks for DDP modules) does not see it. The adapter builds it at set-up
instead: its construction broadcasts parameters and checks shapes, collectives
that then run on every rank alike (locally on a spare), and a joining spare has
the DDP object whose bucket layout it must adopt.
"""

from __future__ import annotations

import torch
from torch.distributed._composable.replicate import replicate
from torch.nn.parallel import DistributedDataParallel

__all__ = ["build_now", "replicated_ddp"]


def build_now(model_part: torch.nn.Module) -> None:
    """Build ``model_part``'s DDP now if it is replicated and not built yet (as its first forward would)."""
    state = replicate.state(model_part)
    # `replicate` records its arguments until the DDP is built, then clears them.
    if state is not None and state._init_args:
        state.lazy_init()


def replicated_ddp(model_part: torch.nn.Module) -> DistributedDataParallel | None:
    """The DDP of a replicated model part (after :func:`build_now`), or None if it is not replicated."""
    state = replicate.state(model_part)
    if state is None:
        return None
    ddp = getattr(state, "_ddp", None)
    if ddp is None:
        raise RuntimeError("torchpass: this model part is replicated (DDP) but its DistributedDataParallel was not built yet")
    return ddp
