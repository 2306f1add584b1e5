"""Keeping torch DDP's gradient buckets identical on survivors and on a joining spare.

DDP's reducer allreduces gradients bucket by bucket. After the first iteration
it *rebuilds* its buckets in gradient-ready order and adopts rank 0's layout
through two broadcasts (``Reducer::sync_bucket_indices``). Every rank must use
the same layout: different buckets mean different collective sizes (a hang or
an error) and different reduction orders (different bits). A spare's DDP is
fresh, so it holds the construction-time layout while the survivors hold the
rebuilt one. The fix uses DDP's own mechanisms:

* the layout is part of the replicated state: the source reports whether it has
  rebuilt and its per-bucket parameter indices (DDP logs both);
* the spare, still in local mode, calls ``_push_all_rebuilt_params`` and
  ``_rebuild_buckets``; the two broadcasts of ``sync_bucket_indices`` are
  answered locally with the source's layout, exactly what rank 0 would have
  sent, so the reducer initializes the survivors' buckets;
* every rank, survivors included, then calls ``_reset_state``: it clears what
  the aborted backward left behind (pending buckets, expected hooks) and marks
  the buckets for one more rebuild, which all ranks now perform together, in the
  same iteration, from the same ready order, reproducing the same layout.

``static_graph=True`` changes the first iteration's reduction on a fresh
reducer, which a joining spare cannot reproduce in step with the survivors; it
is rejected with an explicit error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .comms import RebuildableProcessGroup

__all__ = ["find_ddp", "check_supported", "bucket_layout", "adopt_layout", "reset_after_abort"]


def find_ddp(module: torch.nn.Module) -> list[DistributedDataParallel]:
    """Every DDP wrapper in ``module`` (the module itself included)."""
    return [m for m in module.modules() if isinstance(m, DistributedDataParallel)]


def check_supported(ddp: DistributedDataParallel) -> None:
    if ddp.static_graph:
        raise ValueError(
            "torchpass: DistributedDataParallel(static_graph=True) is not supported: a joining spare's first "
            "iteration would reduce gradients differently from the survivors'. Construct DDP without static_graph."
        )
    if not isinstance(ddp.process_group, RebuildableProcessGroup):
        raise ValueError(
            f"torchpass: this DDP's process group is a {type(ddp.process_group).__name__}, not a rebuildable group; "
            "create process groups after torchpass is installed (start the job with `torchpass launch`)."
        )


def bucket_layout(ddp: DistributedDataParallel) -> dict[str, Any]:
    """Whether the reducer has rebuilt its buckets, and the per-bucket parameter indices if so."""
    data = ddp._get_ddp_logging_data()
    rebuilt = bool(data.get("has_rebuilt_buckets", 0))
    buckets: list[list[int]] = []
    if rebuilt:
        text = str(data.get("rebuilt_per_bucket_param_indices", ""))
        buckets = [[int(i) for i in part.split()] for part in text.split(",") if part.strip()]
    return {"rebuilt": rebuilt, "buckets": buckets}


def adopt_layout(ddp: DistributedDataParallel, layout: dict[str, Any]) -> None:
    """Give a joining rank's fresh reducer the survivors' bucket layout (call in local mode)."""
    if not layout["rebuilt"]:
        return
    group = ddp.process_group
    if not isinstance(group, RebuildableProcessGroup) or not group.is_local:
        raise RuntimeError("adopt_layout must run while the joining rank's groups are local")
    buckets = layout["buckets"]
    flat = [i for b in buckets for i in b]
    if sorted(flat) != list(range(len(flat))):
        raise RuntimeError(f"torchpass: the source's DDP bucket layout is not a permutation of the parameters: {buckets}")
    indices = torch.tensor(flat + [len(buckets)], dtype=torch.int32)
    sizes = torch.tensor([len(b) for b in buckets], dtype=torch.int32)
    group.script_broadcasts([indices, sizes])
    ddp.reducer._push_all_rebuilt_params()
    if not ddp.reducer._rebuild_buckets():
        raise RuntimeError("torchpass: DDP refused to rebuild its buckets on the joining rank")
    mine = bucket_layout(ddp)
    if mine["buckets"] and mine["buckets"] != buckets:
        raise RuntimeError(f"torchpass: DDP bucket layout mismatch after adoption: {mine['buckets']} vs {buckets}")


def reset_after_abort(ddp: DistributedDataParallel) -> None:
    """Clear the state an interrupted backward left and re-arm the bucket rebuild on every rank alike."""
    ddp.reducer._reset_state()
    ddp._has_rebuilt_buckets = False
