"""One rank's training state as the migration protocol moves it: captured, read from a copy, loaded.

A rank's state is the framework's components (classed by the provider's
layout: replicated, sharded, per rank) plus its *small state*, the part no
replica shares: RNG streams, the provider's own per-rank extras (buffers,
counters) and the data position. :meth:`StateCopier.capture` takes all of it
as one :class:`~torchpass.core.manifest.Captured` (tensors by reference, the
small state under ``__small__``), which is what a rank publishes for others
to copy and what its buddy keeper snapshots.

:meth:`StateCopier.apply` carries out this rank's part of a plan: for each
group of state classes the plan names sources for, read that copy at the
plan's target version (from this process's own snapshot, or over the network
from the sources, verified), load the components into the provider, then
restore the small state (from a copy or from the store's mirror), data
position before RNG.

Invariant: nothing is loaded unless every class the plan names was read; a
failed read raises :class:`~torchpass.core.transfer.TransferError` with the
live state untouched, and the caller reports the attempt failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.distributed as dist

from .adapter import SMALL_CLASS, StateProvider
from .buddy import BuddyKeeper
from .config import TorchPassConfig
from .control import Plan, read_mirror
from .data import ReplayableData
from .manifest import Captured, capture, rebuild
from .rng import capture_rng, restore_rng
from .transfer import ReceivePool, TransferError, fetch_state

__all__ = ["SMALL_KEY", "StateCopier", "Timings"]

SMALL_KEY = "__small__"
"""The component name of the small state inside a captured state."""


@dataclass
class Timings:
    """What one migration cost this rank, reported in its ``done`` record."""

    values: dict[str, float] = field(default_factory=dict)
    bytes_moved: int = 0

    def add(self, name: str, seconds: float) -> None:
        self.values[name] = self.values.get(name, 0.0) + seconds


class StateCopier:
    """Captures and loads the state of ``rank`` (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        provider: StateProvider,
        data: ReplayableData | None,
        config: TorchPassConfig,
        store: dist.Store,
        buddy: BuddyKeeper | None,
        pool: Callable[[], ReceivePool | None],
        secret: bytes,
        derived: frozenset[str] = frozenset(),
    ):
        self.rank = rank
        self.provider = provider
        self.data = data
        self.config = config
        self._store = store
        self._buddy = buddy
        self._pool = pool
        self._secret = secret
        self.derived = derived
        """State classes the provider recomputes after a migration: left out of snapshots and receive buffers."""

    # ---- small state ---------------------------------------------------------
    def small_state(self, rng: dict[str, Any] | None = None) -> dict[str, Any]:
        """``{"rng", "data"}``: RNG streams (``rng``, or captured now) with the provider's extras, and the data position."""
        rng = capture_rng() if rng is None else rng
        extra = self.provider.small_state() if hasattr(self.provider, "small_state") else None
        rng = {**rng, "provider": extra} if extra is not None else rng
        return {"rng": rng, "data": self.data.snapshot() if self.data is not None else None}

    def restore_rng(self, rng: dict[str, Any]) -> None:
        """Restore RNG streams and the provider's extras from a small state's ``rng`` part."""
        restore_rng(rng)
        if "provider" in rng:
            self.provider.load_small_state(rng["provider"])  # type: ignore[attr-defined]

    # ---- capture ---------------------------------------------------------------
    def capture(self, version: int, *, device_tensors: str = "stage", derived: bool = True) -> Captured:
        """Every component and the small state, by reference, at ``version``.

        ``device_tensors``: what CUDA tensors become (:func:`~torchpass.core.manifest.capture`): pinned
        copies, empty pinned receive buffers (``"buffers"``), or themselves for a buddy snapshot (``"live"``).
        ``derived=False`` leaves out the components of derived classes (what a snapshot keeps and a
        fetch receives); what a rank publishes and fingerprints keeps them."""
        components, classes = self.provider.state_components()
        if not derived and self.derived:
            components = {name: value for name, value in components.items() if classes[name] not in self.derived}
            classes = {name: cls for name, cls in classes.items() if cls not in self.derived}
        components = {**components, SMALL_KEY: self.small_state()}
        classes = {**classes, SMALL_KEY: SMALL_CLASS}
        return capture(components, classes, version, meta={"classes": classes}, device_tensors=device_tensors)

    # ---- loading a plan --------------------------------------------------------
    def apply(self, plan: Plan, timings: Timings, *, joining: bool, defer_small: bool = False) -> dict[str, Any] | None:
        """Read and load what ``plan`` says this rank fetches (``joining``: this process is a spare taking the rank).

        With ``defer_small`` the small state is returned instead of restored (the
        caller restores it with :meth:`restore_small` once the rank goes live);
        otherwise None.
        """
        rank_plan = plan.rank_plan(self.rank)
        target = plan.target_version
        by_sources: dict[tuple[tuple[int, str], ...], set[str]] = {}
        for cls, sources in rank_plan.fetch.items():
            by_sources.setdefault(tuple((int(r), str(c)) for r, c in sources), set()).add(cls)
        if "/" in rank_plan.small_from:
            r, copy = rank_plan.small_from.split("/", 1)
            by_sources.setdefault(((int(r), copy),), set()).add(SMALL_CLASS)
        received: dict[str, Any] = {}
        for sources, classes in by_sources.items():
            received.update(self._read(plan, sources, classes, timings, joining=joining))
        small = received.pop(SMALL_KEY, None)
        if rank_plan.small_from == "mirror":
            small = read_mirror(self._store, self.rank).get(target)
            if small is None:
                raise TransferError(f"rank {self.rank}'s mirror has no record for step {target}")
        if received:
            self.provider.load_components(received, joining=joining)
        if defer_small:
            return small
        self.restore_small(small, joining=joining)
        return None

    def restore_small(self, small: dict[str, Any] | None, *, joining: bool) -> None:
        """Restore a received small state: data position, then RNG streams and the provider's extras."""
        if small is not None:
            # Data before RNG. ReplayableData starts epoch iterators with the global RNG
            # saved and restored, so the order is for sources that draw when advanced.
            if self.data is not None and small["data"] is not None:
                if joining:
                    self.data.fast_forward(small["data"])
                else:
                    self.data.seek(small["data"]["position"])
            self.restore_rng(small["rng"])

    def _read(
        self, plan: Plan, sources: tuple[tuple[int, str], ...], classes: set[str], timings: Timings, *, joining: bool
    ) -> dict[str, Any]:
        """The components of ``classes`` at the plan's target, from this process's own snapshot or over the network.

        A source naming this rank is this process only when it is not joining: a spare that
        takes over a draining rank has the same rank number as its source, which is the
        draining process, and reads that one's snapshot over the network.
        """
        target = plan.target_version
        if sources == ((self.rank, "snapshot"),) and not joining:
            manifest, tensors = self._own_snapshot(target)
        else:
            manifest, tensors, stats = fetch_state(
                [(tuple(plan.addresses[str(r)]), copy) for r, copy in sources],  # type: ignore[misc]
                target,
                chunk_bytes=self.config.transfer_chunk_bytes,
                retries=self.config.transfer_retries,
                timeout=self.config.rebuild_timeout_s,
                verify_replicas=self.config.verify_replicas,
                state_classes=classes,
                into=self.capture(target, device_tensors="buffers", derived=False),
                pool=self._pool(),
                secret=self._secret,
            )
            timings.bytes_moved += stats.nbytes
            timings.add("fetch", stats.seconds)
        component_classes = manifest.meta["classes"]
        state = rebuild(manifest, tensors)
        return {name: value for name, value in state.items() if component_classes[name] in classes}

    def _own_snapshot(self, target: int) -> tuple[Any, list[Any]]:
        if self._buddy is None:
            raise TransferError(f"rank {self.rank} keeps no snapshots (redundancy is not 'buddy' here)")
        snap = self._buddy.snapshot(target)
        if snap is None:
            raise TransferError(f"rank {self.rank} has no snapshot of step {target} any more")
        # Copy out of the snapshot: loading it directly would make live optimizer
        # state alias snapshot buffers that later snapshots overwrite.
        mine = self.capture(target, device_tensors="buffers", derived=False)
        own = {e.name: t for e, t in zip(mine.manifest.entries, mine.tensors)}
        tensors = []
        for entry, saved in zip(snap.manifest.entries, snap.tensors):
            live = own.get(entry.name)
            if live is not None and live.dtype == saved.dtype and live.shape == saved.shape:
                tensors.append(live.copy_(saved))
            else:
                tensors.append(saved.clone())
        return snap.manifest, tensors
