"""Migration planning: pick the step to resume at, the spares, and where every rank's state comes from.

A pure function of what the controller observed, so it is unit-tested without
processes. Inputs: the layout (which ranks hold identical copies of which
class of state), the members of the generation that ended, the statuses of the
survivors (version = optimizer steps their state reflects, clean = not
interrupted inside an optimizer step), the lost ranks, the draining ranks and
the spare pool, and the small-state mirrors.

Rules:

* The target version T is the highest version at which every rank of the new
  world can obtain every class of its state: from itself (a clean survivor at
  T, or its own snapshot at T: a rollback), from a replica in its replica set
  for that class holding T live or in a snapshot, or from a buddy copy of it
  held by another rank (a draining rank is always its own best source). Without
  snapshots a survivor cannot go back, so in replica mode T is the newest clean
  version or nothing; with buddy copies it is at most one interval back.
* Derived state classes (:attr:`~torchpass.core.topology.StateClass.derived`)
  are never fetched: the framework recomputes them from the rest on every
  member once the new generation is live.
* Small per-rank state (RNG streams, data position) at T comes from the rank
  itself, its snapshot, its mirror record for T, its buddy copy, or a replica
  whose small state is known to be identical (equal mirror digests).
* A lost or draining rank gets a spare: the one it was given by an earlier,
  interrupted plan if that spare is still alive, else one on its own node,
  else one on the node with the most spares left. Spares on a node whose
  launcher has gone quiet (``silent_nodes``) come last: that node may be
  about to be declared lost with them.
* When some rank cannot be given its state, or no spare is left, the result is
  :class:`Disqualified` with a message naming the rank and the missing piece.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .control import Plan, RankPlan, Status
from .topology import Layout

__all__ = ["MirrorInfo", "SpareInfo", "PlanInput", "Disqualified", "plan_migration"]

@dataclass(frozen=True)
class MirrorInfo:
    """Which small-state records a rank left in the store: version -> RNG digest."""

    versions: Mapping[int, str]


@dataclass(frozen=True)
class SpareInfo:
    wid: str
    node: int


@dataclass
class PlanInput:
    layout: Layout
    generation: int
    """The generation being planned (the ended one plus one)."""
    members: Mapping[int, str]
    statuses: Mapping[int, Status]
    lost: set[int]
    draining: set[int]
    spares: Sequence[SpareInfo]
    node_of: Mapping[str, int]
    mirrors: Mapping[int, MirrorInfo] = field(default_factory=dict)
    sticky: Mapping[int, str] = field(default_factory=dict)
    """Rank -> spare assigned by an earlier plan that did not complete."""
    cause: str = ""
    max_sources: int = 4
    silent_nodes: frozenset[int] = frozenset()
    """Nodes whose launcher missed its recent heartbeats: their spares are the last choice, never the first."""


@dataclass(frozen=True)
class Disqualified:
    """No plan exists; ``message`` says which rank lacks what."""

    message: str
    reason: str
    """``no_spare`` or ``no_state``."""


class _Index:
    """Per-planning lookups built once in O(N), so planning costs O(N + needy x replica set)."""

    def __init__(self, inp: PlanInput):
        self.inp = inp
        self.reporting = {r: st for r, st in inp.statuses.items() if r not in inp.lost}
        self.held: dict[int, list[tuple[int, set[int]]]] = {}
        for holder, st in sorted(self.reporting.items()):
            for src, versions in st.holds.items():
                self.held.setdefault(int(src), []).append((holder, set(versions)))
        # State classes with the same replica sets (a DDP rank's params, optimizer and global state) share their
        # source lists: each is O(replica set) to build, which is the whole job in data parallelism.
        self._sources: dict[tuple[str, tuple[str, ...], int, int], list[tuple[int, str]]] = {}

    def usable(self, rank: int) -> Status | None:
        return self.reporting.get(rank)

    def live_at(self, rank: int, version: int) -> bool:
        st = self.reporting.get(rank)
        return st is not None and st.clean and st.version == version

    def sources(self, rank: int, state_class: str, version: int) -> list[tuple[int, str]]:
        """Copies of ``rank``'s ``state_class`` state at ``version`` held by other reporting ranks.

        Classes with the same replica sets get the same list object (callers must not modify it).
        """
        cls = self.inp.layout.state_classes[state_class]
        key = (cls.grid, tuple(cls.identical_along), rank, version)
        if key not in self._sources:
            self._sources[key] = self._find_sources(rank, state_class, version)
        return self._sources[key]

    def _find_sources(self, rank: int, state_class: str, version: int) -> list[tuple[int, str]]:
        out: list[tuple[int, str]] = []
        for r in self.inp.layout.replica_set(rank, state_class):
            st = self.reporting.get(r)
            if st is None or r == rank:
                continue
            if st.clean and st.version == version:
                out.append((r, "live"))
            elif version in st.snapshots:
                out.append((r, "snapshot"))
        out += [(holder, f"held:{rank}") for holder, versions in self.held.get(rank, []) if version in versions]
        return out

    def small_source(self, rank: int, version: int) -> str | None:
        st = self.reporting.get(rank)
        if st is not None and st.clean and st.version == version:
            return "self" if rank not in self.inp.draining else f"{rank}/live"
        if st is not None and version in st.snapshots:
            return f"{rank}/snapshot"
        mirror = self.inp.mirrors.get(rank)
        if mirror is not None and version in mirror.versions:
            return "mirror"
        for holder, versions in self.held.get(rank, []):
            if version in versions:
                return f"{holder}/held:{rank}"
        if mirror is None:
            return None
        # The RNG streams of data-parallel replicas are often seeded alike: if this
        # rank's mirrored records match a replica's at every common version, the
        # replica's small state is this rank's too.
        for r in self.inp.layout.replica_set(rank, "params"):
            other = self.inp.mirrors.get(r)
            if r == rank or other is None or not self.live_at(r, version):
                continue
            common = set(mirror.versions) & set(other.versions)
            if common and all(mirror.versions[v] == other.versions[v] for v in common):
                return f"{r}/live"
        return None


def _nearest(sources: list[tuple[int, str]], rank: int, node_of_rank: Mapping[int, int], limit: int) -> list[list[Any]]:
    # Live copies first (no extra copy needed), then the receiver's node, then rank distance.
    here = node_of_rank.get(rank)

    def key(s: tuple[int, str]) -> tuple[bool, bool, int, int]:
        return (s[1] != "live", node_of_rank.get(s[0]) != here, abs(s[0] - rank), s[0])

    best = heapq.nsmallest(limit * 4, sources, key=key)
    # Striping mixes only copies of the same kind, whose bytes are guaranteed equal.
    kind = best[0][1]
    return [list(s) for s in best if s[1] == kind][:limit]


def _assign_spares(inp: PlanInput, needy: list[int]) -> dict[int, str] | Disqualified:
    pool = {s.wid: s.node for s in inp.spares}
    assigned: dict[int, str] = {}
    for rank in needy:
        wid = inp.sticky.get(rank)
        if wid in pool:
            assigned[rank] = wid
            del pool[wid]
    for rank in needy:
        if rank in assigned:
            continue
        if not pool:
            missing = [r for r in needy if r not in assigned]
            return Disqualified(
                f"no spare left for rank(s) {missing}: {len(needy)} needed, {len(inp.spares)} available",
                "no_spare",
            )
        home = inp.node_of.get(inp.members.get(rank, ""), -1)
        local = [w for w, n in pool.items() if n == home] if home not in inp.silent_nodes else []
        if local:
            wid = sorted(local)[0]
        else:
            counts: dict[int, int] = {}
            for n in pool.values():
                counts[n] = counts.get(n, 0) + 1
            wid = sorted(pool, key=lambda w: (pool[w] in inp.silent_nodes, -counts[pool[w]], w))[0]
        assigned[rank] = wid
        del pool[wid]
    return assigned


def _plan_at(index: _Index, version: int) -> dict[int, RankPlan] | str:
    """Plans of the ranks that do anything to reach ``version``, or a sentence naming the first rank that cannot.

    A rank absent from the result keeps its live state and its own small state.
    """
    inp = index.inp
    # Derived classes are recomputed by the framework once the generation is live: nobody fetches them.
    classes = inp.layout.copied_classes()
    plans: dict[int, RankPlan] = {}
    for rank in range(inp.layout.world_size):
        st = index.usable(rank)
        live = index.live_at(rank, version)
        if live and rank not in inp.draining:
            continue
        plan = RankPlan()
        if live:
            # A draining rank hands over exactly its own state, sharded parts included.
            plan.fetch = {cls: [[rank, "live"]] for cls in classes}
        elif st is not None and version in st.snapshots:
            plan.fetch = {cls: [[rank, "snapshot"]] for cls in classes}
        else:
            for cls in classes:
                sources = index.sources(rank, cls, version)
                if not sources:
                    return (
                        f"rank {rank}: no surviving copy of its {cls!r} state at step {version} "
                        f"(replica set {inp.layout.replica_set(rank, cls)}, lost {sorted(inp.lost)}, no buddy copy)"
                    )
                plan.fetch[cls] = sources  # type: ignore[assignment]
        small = index.small_source(rank, version)
        if small is None:
            mirror = inp.mirrors.get(rank)
            have = sorted(mirror.versions) if mirror else []
            return (
                f"rank {rank}: its RNG and data position at step {version} were not mirrored "
                f"(its mirror holds steps {have}) and no data-parallel replica's RNG is known to match it"
            )
        plan.small_from = small
        plans[rank] = plan
    return plans


def plan_migration(inp: PlanInput) -> Plan | Disqualified:
    """Plan the next generation, or say why none exists."""
    index = _Index(inp)
    candidates = {st.version for st in index.reporting.values() if st.clean}
    for st in index.reporting.values():
        candidates.update(st.snapshots)
        for versions in st.holds.values():
            candidates.update(versions)
    if not candidates:
        return Disqualified("no surviving rank holds a clean copy of its state, live or snapshot", "no_state")
    problem = ""
    target, rank_plans = -1, {}
    for version in sorted(candidates, reverse=True):
        found = _plan_at(index, version)
        if isinstance(found, str):
            problem = problem or found
            continue
        target, rank_plans = version, found
        break
    if target < 0:
        return Disqualified(problem, "no_state")
    needy = sorted(inp.lost | inp.draining)
    spares = _assign_spares(inp, needy)
    if isinstance(spares, Disqualified):
        return spares
    node_of_rank = {r: inp.node_of.get(w, -1) for r, w in inp.members.items()}
    for rank, wid in spares.items():
        node_of_rank[rank] = inp.node_of.get(wid, -1)
    used: set[int] = set()
    for rank, plan in rank_plans.items():
        # One choice per distinct source list (shared by the classes with the same replica sets).
        nearest: dict[int, list[list[Any]]] = {}
        for src in plan.fetch.values():
            if id(src) not in nearest:
                nearest[id(src)] = _nearest(src, rank, node_of_rank, inp.max_sources)  # type: ignore[arg-type]
        plan.fetch = {cls: [list(s) for s in nearest[id(src)]] for cls, src in plan.fetch.items()}
        used.update(r for sources in plan.fetch.values() for r, _ in sources)
        if "/" in plan.small_from:
            used.add(int(plan.small_from.split("/", 1)[0]))
    return Plan(
        generation=inp.generation,
        target_version=target,
        joins={str(r): wid for r, wid in spares.items()},
        ranks={str(r): p for r, p in rank_plans.items()},
        addresses={str(r): list(index.reporting[r].transfer_addr) for r in sorted(used)},
        cause=inp.cause,
        replaced={str(r): inp.members[r] for r in spares},
        retire=[inp.members[r] for r in sorted(inp.draining)],
        # Completed steps undone: a survivor's reported version counts only committed steps.
        steps_lost=max(0, max(st.version for st in index.reporting.values()) - target),
    )
