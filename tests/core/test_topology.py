"""The parallel-layout model, checked against each framework's own rank-group code."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
from pathlib import Path
from typing import List

import pytest

from torchpass.core.topology import (
    Dim,
    Grid,
    Layout,
    Placement,
    StateClass,
    assign_buddies,
    ddp_layout,
    deepspeed_layout,
    layout_from_dict,
    layout_to_dict,
    megatron_layout,
    torchtitan_layout,
)


def grid(name, **dims) -> Grid:
    return Grid(name, tuple(Dim(n, s) for n, s in dims.items()))


def as_sets(groups) -> set[frozenset[int]]:
    return {frozenset(g) for g in groups}


def replica_sets(layout: Layout, state_class: str) -> set[frozenset[int]]:
    return {frozenset(layout.replica_set(r, state_class)) for r in range(layout.world_size)}


def singletons(world: int) -> set[frozenset[int]]:
    return {frozenset([r]) for r in range(world)}


# ---- Grid ------------------------------------------------------------------------


def test_grid_is_row_major_with_the_last_dimension_fastest():
    g = grid("g", a=2, b=3, c=4)
    assert g.size == 24
    assert g.coords(0) == {"a": 0, "b": 0, "c": 0}
    assert g.coords(1) == {"a": 0, "b": 0, "c": 1}
    assert g.coords(4) == {"a": 0, "b": 1, "c": 0}
    assert g.coords(23) == {"a": 1, "b": 2, "c": 3}
    assert list(g.coords(13)) == ["a", "b", "c"]  # outermost first


def test_coords_and_rank_of_round_trip():
    g = grid("g", pp=2, dp=3, tp=2)
    for rank in range(g.size):
        assert g.rank_of(g.coords(rank)) == rank
    for point in itertools.product(range(2), range(3), range(2)):
        coords = dict(zip(("pp", "dp", "tp"), point))
        assert g.coords(g.rank_of(coords)) == coords


def test_rank_of_treats_missing_coordinates_as_zero():
    g = grid("g", pp=2, dp=3)
    assert g.rank_of({"dp": 2}) == 2
    assert g.rank_of({}) == 0


def test_group_varies_only_the_named_dimensions():
    g = grid("g", pp=2, dp=3, tp=2)
    assert g.group(0, ["dp"]) == [0, 2, 4]
    assert g.group(7, ["dp"]) == [7, 9, 11]
    assert g.group(7, ["tp"]) == [6, 7]
    assert g.group(7, ["pp"]) == [1, 7]
    assert g.group(7, []) == [7]
    assert g.group(7, ["pp", "dp", "tp"]) == list(range(12))


@pytest.mark.parametrize("along", [[], ["a"], ["b"], ["c"], ["a", "c"], ["b", "c"], ["a", "b", "c"]])
def test_groups_partition_all_ranks(along):
    g = grid("g", a=2, b=3, c=2)
    groups = g.groups(along)
    flat = [r for grp in groups for r in grp]
    assert sorted(flat) == list(range(g.size))  # disjoint and covering
    size = 1
    for name in along:
        size *= g.dim(name).size
    assert all(len(grp) == size for grp in groups)
    assert [grp[0] for grp in groups] == sorted(grp[0] for grp in groups)
    for grp in groups:
        for r in grp:
            assert g.group(r, along) == grp


def test_grid_errors():
    with pytest.raises(ValueError, match="size 0"):
        Dim("dp", 0)
    with pytest.raises(ValueError, match="repeats a dimension"):
        Grid("g", (Dim("dp", 2), Dim("dp", 2)))
    g = grid("g", dp=2, tp=2)
    with pytest.raises(ValueError, match="rank 4 is outside grid 'g' of 4 ranks"):
        g.coords(4)
    with pytest.raises(ValueError, match="rank -1"):
        g.coords(-1)
    with pytest.raises(ValueError, match=r"tp=2 is outside \[0, 2\)"):
        g.rank_of({"tp": 2})
    with pytest.raises(KeyError, match="no dimension 'pp'"):
        g.dim("pp")
    with pytest.raises(KeyError, match="no dimension 'pp'"):
        g.group(0, ["pp"])


# ---- Layout ----------------------------------------------------------------------


def test_layout_errors():
    with pytest.raises(ValueError, match="at least one grid"):
        Layout("x", ())
    with pytest.raises(ValueError, match="same ranks"):
        Layout("x", (grid("a", dp=4), grid("b", dp=2)))
    with pytest.raises(KeyError, match="no grid 'nope'"):
        Layout("x", (grid("a", dp=4),), {"params": StateClass("nope", ())})
    with pytest.raises(KeyError, match="no dimension 'tp'"):
        Layout("x", (grid("a", dp=4),), {"params": StateClass("a", ("tp",))})
    with pytest.raises(KeyError, match="no state class 'expert_params'"):
        ddp_layout(2).replica_set(0, "expert_params")


def test_sharded_classes_and_describe():
    layout = deepspeed_layout(data=4, zero_stage=1)
    assert layout.sharded_classes() == ["optimizer"]
    assert "optimizer: identical along nothing (sharded)" in layout.describe()
    assert "params: identical along data (derived)" in layout.describe()
    assert ddp_layout(3).sharded_classes() == []


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_1_and_2_parameters_are_derived(stage):
    """ZeRO 1/2 re-gather their low-precision parameters from the master partitions: the protocol never moves them."""
    layout = deepspeed_layout(data=4, expert_parallel=2, zero_stage=stage)
    derived = ["expert_params", "params"] if stage in (1, 2) else []
    assert layout.derived_classes() == derived
    assert layout.copied_classes() == sorted(set(layout.state_classes) - set(derived))
    assert ddp_layout(4).derived_classes() == []
    assert ddp_layout(1).sharded_classes() == ["global", "optimizer", "params"]


def test_locate_omits_size_one_dimensions_and_prefixes_secondary_grids():
    layout = deepspeed_layout(pipe=2, data=4, model=2, expert_parallel=2)
    # rank 13: pipe=1, data=(13 % 8) // 2 = 2, model=1; expert grid: expert_data=1, expert=0
    assert layout.locate(13) == "pipe=1 data=2 model=1 expert.pipe=1 expert.expert_data=1 expert.expert=0 expert.model=1"
    assert megatron_layout(tp=2, dp=2).locate(3) == "dp=1 tp=1"
    assert ddp_layout(1).locate(0) == "(single rank)"


@pytest.mark.parametrize(
    "layout",
    [
        ddp_layout(4),
        deepspeed_layout(pipe=2, data=4, model=2, zero_stage=3, mics_shard_size=2, expert_parallel=2),
        deepspeed_layout(data=4, zero_stage=2),
        megatron_layout(tp=2, cp=2, ep=2, dp=2, pp=2, distributed_optimizer=True, num_distributed_optimizer_instances=2),
        torchtitan_layout(pp=2, dp_replicate=2, dp_shard=2, tp=2),
    ],
    ids=["ddp", "deepspeed", "deepspeed-zero2", "megatron", "torchtitan"],
)
def test_layout_dict_round_trip(layout):
    data = layout_to_dict(layout)
    again = layout_from_dict(json.loads(json.dumps(data)))
    assert again == layout
    assert layout_to_dict(again) == data
    for cls in layout.state_classes:
        assert replica_sets(again, cls) == replica_sets(layout, cls)


# ---- DDP ---------------------------------------------------------------------------


def test_ddp_every_rank_is_a_replica():
    layout = ddp_layout(4)
    assert layout.world_size == 4
    for cls in ("params", "optimizer", "global"):
        assert replica_sets(layout, cls) == {frozenset(range(4))}


# ---- DeepSpeed ---------------------------------------------------------------------

DS_SHAPES = [(1, 4, 1), (2, 2, 2), (2, 3, 2), (4, 2, 1), (1, 2, 4), (3, 4, 2)]  # (pipe, data, model)


@pytest.fixture(scope="module")
def ds_topology():
    return pytest.importorskip("deepspeed.runtime.pipe.topology").PipeModelDataParallelTopology


@pytest.mark.parametrize(("pipe", "data", "model"), DS_SHAPES)
def test_deepspeed_grid_matches_pipe_model_data_parallel_topology(ds_topology, pipe, data, model):
    topo = ds_topology(num_pp=pipe, num_mp=model, num_dp=data)
    layout = deepspeed_layout(pipe=pipe, data=data, model=model)
    main = layout.grid("main")
    assert layout.world_size == topo.world_size()
    for axis in ("data", "pipe", "model"):
        assert as_sets(main.groups([axis])) == as_sets(topo.get_axis_comm_lists(axis)), axis
    for rank in range(layout.world_size):
        c = topo.get_coord(rank)
        assert main.coords(rank) == {"pipe": c.pipe, "data": c.data, "model": c.model}


@pytest.mark.parametrize(("pipe", "data", "model"), [(1, 4, 1), (2, 4, 2), (3, 4, 2), (1, 8, 1)])
def test_deepspeed_mics_grid_still_matches_the_data_axis(ds_topology, pipe, data, model):
    topo = ds_topology(num_pp=pipe, num_mp=model, num_dp=data)
    main = deepspeed_layout(pipe=pipe, data=data, model=model, zero_stage=3, mics_shard_size=2).grid("main")
    assert as_sets(main.groups(["data_replica", "data_shard"])) == as_sets(topo.get_axis_comm_lists("data"))


@pytest.mark.parametrize(("pipe", "data", "model"), [(1, 4, 1), (2, 2, 2), (2, 3, 2)])
def test_deepspeed_zero_stages(ds_topology, pipe, data, model):
    world = pipe * data * model
    data_groups = as_sets(ds_topology(num_pp=pipe, num_mp=model, num_dp=data).get_axis_comm_lists("data"))
    expected = {  # stage -> (params replica sets, optimizer replica sets)
        0: (data_groups, data_groups),
        1: (data_groups, singletons(world)),
        2: (data_groups, singletons(world)),
        3: (singletons(world), singletons(world)),
    }
    for stage, (params, optimizer) in expected.items():
        layout = deepspeed_layout(pipe=pipe, data=data, model=model, zero_stage=stage)
        assert replica_sets(layout, "params") == params, stage
        assert replica_sets(layout, "optimizer") == optimizer, stage
        assert replica_sets(layout, "global") == {frozenset(range(world))}


def test_deepspeed_mics_shards_are_identical_across_replicate_groups():
    """MiCS: shard groups are runs of ``mics_shard_size`` consecutive data ranks; the
    i-th shard of every shard group holds the same partition."""
    pipe, data, model, shard = 2, 8, 2, 2
    layout = deepspeed_layout(pipe=pipe, data=data, model=model, zero_stage=3, mics_shard_size=shard)
    main = layout.grid("main")
    expected = set()
    for p, m, s in itertools.product(range(pipe), range(model), range(shard)):
        data_ranks = [main.rank_of({"pipe": p, "data_replica": d // shard, "data_shard": d % shard, "model": m}) for d in range(data)]
        # data rank d of this (pipe, model) slice: consecutive shard groups data_ranks[k*shard:(k+1)*shard]
        expected.add(frozenset(data_ranks[s::shard]))
    assert replica_sets(layout, "params") == expected
    assert replica_sets(layout, "optimizer") == expected
    assert all(len(group) == data // shard for group in expected)
    # the data rank index is data_replica * shard + data_shard, as DeepSpeed numbers data ranks
    for rank in range(layout.world_size):
        c = main.coords(rank)
        assert (rank // model) % data == c["data_replica"] * shard + c["data_shard"]


def test_deepspeed_mics_shard_size_covering_all_data_is_plain_zero3():
    assert deepspeed_layout(data=4, zero_stage=3, mics_shard_size=4) == deepspeed_layout(data=4, zero_stage=3)


@pytest.mark.parametrize(("pipe", "data", "model", "ep"), [(1, 4, 1, 2), (1, 8, 2, 4), (2, 4, 2, 2), (2, 6, 1, 3)])
def test_deepspeed_expert_grid_matches_deepspeed_expert_groups(pipe, data, model, ep):
    groups = pytest.importorskip("deepspeed.utils.groups")
    world = pipe * data * model
    ep_groups, edp_groups = groups._get_expert_parallel_ranks(world, model, ep, pipe)
    layout = deepspeed_layout(pipe=pipe, data=data, model=model, expert_parallel=ep)
    expert = layout.grid("expert")
    assert as_sets(expert.groups(["expert"])) == as_sets(ep_groups)
    assert as_sets(expert.groups(["expert_data"])) == as_sets(edp_groups)
    assert replica_sets(layout, "expert_params") == as_sets(edp_groups)
    zero3 = deepspeed_layout(pipe=pipe, data=data, model=model, expert_parallel=ep, zero_stage=3)
    assert replica_sets(zero3, "expert_params") == singletons(world)


def test_deepspeed_errors():
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3, got 4"):
        deepspeed_layout(data=2, zero_stage=4)
    with pytest.raises(ValueError, match=r"expert_parallel \(3\) must divide the data-parallel size \(4\)"):
        deepspeed_layout(data=4, expert_parallel=3)
    with pytest.raises(ValueError, match=r"mics_shard_size \(3\) must divide the data-parallel size \(4\)"):
        deepspeed_layout(data=4, zero_stage=3, mics_shard_size=3)
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        deepspeed_layout(data=0)


# ---- Megatron ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rank_generator():
    """megatron-core's own ``RankGenerator`` and the function behind it, executed unchanged.

    They are pure Python; importing ``megatron.core`` itself costs ~5 s of CPU
    (its package ``__init__`` pulls in models and optimizers), so the two
    definitions are taken from the installed ``parallel_state.py`` source.
    """
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed")
    source = (Path(list(spec.submodule_search_locations)[0]) / "parallel_state.py").read_text()
    wanted = {"generate_masked_orthogonal_rank_groups", "RankGenerator"}
    nodes = [n for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in wanted]
    assert {n.name for n in nodes} == wanted
    namespace: dict = {"List": List}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "megatron/core/parallel_state.py", "exec"), namespace)
    return namespace["RankGenerator"]


def megatron_dims(token: str, cp: int, instances: int) -> list[str] | None:
    """Layout dimensions of the dense grid for a Megatron token; None when not expressible."""
    out: list[str] = []
    for t in token.split("-"):
        if instances > 1 and t == "dp":
            if cp > 1 and "cp" not in token:
                return None  # dp alone is merged with cp into the instance dims
            out += ["dp_in_instance", "dp_instance"]
        elif instances > 1 and t == "cp" and cp > 1:
            if "dp" not in token:
                return None
        else:
            out.append(t)
    return sorted(set(out))


MEGATRON_CASES = [
    # tp, cp, dp, pp, order, instances
    (2, 1, 2, 2, "tp-cp-ep-dp-pp", 1),
    (2, 2, 2, 2, "tp-cp-ep-dp-pp", 1),
    (1, 2, 3, 2, "tp-cp-ep-dp-pp", 1),
    (2, 1, 3, 2, "tp-pp-dp", 1),
    (2, 1, 2, 3, "tp-dp-pp", 1),
    (4, 1, 2, 1, "tp-dp-pp", 1),
    (2, 1, 4, 2, "tp-cp-ep-dp-pp", 2),
    (2, 2, 2, 2, "tp-cp-ep-dp-pp", 2),
    (1, 2, 4, 1, "tp-cp-ep-dp-pp", 4),
    (2, 1, 4, 2, "tp-pp-dp", 2),
    (1, 1, 6, 2, "tp-dp-pp", 3),
    (2, 2, 2, 2, "tp-dp-cp-pp", 2),  # dp before cp: the dp-cp index has dp fastest
]


@pytest.mark.parametrize(("tp", "cp", "dp", "pp", "order", "instances"), MEGATRON_CASES)
def test_megatron_dense_grid_matches_rank_generator(rank_generator, tp, cp, dp, pp, order, instances):
    gen = rank_generator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    layout = megatron_layout(tp=tp, cp=cp, dp=dp, pp=pp, order=order, num_distributed_optimizer_instances=instances)
    dense = layout.grid("dense")
    assert layout.world_size == gen.world_size
    checked = 0
    for token in ("tp", "dp", "pp", "cp", "dp-cp", "tp-pp"):
        dims = megatron_dims(token, cp, instances)
        if dims is None:
            continue
        assert as_sets(dense.groups(dims)) == as_sets(gen.get_ranks(token)), token
        checked += 1
    assert checked >= 4


@pytest.mark.parametrize(
    ("tp", "ep", "etp", "dp", "pp", "order"),
    [
        (2, 2, 2, 2, 2, "tp-cp-ep-dp-pp"),
        (2, 4, 1, 4, 1, "tp-cp-ep-dp-pp"),
        (2, 2, 1, 2, 2, "tp-cp-ep-pp-dp"),
        (1, 2, 2, 4, 2, "tp-ep-dp-pp"),
        (2, 1, 1, 2, 2, "tp-cp-ep-dp-pp"),  # expert_tp != tp alone makes an expert grid
    ],
)
def test_megatron_expert_grid_matches_rank_generator(rank_generator, tp, ep, etp, dp, pp, order):
    layout = megatron_layout(tp=tp, ep=ep, dp=dp, pp=pp, order=order, expert_tp=etp)
    world = tp * dp * pp
    edp = world // (etp * ep * pp)
    gen = rank_generator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    expert = layout.grid("expert")
    assert expert.size == world
    for token in ("ep", "tp", "dp", "pp", "tp-ep"):
        assert as_sets(expert.groups(token.split("-"))) == as_sets(gen.get_ranks(token)), token
    assert replica_sets(layout, "expert_params") == as_sets(gen.get_ranks("dp"))
    assert replica_sets(layout, "expert_optimizer") == as_sets(gen.get_ranks("dp"))
    distopt = megatron_layout(tp=tp, ep=ep, dp=dp, pp=pp, order=order, expert_tp=etp, distributed_optimizer=True)
    assert replica_sets(distopt, "expert_optimizer") == singletons(world)


def test_megatron_without_experts_has_one_grid():
    layout = megatron_layout(tp=2, dp=2, pp=2)
    assert [g.name for g in layout.grids] == ["dense"]
    assert "expert_params" not in layout.state_classes


@pytest.mark.parametrize(("tp", "cp", "dp", "pp", "order"), [(2, 2, 2, 2, "tp-cp-ep-dp-pp"), (2, 1, 3, 2, "tp-pp-dp")])
def test_megatron_params_and_optimizer_replicas_without_distributed_optimizer(rank_generator, tp, cp, dp, pp, order):
    gen = rank_generator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    layout = megatron_layout(tp=tp, cp=cp, dp=dp, pp=pp, order=order)
    assert replica_sets(layout, "params") == as_sets(gen.get_ranks("dp-cp"))
    assert replica_sets(layout, "optimizer") == as_sets(gen.get_ranks("dp-cp"))


@pytest.mark.parametrize(("tp", "cp", "dp", "pp", "order"), [(2, 2, 2, 2, "tp-cp-ep-dp-pp"), (2, 1, 3, 2, "tp-pp-dp")])
def test_megatron_distributed_optimizer_one_instance_is_sharded(rank_generator, tp, cp, dp, pp, order):
    gen = rank_generator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    layout = megatron_layout(tp=tp, cp=cp, dp=dp, pp=pp, order=order, distributed_optimizer=True)
    assert replica_sets(layout, "params") == as_sets(gen.get_ranks("dp-cp"))
    assert replica_sets(layout, "optimizer") == singletons(layout.world_size)
    assert "optimizer" in layout.sharded_classes()


@pytest.mark.parametrize(
    ("tp", "cp", "dp", "pp", "order", "instances"),
    [
        (2, 1, 4, 2, "tp-cp-ep-dp-pp", 2),
        (2, 2, 2, 2, "tp-cp-ep-dp-pp", 2),
        (1, 2, 4, 1, "tp-cp-ep-dp-pp", 4),
        (2, 1, 4, 2, "tp-pp-dp", 2),
        (1, 2, 3, 2, "tp-dp-cp-pp", 2),
    ],
)
def test_megatron_distributed_optimizer_instances(rank_generator, tp, cp, dp, pp, order, instances):
    """megatron-core splits each ``dp-cp`` group into ``instances`` contiguous blocks
    (one optimizer instance each); the i-th rank of every block holds the same shard."""
    gen = rank_generator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    block = dp * cp // instances
    intra, inter = set(), set()
    for ranks in gen.get_ranks("dp-cp"):
        blocks = [ranks[i * block : (i + 1) * block] for i in range(instances)]
        intra |= as_sets(blocks)
        inter |= as_sets(zip(*blocks))
    layout = megatron_layout(
        tp=tp, cp=cp, dp=dp, pp=pp, order=order, distributed_optimizer=True, num_distributed_optimizer_instances=instances
    )
    dense = layout.grid("dense")
    assert as_sets(dense.groups(["dp_in_instance"])) == intra
    assert as_sets(dense.groups(["dp_instance"])) == inter
    assert replica_sets(layout, "optimizer") == inter
    assert replica_sets(layout, "params") == as_sets(gen.get_ranks("dp-cp"))


def test_megatron_errors():
    with pytest.raises(ValueError, match=r"num_distributed_optimizer_instances \(3\) must divide dp\*cp \(4\)"):
        megatron_layout(dp=4, num_distributed_optimizer_instances=3)
    with pytest.raises(ValueError, match="cp next to dp"):
        megatron_layout(cp=2, dp=2, pp=2, order="tp-cp-pp-dp", num_distributed_optimizer_instances=2)
    with pytest.raises(ValueError, match="not divisible by expert_tp\\*ep\\*pp"):
        megatron_layout(tp=1, ep=3, dp=4, pp=1)
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        megatron_layout(tp=0, dp=2)


# ---- TorchTitan -------------------------------------------------------------------

TITAN_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def device_mesh_groups(shape: tuple[int, ...], rank: int) -> tuple[list, dict[str, list[int]]]:
    """The DeviceMesh of ``shape`` (TorchTitan's dimension names) as ``rank`` sees it,
    built on a fake process group: no communication, any world size in one process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = 1
    for s in shape:
        world *= s
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=TITAN_NAMES)
        groups = {n: dist.get_process_group_ranks(mesh.get_group(n)) for n in TITAN_NAMES}
        groups["fsdp"] = dist.get_process_group_ranks(mesh["dp_shard", "cp"]._flatten("fsdp").get_group())
        return mesh.mesh.tolist(), groups
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shape", [(2, 2, 2, 1, 2), (1, 2, 3, 1, 1), (2, 1, 2, 2, 1), (1, 1, 4, 1, 2)])
def test_torchtitan_layout_matches_device_mesh(shape):
    pp, rep, shard, cp, tp = shape
    layout = torchtitan_layout(pp=pp, dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp)
    world = layout.grid("world")
    assert [(d.name, d.size) for d in world.dims] == list(zip(TITAN_NAMES, shape))
    for rank in sorted({0, 1, layout.world_size // 2 + 1, layout.world_size - 1}):
        mesh, groups = device_mesh_groups(shape, rank)
        flat = [r for r in _flatten(mesh)]
        assert flat == list(range(layout.world_size))  # the mesh is row-major, as the grid
        for name in TITAN_NAMES:
            assert world.group(rank, [name]) == sorted(groups[name]), name
        assert world.group(rank, ["dp_shard", "cp"]) == sorted(groups["fsdp"])
        # FSDP shards over dp_shard x cp, TP over tp: only HSDP's replicate dim holds copies
        assert layout.replica_set(rank, "params") == sorted(groups["dp_replicate"])
        assert layout.replica_set(rank, "optimizer") == sorted(groups["dp_replicate"])


def _flatten(nested):
    for item in nested:
        if isinstance(item, list):
            yield from _flatten(item)
        else:
            yield item


def test_torchtitan_replica_sets():
    hsdp = torchtitan_layout(dp_replicate=2, dp_shard=4)
    assert replica_sets(hsdp, "params") == {frozenset({r, r + 4}) for r in range(4)}
    fsdp = torchtitan_layout(dp_shard=8)
    assert replica_sets(fsdp, "params") == singletons(8)
    assert replica_sets(fsdp, "optimizer") == singletons(8)
    ddp = torchtitan_layout(dp_replicate=4)
    assert replica_sets(ddp, "params") == {frozenset(range(4))}
    tp_only = torchtitan_layout(tp=4)
    assert replica_sets(tp_only, "params") == singletons(4)
    hsdp_tp = torchtitan_layout(pp=2, dp_replicate=2, dp_shard=2, tp=2)
    assert hsdp_tp.replica_set(5, "params") == [1, 5]
    assert replica_sets(hsdp_tp, "global") == {frozenset(range(16))}


def test_torchtitan_errors():
    with pytest.raises(ValueError, match="'dp_shard' has size 0"):
        torchtitan_layout(dp_shard=0)


# ---- buddies ---------------------------------------------------------------------


def test_assign_buddies_puts_every_buddy_on_another_node():
    for nnodes, per_node in [(2, 4), (3, 2), (4, 1), (2, 1)]:
        placement = Placement.contiguous(nnodes * per_node, per_node)
        buddies = assign_buddies(placement)
        assert sorted(buddies) == list(range(nnodes * per_node))
        for rank, buddy in buddies.items():
            assert placement.node_of[buddy] != placement.node_of[rank]
        # every rank keeps exactly one buddy copy
        assert sorted(buddies.values()) == list(range(nnodes * per_node))


def test_assign_buddies_on_one_node_is_a_ring():
    placement = Placement.contiguous(4, 4)
    assert assign_buddies(placement) == {0: 1, 1: 2, 2: 3, 3: 0}
    assert assign_buddies(Placement.contiguous(1, 1)) == {0: 0}


def test_assign_buddies_follows_a_non_contiguous_placement():
    # After a migration rank 1 lives on node 2: its buddy is still on another node.
    placement = Placement({0: 0, 1: 2, 2: 1, 3: 1})
    buddies = assign_buddies(placement)
    for rank, buddy in buddies.items():
        assert placement.node_of[buddy] != placement.node_of[rank]


def test_placement_helpers():
    placement = Placement.contiguous(6, 2)
    assert placement.nodes() == [0, 1, 2]
    assert placement.ranks_on(1) == [2, 3]
    assert placement.node_of[5] == 2
