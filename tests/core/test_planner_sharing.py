"""Planning a large data-parallel job: state classes with the same replica sets share one source search."""

from __future__ import annotations

from torchpass.core.control import Plan, Status
from torchpass.core.planner import MirrorInfo, PlanInput, SpareInfo, plan_migration
from torchpass.core.topology import ddp_layout, megatron_layout


def _input(layout, lost: int, per_node: int = 8) -> PlanInput:
    members = {r: f"n{r // per_node}-w{r % per_node}" for r in range(layout.world_size)}
    statuses = {r: Status(r, members[r], 7, True, 8, ["127.0.0.1", 20000 + r]) for r in members if r != lost}
    node_of = {w: r // per_node for r, w in members.items()} | {"n0-s0": 0}
    return PlanInput(
        layout=layout,
        generation=1,
        members=members,
        statuses=statuses,
        lost={lost},
        draining=set(),
        spares=[SpareInfo("n0-s0", 0)],
        node_of=node_of,
        mirrors={lost: MirrorInfo({7: "d"})},
        cause="kill",
    )


def test_ddp_classes_get_equal_but_separate_source_lists() -> None:
    plan = plan_migration(_input(ddp_layout(1024), lost=517))
    assert isinstance(plan, Plan)
    fetch = plan.rank_plan(517).fetch
    assert len(fetch) >= 2
    lists = list(fetch.values())
    assert all(sources == lists[0] for sources in lists)
    assert len({id(sources) for sources in lists}) == len(lists)  # no aliasing between classes in the plan
    assert all(r != 517 and copy == "live" for r, copy in lists[0])
    assert plan.joins == {"517": "n0-s0"}


def test_classes_with_different_replica_sets_keep_their_own_sources() -> None:
    # Megatron with the distributed optimizer: parameters are replicated along dp, optimizer state is sharded,
    # so without buddy copies the lost rank's optimizer state has no source and planning says so.
    layout = megatron_layout(tp=2, pp=1, dp=4, distributed_optimizer=True)
    result = plan_migration(_input(layout, lost=3))
    assert not isinstance(result, Plan)
    assert "rank 3" in result.message
