"""The parallel-layout model: which ranks hold identical state, and who keeps a buddy copy.

A job's ranks are laid out on one or more *grids*. A grid is a row-major array
of named dimensions listed outermost first, the DeviceMesh convention: the last
dimension varies fastest. Most jobs need one grid; mixture-of-experts layouts
need a second one, because Megatron and DeepSpeed fold the expert dimensions
over the same ranks differently from the dense ones.

Every class of state a rank holds (``"params"``, ``"optimizer"``,
``"expert_params"``, ...) names the grid it lives on and the dimensions along
which its copies are *bitwise identical*. Ranks that differ only along those
dimensions form the class's replica set: a lost rank's copy of that class can be
fetched from any healthy member. A class whose replica set is the rank alone is
*sharded* state: parallelism gives it no redundancy and it needs a buddy copy.

Adapters build a :class:`Layout` from the framework's own objects; the factory
functions at the bottom encode each framework's rank order and are unit-tested
against the framework's own rank-group functions where those are importable.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "Dim",
    "Grid",
    "StateClass",
    "Layout",
    "Placement",
    "assign_buddies",
    "layout_from_dict",
    "layout_to_dict",
    "ddp_layout",
    "deepspeed_layout",
    "megatron_layout",
    "torchtitan_layout",
]


@dataclass(frozen=True)
class Dim:
    """One named parallel dimension."""

    name: str
    size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"dimension {self.name!r} has size {self.size}; sizes must be >= 1")


@dataclass(frozen=True)
class Grid:
    """A row-major arrangement of all ranks over named dimensions, outermost first."""

    name: str
    dims: tuple[Dim, ...]

    def __post_init__(self) -> None:
        names = [d.name for d in self.dims]
        if len(set(names)) != len(names):
            raise ValueError(f"grid {self.name!r} repeats a dimension: {names}")

    @property
    def size(self) -> int:
        return math.prod(d.size for d in self.dims)

    def dim(self, name: str) -> Dim:
        for d in self.dims:
            if d.name == name:
                return d
        raise KeyError(f"grid {self.name!r} has no dimension {name!r}; it has {[d.name for d in self.dims]}")

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside grid {self.name!r} of {self.size} ranks")
        out: dict[str, int] = {}
        for d in reversed(self.dims):
            out[d.name] = rank % d.size
            rank //= d.size
        return {d.name: out[d.name] for d in self.dims}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        rank = 0
        for d in self.dims:
            c = coords.get(d.name, 0)
            if not 0 <= c < d.size:
                raise ValueError(f"coordinate {d.name}={c} is outside [0, {d.size})")
            rank = rank * d.size + c
        return rank

    def group(self, rank: int, along: Iterable[str]) -> list[int]:
        """Ranks that share every coordinate of ``rank`` except those in ``along``."""
        along = list(along)
        sizes = [self.dim(name).size for name in along]
        base = self.coords(rank)
        return sorted(
            self.rank_of({**base, **dict(zip(along, point))}) for point in itertools.product(*map(range, sizes))
        )

    def groups(self, along: Iterable[str]) -> list[list[int]]:
        """The partition of all ranks into :meth:`group` sets, ordered by their first rank."""
        along = list(along)
        seen: set[int] = set()
        out: list[list[int]] = []
        for r in range(self.size):
            if r not in seen:
                g = self.group(r, along)
                seen.update(g)
                out.append(g)
        return out


@dataclass(frozen=True)
class StateClass:
    """A class of state and the dimensions of ``grid`` along which its copies are identical."""

    grid: str
    identical_along: tuple[str, ...] = ()
    derived: bool = False
    """The framework recomputes this class from the others after a migration (the provider's
    ``resume()``, collectives allowed), so the protocol never snapshots, pushes or fetches it.
    ZeRO 1/2's low-precision parameters are the example: every rank's share is its fp32 master
    partition cast down, and DeepSpeed all-gathers the shares after each step. False by default:
    a class is state unless its framework guarantees it is a function of the rest."""


@dataclass(frozen=True)
class Layout:
    """A job's grids and the redundancy of each class of state it holds."""

    framework: str
    grids: tuple[Grid, ...]
    state_classes: Mapping[str, StateClass] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.grids:
            raise ValueError("a layout needs at least one grid")
        sizes = {g.name: g.size for g in self.grids}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"every grid of a layout must span the same ranks; sizes are {sizes}")
        for cls in self.state_classes.values():
            grid = self.grid(cls.grid)
            for name in cls.identical_along:
                grid.dim(name)

    @property
    def world_size(self) -> int:
        return self.grids[0].size

    def grid(self, name: str | None = None) -> Grid:
        if name is None:
            return self.grids[0]
        for g in self.grids:
            if g.name == name:
                return g
        raise KeyError(f"layout has no grid {name!r}; it has {[g.name for g in self.grids]}")

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on the primary grid."""
        return self.grid().coords(rank)

    def replica_set(self, rank: int, state_class: str) -> list[int]:
        """Ranks holding a bitwise-identical copy of ``rank``'s ``state_class`` state, ``rank`` included."""
        try:
            cls = self.state_classes[state_class]
        except KeyError:
            raise KeyError(
                f"layout {self.framework!r} has no state class {state_class!r}; it has {sorted(self.state_classes)}"
            ) from None
        return self.grid(cls.grid).group(rank, cls.identical_along)

    def copied_classes(self) -> list[str]:
        """State classes the protocol snapshots and moves: all but the derived ones."""
        return sorted(name for name, cls in self.state_classes.items() if not cls.derived)

    def derived_classes(self) -> list[str]:
        """State classes the framework recomputes after a migration (:attr:`StateClass.derived`)."""
        return sorted(name for name, cls in self.state_classes.items() if cls.derived)

    def sharded_classes(self) -> list[str]:
        """State classes that parallelism gives no redundancy (replica set of one)."""
        return sorted(name for name in self.state_classes if len(self.replica_set(0, name)) == 1)

    def locate(self, rank: int) -> str:
        """``rank``'s coordinates, e.g. ``pp=0 dp=1 tp=1`` (size-1 dimensions omitted), for messages and the ledger."""
        parts = []
        for i, g in enumerate(self.grids):
            coords = g.coords(rank)
            prefix = "" if i == 0 else f"{g.name}."
            parts += [f"{prefix}{d.name}={coords[d.name]}" for d in g.dims if d.size > 1]
        return " ".join(parts) or "(single rank)"

    def describe(self) -> str:
        parts = []
        for g in self.grids:
            parts.append(f"{g.name}[" + " x ".join(f"{d.name}={d.size}" for d in g.dims) + "]")
        classes = ", ".join(
            f"{n}: identical along {'/'.join(c.identical_along) or 'nothing (sharded)'}{' (derived)' if c.derived else ''}"
            for n, c in sorted(self.state_classes.items())
        )
        return f"{self.framework} {' '.join(parts)}; {classes}"


