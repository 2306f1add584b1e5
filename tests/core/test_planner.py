"""Migration planning as a pure function: hand-built controller observations in, a Plan (or why not) out."""

from __future__ import annotations

import json


from torchpass.core.control import Plan, Status, _from_json, _to_json
from torchpass.core.planner import Disqualified, MirrorInfo, PlanInput, SpareInfo, plan_migration
from torchpass.core.topology import Layout, ddp_layout, deepspeed_layout

CLASSES = ["global", "optimizer", "params"]


def wid(rank: int, per_node: int = 2) -> str:
    return f"n{rank // per_node}-w{rank % per_node}"


def status(rank: int, version: int, *, clean: bool = True, draining: bool = False) -> Status:
    return Status(rank, wid(rank), version, clean, version + 1, ["127.0.0.1", 40000 + rank], draining=draining)


def plan_input(
    layout: Layout,
    *,
    versions: dict[int, int],
    lost: set[int] = frozenset(),
    draining: set[int] = frozenset(),
    dirty: set[int] = frozenset(),
    spares: dict[str, int] | None = None,
    mirrors: dict[int, dict[int, str]] | None = None,
    sticky: dict[int, str] | None = None,
    cause: str = "kill",
    per_node: int = 2,
) -> PlanInput:
    """Members ``n<node>-w<i>``, ``per_node`` to a node; ``versions`` are the survivors' reported versions."""
    members = {r: wid(r, per_node) for r in range(layout.world_size)}
    spares = {"n0-s0": 0, "n1-s0": 1} if spares is None else spares
    node_of = {w: r // per_node for r, w in members.items()} | dict(spares)
    statuses = {r: status(r, v, clean=r not in dirty, draining=r in draining) for r, v in versions.items()}
    for r, st in statuses.items():
        st.wid = members[r]
    return PlanInput(
        layout=layout,
        generation=3,
        members=members,
        statuses=statuses,
        lost=set(lost),
        draining=set(draining),
        spares=[SpareInfo(w, n) for w, n in spares.items()],
        node_of=node_of,
        mirrors={r: MirrorInfo(v) for r, v in (mirrors or {}).items()},
        sticky=dict(sticky or {}),
        cause=cause,
    )


def planned(inp: PlanInput) -> Plan:
    result = plan_migration(inp)
    assert isinstance(result, Plan), result
    return result


def source_ranks(plan: Plan, rank: int, cls: str) -> list[int]:
    """The ranks a rank copies ``cls`` from, in the planner's order (entries are [rank, copy] or bare ranks)."""
    return [s[0] if isinstance(s, (list, tuple)) else s for s in plan.rank_plan(rank).fetch[cls]]


def small_source_rank(small_from: str) -> int | None:
    """The rank named by ``small_from`` (``rank:<r>`` or ``<r>/<copy>``); None for ``self``/``mirror``."""
    if small_from in ("self", "mirror"):
        return None
    return int(small_from.removeprefix("rank:").split("/")[0])


def spare_nodes(inp: PlanInput, plan: Plan) -> dict[int, int]:
    return {int(r): inp.node_of[plan.joins[r]] for r in plan.replaced}


# ---- a lost rank with replicas ---------------------------------------------------------------


def test_lost_rank_gets_a_spare_and_fetches_from_replicas():
    inp = plan_input(ddp_layout(4), versions={0: 10, 2: 10, 3: 10}, lost={1}, mirrors={1: {9: "a", 10: "b"}})
    plan = planned(inp)
    assert plan.generation == 3
    assert plan.target_version == 10
    assert plan.replaced == {"1": "n0-w1"}
    assert plan.joins["1"] in ("n0-s0", "n1-s0")
    assert sorted(plan.joins) == ["1"]  # every other rank keeps its process
    assert plan.retire == []
    rp = plan.rank_plan(1)
    assert sorted(rp.fetch) == CLASSES
    for cls in CLASSES:
        assert sorted(source_ranks(plan, 1, cls)) == [0, 2, 3]
    assert rp.small_from == "mirror"
    for r in (0, 2, 3):
        assert plan.rank_plan(r).fetch == {}
        assert plan.rank_plan(r).small_from == "self"
    assert sorted(plan.addresses) == ["0", "2", "3"]  # a lost rank serves nothing
    assert plan.addresses["2"] == ["127.0.0.1", 40002]


def test_sources_are_ordered_nearest_first():
    # The only spare is on node 1: the spare's node-mates come first, then by rank distance.
    inp = plan_input(ddp_layout(4), versions={0: 10, 2: 10, 3: 10}, lost={1}, spares={"n1-s0": 1}, mirrors={1: {10: "b"}})
    plan = planned(inp)
    assert source_ranks(plan, 1, "params") == [2, 3, 0]
    inp = plan_input(ddp_layout(4), versions={0: 10, 2: 10, 3: 10}, lost={1}, spares={"n0-s0": 0}, mirrors={1: {10: "b"}})
    assert source_ranks(planned(inp), 1, "params") == [0, 2, 3]


def test_sources_are_capped_at_max_sources():
    layout = ddp_layout(8)
    inp = plan_input(layout, versions={r: 4 for r in range(8) if r != 5}, lost={5}, spares={"n2-s0": 2}, mirrors={5: {4: "x"}})
    inp.max_sources = 2
    assert source_ranks(planned(inp), 5, "params") == [4, 6]


def test_target_is_the_newest_clean_version():
    inp = plan_input(ddp_layout(4), versions={0: 10, 2: 9, 3: 10}, lost={1}, mirrors={1: {10: "b"}, 2: {9: "a", 10: "b"}})
    assert planned(inp).target_version == 10


def test_plan_survives_the_json_round_trip_through_the_store():
    inp = plan_input(ddp_layout(4), versions={0: 10, 2: 10, 3: 10}, lost={1}, mirrors={1: {10: "b"}})
    plan = planned(inp)
    again = _from_json(Plan, _to_json(plan))
    assert again.joins == plan.joins and again.target_version == 10
    assert again.rank_plan(1) == plan.rank_plan(1)
    assert json.loads(_to_json(again)) == json.loads(_to_json(plan))


# ---- survivors that must fetch ------------------------------------------------------------------


def test_lagging_survivor_fetches_and_keeps_its_process():
    inp = plan_input(ddp_layout(4), versions={0: 10, 1: 10, 2: 9, 3: 10}, mirrors={2: {9: "a", 10: "b"}})
    plan = planned(inp)
    assert plan.target_version == 10
    assert plan.replaced == {}
    assert "2" not in plan.joins
    assert sorted(plan.rank_plan(2).fetch) == CLASSES
    assert sorted(source_ranks(plan, 2, "params")) == [0, 1, 3]
    assert source_ranks(plan, 2, "params")[0] == 3  # same node first
    assert plan.rank_plan(2).small_from == "mirror"
    assert all(plan.rank_plan(r).fetch == {} for r in (0, 1, 3))


def test_dirty_survivor_fetches_even_at_the_target_version():
    inp = plan_input(ddp_layout(4), versions={0: 10, 1: 10, 2: 10, 3: 10}, dirty={2}, mirrors={2: {10: "b"}})
    plan = planned(inp)
    assert plan.target_version == 10
    assert plan.replaced == {}
    assert sorted(source_ranks(plan, 2, "optimizer")) == [0, 1, 3]
    assert 2 not in source_ranks(plan, 2, "optimizer")


def test_a_dirty_rank_is_never_a_source():
    inp = plan_input(ddp_layout(4), versions={0: 10, 2: 10, 3: 10}, lost={1}, dirty={0}, mirrors={0: {10: "a"}, 1: {10: "b"}})
    plan = planned(inp)
    assert sorted(source_ranks(plan, 1, "params")) == [2, 3]
    assert sorted(source_ranks(plan, 0, "params")) == [2, 3]


def test_no_clean_survivor_is_disqualifying():
    inp = plan_input(ddp_layout(2), versions={0: 3}, dirty={0}, lost={1}, mirrors={1: {3: "a"}})
    result = plan_migration(inp)
    assert isinstance(result, Disqualified)
    assert result.reason == "no_state"
    assert "no surviving rank holds a clean copy" in result.message


# ---- draining ------------------------------------------------------------------------------


def test_draining_rank_is_its_own_source_and_retires():
    layout = deepspeed_layout(data=4, zero_stage=1)  # sharded optimizer: only the rank itself has it
    inp = plan_input(layout, versions={0: 7, 1: 7, 2: 7, 3: 7}, draining={3}, cause="planned")
    plan = planned(inp)
    assert plan.target_version == 7
    assert plan.replaced == {"3": "n1-w1"}
    assert plan.retire == ["n1-w1"]
    assert plan.joins["3"] == "n1-s0"  # a planned move stays on the rank's node when it can
    for cls in plan.rank_plan(3).fetch:
        assert source_ranks(plan, 3, cls) == [3]
    assert sorted(plan.rank_plan(3).fetch) == layout.copied_classes() == ["global", "optimizer"]  # params: derived
    assert small_source_rank(plan.rank_plan(3).small_from) == 3
    assert "3" in plan.addresses  # the draining rank serves its state until it retires


# ---- spares --------------------------------------------------------------------------------


def test_whole_node_loss_takes_spares_on_other_nodes():
    # Node 1 is gone with its ranks (2, 3) and its spare; nodes 0 and 2 have spares.
    inp = plan_input(
        ddp_layout(6),
        versions={0: 5, 1: 5, 4: 5, 5: 5},
        lost={2, 3},
        spares={"n0-s0": 0, "n2-s0": 2, "n2-s1": 2},
        mirrors={2: {5: "a"}, 3: {5: "b"}},
        cause="node",
    )
    plan = planned(inp)
    nodes = spare_nodes(inp, plan)
    assert sorted(nodes) == [2, 3]
    assert 1 not in nodes.values()
    assert len({plan.joins["2"], plan.joins["3"]}) == 2
    assert plan.joins["2"] == "n2-s0"  # the node with the most spares left goes first
    for r in (2, 3):
        assert sorted(source_ranks(plan, r, "params")) == [0, 1, 4, 5]


def test_each_lost_rank_gets_a_distinct_spare():
    inp = plan_input(ddp_layout(4), versions={0: 5, 3: 5}, lost={1, 2}, mirrors={1: {5: "a"}, 2: {5: "b"}})
    plan = planned(inp)
    assert {plan.joins["1"], plan.joins["2"]} == {"n0-s0", "n1-s0"}


def test_single_process_loss_with_one_spare_per_node():
    inp = plan_input(ddp_layout(4), versions={0: 5, 1: 5, 3: 5}, lost={2}, mirrors={2: {5: "a"}})
    plan = planned(inp)
    assert plan.joins["2"] in ("n0-s0", "n1-s0")


def test_single_process_loss_prefers_a_spare_on_its_own_node():
    inp = plan_input(
        ddp_layout(4),
        versions={0: 5, 2: 5, 3: 5},
        lost={1},
        spares={"n0-s0": 0, "n1-s0": 1, "n1-s1": 1},
        mirrors={1: {5: "a"}},
        cause="kill",
    )
    plan = planned(inp)
    assert plan.joins["1"] == "n0-s0"


def test_spares_on_a_quiet_node_are_the_last_choice():
    # Rank 1's node 0 has gone quiet (its launcher missed its beats: a lost host, not yet declared):
    # its own spare is not preferred, and when one of two lost ranks must take it, the other does not.
    inp = plan_input(
        ddp_layout(6),
        versions={2: 5, 3: 5, 5: 5},
        lost={0, 1, 4},
        spares={"n0-s0": 0, "n1-s0": 1, "n1-s1": 1, "n2-s0": 2},
        mirrors={0: {5: "a"}, 1: {5: "b"}, 4: {5: "c"}},
    )
    inp.silent_nodes = frozenset({0})
    plan = planned(inp)
    assert "n0-s0" not in plan.joins.values(), plan.joins
    inp.spares = [s for s in inp.spares if s.wid != "n2-s0"]
    plan = planned(inp)
    assert sorted(plan.joins.values()) == ["n0-s0", "n1-s0", "n1-s1"]
    assert plan.joins["4"] == "n0-s0", plan.joins


def test_sticky_spare_is_reused():
    inp = plan_input(ddp_layout(4), versions={0: 5, 2: 5, 3: 5}, lost={1}, sticky={1: "n1-s0"}, mirrors={1: {5: "a"}}, cause="planned")
    assert planned(inp).joins["1"] == "n1-s0"
    inp = plan_input(
        ddp_layout(4),
        versions={0: 5, 2: 5, 3: 5},
        lost={1},
        spares={"n0-s0": 0, "n0-s1": 0, "n1-s9": 1},
        sticky={1: "n1-s9"},
        mirrors={1: {5: "a"}},
    )
    assert planned(inp).joins["1"] == "n1-s9"


def test_sticky_spare_that_is_gone_is_replaced_by_another():
    inp = plan_input(ddp_layout(4), versions={0: 5, 2: 5, 3: 5}, lost={1}, sticky={1: "n1-dead"}, spares={"n1-s0": 1}, mirrors={1: {5: "a"}})
    assert planned(inp).joins["1"] == "n1-s0"


def test_sticky_spare_of_another_rank_is_not_taken():
    inp = plan_input(
        ddp_layout(4), versions={0: 5, 3: 5}, lost={1, 2}, sticky={2: "n0-s0"}, mirrors={1: {5: "a"}, 2: {5: "b"}}
    )
    plan = planned(inp)
    assert plan.joins["2"] == "n0-s0"
    assert plan.joins["1"] == "n1-s0"


def test_no_spare_is_disqualifying_and_names_the_ranks():
    inp = plan_input(ddp_layout(4), versions={0: 5, 3: 5}, lost={1, 2}, spares={}, mirrors={1: {5: "a"}, 2: {5: "b"}})
    result = plan_migration(inp)
    assert isinstance(result, Disqualified)
    assert result.reason == "no_spare"
    assert "[1, 2]" in result.message
    assert "2 needed, 0 available" in result.message


def test_too_few_spares_names_the_rank_left_without_one():
    inp = plan_input(ddp_layout(4), versions={0: 5, 3: 5}, lost={1, 2}, spares={"n0-s0": 0}, mirrors={1: {5: "a"}, 2: {5: "b"}})
    result = plan_migration(inp)
    assert isinstance(result, Disqualified) and result.reason == "no_spare"
    assert "rank(s) [2]" in result.message
    assert "2 needed, 1 available" in result.message


# ---- state that has no surviving copy ---------------------------------------------------------


def test_sharded_state_without_a_replica_is_disqualifying():
    layout = deepspeed_layout(data=4, zero_stage=1)  # ZeRO-1: the optimizer partitions are unique
    inp = plan_input(layout, versions={0: 5, 2: 5, 3: 5}, lost={1}, mirrors={1: {5: "a"}})
    result = plan_migration(inp)
    assert isinstance(result, Disqualified)
    assert result.reason == "no_state"
    assert "rank 1" in result.message
    assert "'optimizer'" in result.message
    assert "[1]" in result.message  # the replica set: the rank alone


def test_derived_classes_are_never_fetched_even_when_every_survivor_rolls_back():
    """ZeRO-1: a fault inside the commit's all-gather leaves every survivor dirty and the lost rank's buddy
    copy one step back. Each survivor rolls back from its own snapshot and the spare reads the buddy copy,
    for the optimizer and global classes only: the parameters are re-gathered once the generation is live."""
    layout = deepspeed_layout(data=4, zero_stage=1)
    assert layout.derived_classes() == ["params"]
    inp = plan_input(layout, versions={0: 6, 1: 6, 3: 6}, lost={2}, dirty={0, 1, 3})
    for r, st in inp.statuses.items():
        st.snapshots = [4, 5]
    inp.statuses[3].holds = {"2": [4, 5]}
    plan = planned(inp)
    assert plan.target_version == 5
    for r in (0, 1, 3):
        assert plan.rank_plan(r).fetch == {"global": [[r, "snapshot"]], "optimizer": [[r, "snapshot"]]}
    assert sorted(plan.rank_plan(2).fetch) == ["global", "optimizer"]
    assert source_ranks(plan, 2, "optimizer") == [3]


def test_replicated_classes_of_a_sharded_layout_still_need_every_class():
    layout = deepspeed_layout(pipe=2, data=2, zero_stage=0)
    inp = plan_input(layout, versions={0: 5, 1: 5, 3: 5}, lost={2}, mirrors={2: {5: "a"}})
    plan = planned(inp)
    assert source_ranks(plan, 2, "params") == [3]  # the other data rank of pipe stage 1
    assert sorted(source_ranks(plan, 2, "global")) == [0, 1, 3]


def test_losing_a_whole_replica_set_is_disqualifying():
    layout = deepspeed_layout(pipe=2, data=2, zero_stage=0)  # stage 1 = ranks 2, 3
    inp = plan_input(layout, versions={0: 5, 1: 5}, lost={2, 3}, mirrors={2: {5: "a"}, 3: {5: "b"}})
    result = plan_migration(inp)
    assert isinstance(result, Disqualified) and result.reason == "no_state"
    assert "rank 2" in result.message and "'optimizer'" in result.message


# ---- small state (RNG streams, data position) ------------------------------------------------------


def test_rng_falls_back_to_a_replica_whose_mirror_digests_match():
    inp = plan_input(
        ddp_layout(4),
        versions={0: 10, 2: 10, 3: 10},
        lost={1},
        mirrors={1: {8: "a", 9: "b"}, 0: {8: "a", 9: "b", 10: "c"}},
    )
    plan = planned(inp)
    assert small_source_rank(plan.rank_plan(1).small_from) == 0


def test_rng_fallback_skips_a_replica_whose_digests_differ():
    inp = plan_input(
        ddp_layout(4),
        versions={0: 10, 2: 10, 3: 10},
        lost={1},
        mirrors={1: {9: "b"}, 0: {9: "x", 10: "c"}, 2: {9: "b", 10: "c"}},
    )
    assert small_source_rank(planned(inp).rank_plan(1).small_from) == 2


def test_no_rng_fallback_when_mirror_digests_differ():
    inp = plan_input(
        ddp_layout(4),
        versions={0: 10, 2: 10, 3: 10},
        lost={1},
        mirrors={1: {8: "a", 9: "b"}, 0: {8: "a", 9: "DIFFERENT", 10: "c"}, 2: {9: "z"}, 3: {7: "a"}},
    )
    result = plan_migration(inp)
    assert isinstance(result, Disqualified)
    assert result.reason == "no_state"
    assert "rank 1" in result.message and "RNG" in result.message
    assert "[8, 9]" in result.message  # what its mirror does hold


def test_no_mirror_at_all_is_disqualifying():
    inp = plan_input(ddp_layout(4), versions={0: 10, 2: 10, 3: 10}, lost={1})
    result = plan_migration(inp)
    assert isinstance(result, Disqualified) and result.reason == "no_state"
    assert "rank 1" in result.message and "[]" in result.message


def test_a_lost_replica_is_not_an_rng_source():
    inp = plan_input(ddp_layout(4), versions={0: 10, 3: 10}, lost={1, 2}, mirrors={1: {9: "b"}, 2: {9: "b", 10: "c"}, 3: {10: "c"}})
    result = plan_migration(inp)
    assert isinstance(result, Disqualified) and result.reason == "no_state"
