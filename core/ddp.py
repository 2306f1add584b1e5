"""Keeping torch DDP's gradient buckets identical on every rank across migrations.

DDP's reducer allreduces gradients bucket by bucket. It rebuilds its buckets
once, in the forward of its second iteration, from the gradient-ready order
its first backward recorded, and adopts rank 0's layout through two
broadcasts (``Reducer::sync_bucket_indices``). Every rank must use the same
layout: different buckets mean different collective sizes (a hang or an error)
and different reduction orders (different bits). A migration can land anywhere
in that sequence, a broadcast of it included, and a spare's reducer is fresh.

The invariant torchpass keeps: when training resumes, every rank's reducer is
in the state the fault-free run's reducers have at the start of the step about
to execute. Before any step completed (version 0) that is a fresh reducer:
construction-time buckets, nothing recorded. Afterwards it is the rebuilt
layout, marked rebuilt so DDP never rebuilds again.

* Survivors (``settle_after_abort``): complete a rebuild the interrupted step
  was about to do, from the order the first backward recorded; clear the
  aborted iteration with ``_reset_state``; then re-mark the layout as rebuilt.
* Ranks that fetch state (spares, lagging survivors; ``adopt_layout``): take
  the layout of the rank they copy from, which reports it as replicated state.

Both replay DDP's own rebuild (``_push_all_rebuilt_params`` then
``_rebuild_buckets``) with the group in local mode, its two broadcasts answered
with the layout: exactly what rank 0 would have sent. Local mode is free here:
the group's transport is being replaced by the migration anyway.

``static_graph=True`` changes the first iteration's reduction on a fresh
reducer, which a joining spare cannot reproduce in step with the survivors; it
is rejected with an explicit error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .comms import RebuildableProcessGroup

__all__ = ["find_ddp", "check_supported", "bucket_layout", "adopt_layout", "reset_after_abort", "settle_after_abort"]


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


_LAYOUT_ATTR = "_torchpass_bucket_layout"
_DEFAULT_SAMPLE_RATE = 100
"""DDP's runtime-logging sample rate (kDDPRuntimeLoggingSampleRate in reducer.hpp)."""


def _logged_layout(ddp: DistributedDataParallel) -> list[list[int]] | None:
    data = ddp._get_ddp_logging_data()
    if not data.get("has_rebuilt_buckets", 0):
        return None
    text = str(data.get("rebuilt_per_bucket_param_indices", ""))
    return [[int(i) for i in part.split()] for part in text.split(",") if part.strip()]


def _current_layout(ddp: DistributedDataParallel) -> list[list[int]]:
    """The rebuilt layout of a reducer that has rebuilt (DDP logs it one forward late; make it log now)."""
    known = getattr(ddp, _LAYOUT_ATTR, None) or _logged_layout(ddp)
    if known is not None:
        return known
    ddp.reducer._set_ddp_runtime_logging_sample_rate(1)
    try:
        ddp.logger.set_runtime_stats_and_log()
    finally:
        ddp.reducer._set_ddp_runtime_logging_sample_rate(_DEFAULT_SAMPLE_RATE)
    logged = _logged_layout(ddp)
    if logged is None:
        raise RuntimeError("torchpass: DDP rebuilt its buckets but did not report the layout")
    return logged


def bucket_layout(ddp: DistributedDataParallel) -> dict[str, Any]:
    """Whether the reducer has rebuilt its buckets, and the per-bucket parameter indices if so."""
    if not ddp._has_rebuilt_buckets and getattr(ddp, _LAYOUT_ATTR, None) is None:
        return {"rebuilt": False, "buckets": []}
    return {"rebuilt": True, "buckets": _current_layout(ddp)}


def _local_group(ddp: DistributedDataParallel) -> RebuildableProcessGroup:
    group = ddp.process_group
    if not isinstance(group, RebuildableProcessGroup):
        raise RuntimeError(f"torchpass: DDP's process group is a {type(group).__name__}, not rebuildable")
    group.go_local()
    return group


def _replay_rebuild(ddp: DistributedDataParallel, group: RebuildableProcessGroup, buckets: list[list[int]]) -> None:
    flat = [i for b in buckets for i in b]
    if sorted(flat) != list(range(len(flat))):
        raise RuntimeError(f"torchpass: DDP bucket layout is not a permutation of the parameters: {buckets}")
    group.script_broadcasts(
        [torch.tensor(flat + [len(buckets)], dtype=torch.int32), torch.tensor([len(b) for b in buckets], dtype=torch.int32)]
    )
    ddp.reducer._push_all_rebuilt_params()
    if not ddp.reducer._rebuild_buckets():
        raise RuntimeError("torchpass: DDP refused to rebuild its buckets")
    ddp._has_rebuilt_buckets = True
    setattr(ddp, _LAYOUT_ATTR, buckets)


def adopt_layout(ddp: DistributedDataParallel, layout: dict[str, Any]) -> None:
    """Give a rank that fetched its state the layout of the rank it copied from."""
    group = _local_group(ddp)
    ddp.reducer._reset_state()
    ddp._has_rebuilt_buckets = False
    setattr(ddp, _LAYOUT_ATTR, None)
    if layout["rebuilt"]:
        _replay_rebuild(ddp, group, layout["buckets"])


def settle_after_abort(ddp: DistributedDataParallel, version: int) -> None:
    """Bring a survivor's reducer to the state of the fault-free run before step ``version + 1``."""
    group = _local_group(ddp)
    if version >= 1 and not ddp._has_rebuilt_buckets and ddp.reducer._rebuild_buckets():
        # The interrupted step was about to rebuild; every rank recorded the same order.
        ddp._has_rebuilt_buckets = True
    layout = bucket_layout(ddp) if version >= 1 else {"rebuilt": False, "buckets": []}
    ddp.reducer._reset_state()
    ddp._has_rebuilt_buckets = False
    setattr(ddp, _LAYOUT_ATTR, None)
    if layout["rebuilt"]:
        _replay_rebuild(ddp, group, layout["buckets"])


def reset_after_abort(ddp: DistributedDataParallel) -> None:
    """``settle_after_abort`` at the rank's current version (idempotent after ``adopt_layout``)."""
    from . import runtime

    rt = runtime.current()
    settle_after_abort(ddp, rt.version if rt is not None else 0)