@dataclass(frozen=True)
class Placement:
    """Which node hosts each global rank in the current generation."""

    node_of: Mapping[int, int]

    @classmethod
    def contiguous(cls, world_size: int, nproc_per_node: int, moved: Mapping[int, int] | None = None) -> "Placement":
        """Rank r on node ``r // nproc_per_node``, as the launcher starts them, except the ``moved`` ranks (rank -> node)."""
        moved = moved or {}
        return cls({r: moved.get(r, r // nproc_per_node) for r in range(world_size)})

    def nodes(self) -> list[int]:
        return sorted(set(self.node_of.values()))

    def ranks_on(self, node: int) -> list[int]:
        return sorted(r for r, n in self.node_of.items() if n == node)


def assign_buddies(placement: Placement) -> dict[int, int]:
    """Pick, for every rank, the rank that keeps its buddy copy of sharded state.

    The buddy is on the next node of a ring over nodes, at the same position among
    that node's ranks, so every rank keeps exactly one buddy copy and a whole-node
    loss never takes a rank and its buddy together. On a single node the buddy is
    the next rank: it covers process failures, not the node's loss.
    """
    # Ranks grouped by node in one pass: every rank computes this map each generation, and
    # asking the placement node by node would cost (ranks x nodes) at 16,384 ranks.
    on: dict[int, list[int]] = {}
    for r in sorted(placement.node_of):
        on.setdefault(placement.node_of[r], []).append(r)
    nodes = sorted(on)
    buddies: dict[int, int] = {}
    for ni, node in enumerate(nodes):
        mine = on[node]
        # One node: the ring runs over its own ranks (the next rank).
        nxt = on[nodes[(ni + 1) % len(nodes)]] if len(nodes) > 1 else mine[1:] + mine[:1]
        for i, r in enumerate(mine):
            buddies[r] = nxt[i % len(nxt)]
    return buddies


def layout_to_dict(layout: Layout) -> dict[str, Any]:
    """A JSON-able description (the controller plans with the layout rank 0 reported)."""
    return {
        "framework": layout.framework,
        "grids": [{"name": g.name, "dims": [[d.name, d.size] for d in g.dims]} for g in layout.grids],
        "state_classes": {
            n: {"grid": c.grid, "identical_along": list(c.identical_along), "derived": c.derived} for n, c in layout.state_classes.items()
        },
    }


def layout_from_dict(data: Mapping[str, Any]) -> Layout:
    return Layout(
        data["framework"],
        tuple(_grid(g["name"], [(n, s) for n, s in g["dims"]]) for g in data["grids"]),
        {n: StateClass(c["grid"], tuple(c["identical_along"]), bool(c["derived"])) for n, c in data["state_classes"].items()},
    )


def _grid(name: str, dims: Sequence[tuple[str, int]]) -> Grid:
    return Grid(name, tuple(Dim(n, s) for n, s in dims))


def _with_global(grid: Grid, classes: dict[str, StateClass]) -> dict[str, StateClass]:
    # "global": state every rank holds identically (LR scheduler, step counters).
    return {**classes, "global": StateClass(grid.name, tuple(d.name for d in grid.dims))}


def ddp_layout(world_size: int) -> Layout:
    """Plain data parallelism: every rank holds the whole model and optimizer."""
    g = _grid("dp", [("dp", world_size)])
    return Layout("ddp", (g,), _with_global(g, {"params": StateClass("dp", ("dp",)), "optimizer": StateClass("dp", ("dp",))}))


def deepspeed_layout(
    *,
    pipe: int = 1,
    data: int,
    model: int = 1,
    zero_stage: int = 0,
    mics_shard_size: int | None = None,
    expert_parallel: int = 1,
) -> Layout:
    """DeepSpeed's ``PipeModelDataParallelTopology`` grid (axes pipe, data, model; model fastest).

    ZeRO 0 replicates everything along ``data``; ZeRO 1/2 shard the optimizer
    partitions (fp32 master weights and moments) along it, and their
    low-precision parameters are *derived*: each rank's share is its master
    partition cast down, all-gathered after every step (DeepSpeed's
    ``update_lp_params`` redoes exactly that after a migration); ZeRO 3 shards
    the parameters too. MiCS splits ``data`` into replicate groups of
    ``mics_shard_size`` consecutive data ranks: shards are identical across
    groups. Expert parameters are replicated only across expert-data-parallel
    ranks (data ranks equal modulo ``expert_parallel``).
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if data % expert_parallel:
        raise ValueError(f"expert_parallel ({expert_parallel}) must divide the data-parallel size ({data})")
    dims: list[tuple[str, int]] = [("pipe", pipe)]
    if mics_shard_size and mics_shard_size < data:
        if data % mics_shard_size:
            raise ValueError(f"mics_shard_size ({mics_shard_size}) must divide the data-parallel size ({data})")
        dims += [("data_replica", data // mics_shard_size), ("data_shard", mics_shard_size)]
        shard_copies: tuple[str, ...] = ("data_replica",)
        all_data: tuple[str, ...] = ("data_replica", "data_shard")
    else:
        dims += [("data", data)]
        shard_copies = ()
        all_data = ("data",)
    dims.append(("model", model))
    grids = [_grid("main", dims)]
    derived = zero_stage in (1, 2)
    classes = {
        "params": StateClass("main", all_data if zero_stage < 3 else shard_copies, derived),
        "optimizer": StateClass("main", all_data if zero_stage == 0 else shard_copies),
    }
    if expert_parallel > 1:
        grids.append(
            _grid(
                "expert",
                [("pipe", pipe), ("expert_data", data // expert_parallel), ("expert", expert_parallel), ("model", model)],
            )
        )
        classes["expert_params"] = StateClass("expert", ("expert_data",) if zero_stage < 3 else (), derived)
    return Layout("deepspeed", tuple(grids), _with_global(grids[0], classes))


def megatron_layout(
    *,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    dp: int,
    pp: int = 1,
    order: str = "tp-cp-ep-dp-pp",
    expert_tp: int | None = None,
    distributed_optimizer: bool = False,
    num_distributed_optimizer_instances: int = 1,
) -> Layout:
    """megatron-core's rank layout (``RankGenerator``), ``order`` fastest dimension first.

    ``dp`` is the dense data-parallel size. As in megatron-core, the dense grid
    has no expert dimension and the expert grid spans ``expert_tp x ep x
    expert_dp x pp`` over the same ranks. Parameters are identical across data-
    and context-parallel ranks. Without the distributed optimizer so is the
    optimizer state; with it, the state is sharded over the ``dp x cp`` ranks of
    one optimizer instance and identical across the
    ``num_distributed_optimizer_instances`` instances, which megatron-core forms
    from contiguous blocks of the ``dp-cp`` group.
    """
    world = tp * cp * dp * pp
    inst = num_distributed_optimizer_instances
    if (dp * cp) % inst:
        raise ValueError(f"num_distributed_optimizer_instances ({inst}) must divide dp*cp ({dp * cp})")
    tokens = [t for t in order.lower().split("-") if t != "ep"]
    for name in ("tp", "cp", "dp", "pp"):
        if name not in tokens:
            tokens.append(name)
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    data_dims: tuple[str, ...] = ("cp", "dp")
    optimizer_copies: tuple[str, ...] = ("cp", "dp")
    if inst > 1:
        # The instances split the dp-cp index (cp fastest) into contiguous blocks;
        # that is a row-major split only when cp and dp are adjacent in the order.
        if cp > 1 and abs(tokens.index("cp") - tokens.index("dp")) != 1:
            raise ValueError(f"order {order!r}: distributed optimizer instances need cp next to dp")
        lo = min(tokens.index("cp"), tokens.index("dp")) if cp > 1 else tokens.index("dp")
        width = 2 if cp > 1 else 1
        tokens[lo : lo + width] = ["dp_in_instance", "dp_instance"]
        sizes.update({"dp_in_instance": dp * cp // inst, "dp_instance": inst})
        data_dims = ("dp_in_instance", "dp_instance")
        optimizer_copies = data_dims
    if distributed_optimizer:
        optimizer_copies = ("dp_instance",) if inst > 1 else ()
    dense = _grid("dense", [(n, sizes[n]) for n in reversed(tokens)])
    classes = {"params": StateClass("dense", data_dims), "optimizer": StateClass("dense", optimizer_copies)}
    grids = [dense]
    etp = expert_tp if expert_tp is not None else tp
    if ep > 1 or etp != tp:
        if world % (etp * ep * pp):
            raise ValueError(f"world size {world} is not divisible by expert_tp*ep*pp = {etp * ep * pp}")
        expert_tokens = [t for t in order.lower().split("-") if t != "cp"]
        for name in ("tp", "ep", "dp", "pp"):
            if name not in expert_tokens:
                expert_tokens.append(name)
        expert_sizes = {"tp": etp, "ep": ep, "dp": world // (etp * ep * pp), "pp": pp}
        grids.append(_grid("expert", [(n, expert_sizes[n]) for n in reversed(expert_tokens)]))
        classes["expert_params"] = StateClass("expert", ("dp",))
        classes["expert_optimizer"] = StateClass("expert", () if distributed_optimizer else ("dp",))
    return Layout("megatron", tuple(grids), _with_global(dense, classes))


def torchtitan_layout(*, pp: int = 1, dp_replicate: int = 1, dp_shard: int = 1, cp: int = 1, tp: int = 1) -> Layout:
    """TorchTitan's world mesh: ``pp, dp_replicate, dp_shard, cp, tp`` in row-major order.

    FSDP2 shards parameters and optimizer state over ``dp_shard x cp``; HSDP's
    ``dp_replicate`` dimension holds identical copies. With ``dp_shard == 1``
    and ``cp == 1`` this is plain DDP over ``dp_replicate``.
    """
    g = _grid("world", [("pp", pp), ("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("cp", cp), ("tp", tp)])
    return Layout(
        "torchtitan",
        (g,),
        _with_global(g, {"params": StateClass("world", ("dp_replicate",)), "optimizer": StateClass("world", ("dp_replicate",))}),
    )
