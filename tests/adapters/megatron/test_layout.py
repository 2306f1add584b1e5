"""The layout read from megatron-core's ``parallel_state`` matches megatron-core's own ``RankGenerator``.

Each case initializes the real ``parallel_state`` once per rank of an 8-rank
world in this process, over torch's fake process-group backend (groups are
created, nothing is communicated), reads the layout the adapter builds, and
compares every group family with ``RankGenerator``'s.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.parallel_state import RankGenerator
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchpass.adapters.megatron.layout import LayoutMismatch, layout_from_parallel_state
from torchpass.core.topology import Layout

WORLD = 8


def _groups(groups: list[list[int]]) -> list[list[int]]:
    """A partition of the ranks, normalized (each group once, sorted)."""
    return sorted(list(g) for g in {tuple(sorted(g)) for g in groups})


def _layout_as_rank(rank: int, order: str, read_order: str | None = None, **sizes: int) -> Layout:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=sizes.get("tp", 1),
            pipeline_model_parallel_size=sizes.get("pp", 1),
            context_parallel_size=sizes.get("cp", 1),
            expert_model_parallel_size=sizes.get("ep", 1),
            num_distributed_optimizer_instances=sizes.get("instances", 1),
            order=order,
            create_gloo_process_groups=False,
        )
        return layout_from_parallel_state(order=read_order or order)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


CASES = [
    ("tp-cp-ep-dp-pp", {"tp": 2, "pp": 2}),
    ("tp-cp-ep-pp-dp", {"tp": 2, "pp": 2}),
    ("tp-cp-ep-dp-pp", {"tp": 2, "cp": 2}),
    ("tp-cp-ep-dp-pp", {"cp": 2, "pp": 2}),
    ("tp-cp-ep-pp-dp", {"pp": 4}),
    ("tp-cp-ep-dp-pp", {"pp": 2, "ep": 2}),
    ("tp-cp-ep-dp-pp", {"tp": 2, "ep": 2}),
    ("tp-cp-ep-dp-pp", {"cp": 2, "instances": 2}),
    ("tp-cp-ep-dp-pp", {"tp": 2, "instances": 2}),
]


@pytest.fixture(autouse=True)
def _no_leftover_state() -> Iterator[None]:
    yield
    assert not dist.is_initialized() and not ps.model_parallel_is_initialized()


@pytest.mark.parametrize(("order", "sizes"), CASES, ids=[f"{o}:{s}" for o, s in CASES])
def test_layout_matches_rank_generator(order: str, sizes: dict[str, int]) -> None:
    tp, cp, ep, pp = (sizes.get(k, 1) for k in ("tp", "cp", "ep", "pp"))
    dp = WORLD // (tp * cp * pp)
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=tp, ep=ep, dp=WORLD // (tp * ep * pp), pp=pp, cp=1, order=order)
    layouts = [_layout_as_rank(rank, order, **sizes) for rank in range(WORLD)]
    layout = layouts[0]
    assert all(other == layout for other in layouts)
    grid = layout.grid("dense")
    families = [("tp", ["tp"]), ("pp", ["pp"]), ("tp-pp", ["tp", "pp"])]
    if "cp" in (d.name for d in grid.dims):  # optimizer instances fold cp and dp into instance blocks
        families.append(("cp", ["cp"]))
    for token, along in families:
        assert _groups(grid.groups(along)) == _groups(dense.get_ranks(token)), token
    # Replicas: the ranks with the same model-parallel coordinates (the dp-cp group).
    replica_sets = _groups([layout.replica_set(r, "params") for r in range(WORLD)])
    assert replica_sets == _groups(dense.get_ranks("dp-cp"))
    if ep > 1:
        assert _groups([layout.replica_set(r, "expert_params") for r in range(WORLD)]) == _groups(expert.get_ranks("dp"))
        assert _groups(layout.grid("expert").groups(["ep"])) == _groups(expert.get_ranks("ep"))


def test_distributed_optimizer_shards_are_sharded_state_unless_instances_replicate_them() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=WORLD)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=2, num_distributed_optimizer_instances=2, create_gloo_process_groups=False)
        single = layout_from_parallel_state(distributed_optimizer=True)
        assert layout_from_parallel_state().replica_set(3, "optimizer") == single.replica_set(3, "params")
        # dp=4 in two instances of 2: a shard's copies are the same position in the other instance.
        assert single.replica_set(3, "optimizer") == [3, 7]
        assert single.replica_set(3, "params") == [1, 3, 5, 7]
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def test_a_wrong_order_is_an_error_not_a_wrong_replica() -> None:
    with pytest.raises(LayoutMismatch, match=r"pipeline-parallel group is \[1, 3\], but order 'tp-cp-ep-dp-pp' .* gives \[1, 5\]"):
        _layout_as_rank(1, "tp-cp-ep-pp-dp", read_order="tp-cp-ep-dp-pp", tp=2, pp=2)
