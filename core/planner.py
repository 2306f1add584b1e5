"""Migration planning: pick the step to resume at, the spares, and where every rank's state comes from.

A pure function of what the controller observed, so it is unit-tested without
processes. Inputs: the layout (which ranks hold identical copies of which
class of state), the members of the generation that ended, the statuses of the
survivors (version = optimizer steps their state reflects, clean = not
interrupted inside an optimizer step), the lost ranks, the draining ranks and
the spare pool, and the small-state mirrors.

Rules:

* The target version T is the highest version at which every rank of the new
  world can obtain every class of its state: from itself (a clean survivor at T),
  or from a clean survivor at T in its replica set for that class (a draining
  rank is always its own best source). Survivors past T would have to roll
  back; without snapshots that is impossible, so in replica mode T is the
  highest clean version or nothing.
* Small per-rank state (RNG streams, data position) at T comes from the rank
  itself, from its mirror record for T, or from a replica whose small state is
  known to be identical (equal mirror digests at a common version).
* A lost or draining rank gets a spare: the one it was given by an earlier,
  interrupted plan if that spare is still alive, else one on its own node,
  else one on the node with the most spares left.
* When some rank cannot be given its state, or no spare is left, the result is
  :class:`Disqualified` with a message naming the rank and the missing piece.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

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


@dataclass(frozen=True)
class Disqualified:
    """No plan exists; ``message`` says which rank lacks what."""

    message: str
    reason: str
    """``no_spare`` or ``no_state``."""


def _sources_at(inp: PlanInput, rank: int, state_class: str, version: int) -> list[int]:
    """Clean, reporting ranks at ``version`` holding ``rank``'s copy of ``state_class``."""
    out = []
    for r in inp.layout.replica_set(rank, state_class):
        st = inp.statuses.get(r)
        if st is not None and st.clean and st.version == version and r not in inp.lost:
            out.append(r)
    return out


def _small_source(inp: PlanInput, rank: int, version: int) -> str | None:
    st = inp.statuses.get(rank)
    if st is not None and st.clean and st.version == version and rank not in inp.lost:
        return "self" if rank not in inp.draining else f"rank:{rank}"
    mirror = inp.mirrors.get(rank)
    if mirror is not None and version in mirror.versions:
        return "mirror"
    if mirror is None:
        return None
    # The RNG streams of data-parallel replicas are often seeded alike: if this
    # rank's last mirrored record matches a replica's at the same version, the
    # replica's live small state is this rank's too.
    for r in inp.layout.replica_set(rank, "params"):
        if r == rank:
            continue
        other = inp.mirrors.get(r)
        st = inp.statuses.get(r)
        if other is None or st is None or not st.clean or st.version != version or r in inp.lost:
            continue
        common = set(mirror.versions) & set(other.versions)
        if common and all(mirror.versions[v] == other.versions[v] for v in common):
            return f"rank:{r}"
    return None


def _nearest(sources: list[int], rank: int, node_of_rank: Mapping[int, int], limit: int) -> list[int]:
    # Prefer sources on the receiver's node, then by rank distance, for deterministic striping.
    here = node_of_rank.get(rank)
    return sorted(sources, key=lambda s: (node_of_rank.get(s) != here, abs(s - rank), s))[:limit]


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
        local = [w for w, n in pool.items() if n == home and rank not in inp.lost]
        if local:
            wid = sorted(local)[0]
        else:
            counts: dict[int, int] = {}
            for n in pool.values():
                counts[n] = counts.get(n, 0) + 1
            wid = sorted(pool, key=lambda w: (-counts[pool[w]], w))[0]
        assigned[rank] = wid
        del pool[wid]
    return assigned


def _plan_at(inp: PlanInput, version: int) -> dict[int, RankPlan] | str:
    """Per-rank plans to reach ``version``, or a sentence naming the first rank that cannot."""
    plans: dict[int, RankPlan] = {}
    for rank in range(inp.layout.world_size):
        st = inp.statuses.get(rank)
        usable = st is not None and st.clean and st.version == version and rank not in inp.lost
        plan = RankPlan()
        if not usable or rank in inp.draining:
            for cls in sorted(inp.layout.state_classes):
                # A draining rank hands over exactly its own state, sharded parts included.
                sources = [rank] if usable else [s for s in _sources_at(inp, rank, cls, version) if s != rank]
                if not sources:
                    return (
                        f"rank {rank}: no surviving copy of its {cls!r} state at step {version} "
                        f"(replica set {inp.layout.replica_set(rank, cls)}, lost {sorted(inp.lost)})"
                    )
                plan.fetch[cls] = sources
        small = _small_source(inp, rank, version)
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
    versions = [st.version for r, st in inp.statuses.items() if st.clean and r not in inp.lost]
    if not versions:
        return Disqualified("no surviving rank holds a clean copy of its state", "no_state")
    # Survivors cannot roll back without snapshots, so only the newest clean version is a candidate.
    target = max(versions)
    rank_plans = _plan_at(inp, target)
    if isinstance(rank_plans, str):
        return Disqualified(rank_plans, "no_state")
    needy = sorted(inp.lost | inp.draining)
    spares = _assign_spares(inp, needy)
    if isinstance(spares, Disqualified):
        return spares
    members = {str(r): inp.members[r] for r in range(inp.layout.world_size)}
    node_of_rank = {r: inp.node_of.get(w, -1) for r, w in inp.members.items()}
    for rank, wid in spares.items():
        members[str(rank)] = wid
        node_of_rank[rank] = inp.node_of.get(wid, -1)
    for rank, plan in rank_plans.items():
        plan.fetch = {cls: _nearest(src, rank, node_of_rank, inp.max_sources) for cls, src in plan.fetch.items()}
    return Plan(
        generation=inp.generation,
        target_version=target,
        members=members,
        ranks={str(r): p for r, p in rank_plans.items()},
        addresses={str(r): list(st.transfer_addr) for r, st in inp.statuses.items() if r not in inp.lost},
        cause=inp.cause,
        replaced={str(r): inp.members[r] for r in spares},
        retire=[inp.members[r] for r in sorted(inp.draining)],
    )
