"""The plan carries the members' placement: every rank not on the node that launched it (``Plan.moved``)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from torchpass.core.config import TorchPassConfig
from torchpass.core.control import Report
from torchpass.core.controller import Controller, JobSpec
from torchpass.core.topology import Placement, assign_buddies


def test_moved_names_the_members_off_their_launch_node(tmp_path: Path) -> None:
    """Two nodes of two ranks: rank 0 went to node 1's spare, rank 3 to node 0's; rank 1's spare was on its own node."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=10))
    spec = JobSpec(world_size=4, nnodes=2, nproc_per_node=2, spares_per_node=2, run_id="t", command=["train.py"])
    controller = Controller(store, spec, tmp_path, TorchPassConfig(), lambda line: None, lambda node, order: None, "127.0.0.1:0")
    for node in (0, 1):
        for i in (0, 1):
            controller._on_report(Report("spawned", f"n{node}-a{i}", node, 2 * node + i, detail={"pid": 1, "role": "active"}))
            controller._on_report(Report("spawned", f"n{node}-s{i}", node, None, detail={"pid": 1, "role": "spare"}))
    members = {0: "n1-s0", 1: "n0-s1", 2: "n1-a0", 3: "n0-s0"}
    moved = controller._moved(members)
    assert moved == {"0": 1, "3": 0}
    # What a member computes from it is the placement the processes have.
    placement = Placement.contiguous(4, 2, {int(r): n for r, n in moved.items()})
    assert placement.node_of == {0: 1, 1: 0, 2: 1, 3: 0}
    assert all(placement.node_of[b] != placement.node_of[r] for r, b in assign_buddies(placement).items())
