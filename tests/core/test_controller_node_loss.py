"""A node declared lost takes every process on it along: its ranks, its idle spares, and a spare that the
migration in progress already gave a rank (which has left the spare pool by then)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from torchpass.core.config import TorchPassConfig
from torchpass.core.control import Keys, Report
from torchpass.core.controller import Controller, JobSpec, _Migration
from torchpass.core.liveness import BeatWatch
from tests.support.clock import ManualClock


def test_a_spare_given_a_rank_by_the_migration_in_progress_is_lost_with_its_node(tmp_path: Path) -> None:
    """Host 0 ran the controller and is gone; the successor (node 2) planned rank 1 onto host 0's spare before
    host 0 was declared lost. Declaring it lost must void that plan (``_joining`` sees a lost member), not leave
    the migration waiting ``rebuild_timeout_s`` for a process that no longer exists."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=10))
    spec = JobSpec(world_size=6, nnodes=3, nproc_per_node=2, spares_per_node=1, run_id="t", command=["train.py"])
    controller = Controller(store, spec, tmp_path, TorchPassConfig(), lambda line: None, lambda node, order: None, "127.0.0.1:0", node=2)
    for node in range(3):
        for i in (0, 1):
            controller._on_report(Report("spawned", f"n{node}-a{i}", node, 2 * node + i, detail={"pid": 1, "role": "active"}))
        controller._on_report(Report("spawned", f"n{node}-s0", node, None, detail={"pid": 1, "role": "spare"}))
        controller._on_report(Report("spare_ready", f"n{node}-s0", node))
    controller.members = {r: f"n{r // 2}-a{r % 2}" for r in range(6)}
    controller.migration = _Migration(generation=1, cause="kill", classification="qualifying", t_fault=0.0, t_detect=0.0, failed={0, 1, 4})
    # What _adopt_plan leaves behind: the spares it gave ranks are sticky and out of the pool.
    controller.sticky = {1: "n0-s0", 4: "n2-s0"}
    for wid in controller.sticky.values():
        del controller.spares[wid]
    clock = ManualClock(100.0)
    controller._beats = BeatWatch(clock)
    for node in (0, 1):
        store.set(Keys.node_beat(node), "7")

    controller._check_nodes()
    assert controller.nodes_lost == set()
    clock.now += controller.config.heartbeat_timeout_s + 1
    store.set(Keys.node_beat(1), "8")  # node 1 keeps beating; node 0 does not
    controller._last_node_scan = 0.0
    controller._check_nodes()

    assert controller.nodes_lost == {0}
    assert "n0-s0" in controller.lost_wids, "the spare planned for rank 1 was left for the plan to wait on"
    assert controller.records["n0-s0"].role == "lost"
    assert "n2-s0" not in controller.lost_wids and "n1-s0" in controller.spares
