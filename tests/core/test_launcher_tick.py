"""The launcher's loop ticks the controller faster while training waits on a migration: each of those phases'
steps is seen at the next tick, so the tick interval would otherwise add to the recovery."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from torchpass.core.config import TorchPassConfig
from torchpass.core.controller import Controller, JobSpec, _Migration
from torchpass.core.launcher import MIGRATING_TICK_S, tick_interval


def test_the_loop_ticks_faster_only_while_a_migration_collects_reports_or_waits_for_ready_ranks(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=10))
    spec = JobSpec(world_size=2, nnodes=1, nproc_per_node=2, spares_per_node=1, run_id="t", command=["train.py"])
    controller = Controller(store, spec, tmp_path, TorchPassConfig(), lambda line: None, lambda node, order: None, "127.0.0.1:0")

    assert tick_interval(None, 0.05) == 0.05  # a launcher that does not run the controller
    assert tick_interval(controller, 0.05) == 0.05
    controller.migration = _Migration(generation=1, cause="kill", classification="qualifying", t_fault=0.0, t_detect=0.0, failed={1})
    assert tick_interval(controller, 0.05) == MIGRATING_TICK_S < 0.05
    assert tick_interval(controller, 0.001) == 0.001  # never slower than the interval the user asked for
    controller.migration.phase = "joining"
    assert tick_interval(controller, 0.05) == MIGRATING_TICK_S
    controller.migration.phase = "resuming"  # training goes on: the done reports are only bookkeeping
    assert tick_interval(controller, 0.05) == 0.05
