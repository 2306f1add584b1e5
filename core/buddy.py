"""Buddy redundancy: consistent in-memory copies of the state parallelism does not replicate.

Sharded state (ZeRO optimizer partitions, FSDP shards, Megatron's distributed
optimizer) exists on exactly one rank; a data-parallel replica cannot give it
back. Every ``buddy_interval_steps`` committed steps each rank therefore keeps

* a *snapshot*: a copy of its whole state at that version, double-buffered in
  its own memory (so survivors can roll back to a version a lost rank's copy
  exists at), derived classes left out (the framework recomputes them from the
  rest, see :attr:`~torchpass.core.topology.StateClass.derived`), and
* on its *buddy* (a rank on the next node, see ``topology.assign_buddies``), a
  copy of the part nobody else has (the sharded classes and its small state),
  double-buffered there too.

Protocol, per rank, after the commit of step k (k a multiple of the interval);
everything runs on one background thread, off the critical path:

1. copy the live state into the spare snapshot slot; the slot becomes version k;
2. push the sharded part of that snapshot to the buddy, which installs it in
   its spare held slot once every chunk's checksum is verified.

The only waits on the training thread, normally zero because the work overlaps
the next step's forward and backward:

* before the commit of step k+1, the copy of version k is complete (the live
  state is about to change);
* before the rank's first collective after its backward of step k+1 began, the
  push of version k is acknowledged: survivors can complete step k+1 only once
  this rank's version-k copy is safe on its buddy. A push that failed does not
  open this gate: it is given up (:class:`GateReleased`), and so is a wait the
  end of the generation interrupts (:meth:`BuddyKeeper.interrupt`), so a rank
  never waits here on a buddy that died or hangs; the runtime turns either
  into the end of the generation, and the migration re-pairs buddies.

Hence after any failure every survivor holds its state at its live version and
at its newest complete snapshot, and every lost rank's sharded state exists on
its buddy at k or k-1: the planner finds a common version at most one interval
back, and the ledger records the steps rolled back.

Cost, per push: one copy of the live state (the snapshot; the pushed part is
read from it, not copied again) and one CRC32C pass on each side. The sender
checksums each pushed chunk once and reuses the CRC for a resend; the holder
receives straight into its slot and verifies each received chunk once, and
those CRCs stay with the held copy, so serving it in a migration reads it for
nothing else. :meth:`BuddyKeeper.counters` reports these bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .cuda_staging import pinned_like, stage_to_host
from .manifest import Captured, capture, rebuild
from .transfer import Address, HolderLink, TransferError

__all__ = ["BuddyCounters", "BuddyKeeper", "GateReleased", "PushBytes"]


class GateReleased(Exception):
    """A wait for the buddy copy was given up: the push failed, or the generation ended meanwhile."""


@dataclass(frozen=True)
class PushBytes:
    """What buddy pushes cost one side, in bytes: one push, or the sum of several (``+``).

    A sender's counts are its own state's: its snapshot copy and its push. A holder's
    are those of the copies it received and installed for another rank.
    """

    pushed: int = 0
    """Size of the buddy copy: the part of the state pushed (its sharded classes and small state)."""
    copied: int = 0
    """Bytes copied in memory. Sender: the live state into its snapshot, once (the whole state,
    the pushed part included, which is sent from there). Holder: 0, received in place."""
    checksummed: int = 0
    """Bytes put through CRC32C. Sender: each pushed byte once (a resend reuses its CRC).
    Holder: each received byte once (a chunk that failed its check and came again, again)."""
    transferred: int = 0
    """Bytes that crossed the socket for the copy, resends included (sent; on a holder, received)."""

    def __add__(self, other: PushBytes) -> PushBytes:
        return PushBytes(
            self.pushed + other.pushed,
            self.copied + other.copied,
            self.checksummed + other.checksummed,
            self.transferred + other.transferred,
        )


@dataclass(frozen=True)
class BuddyCounters:
    """One rank's buddy work in bytes, per push and in total, on both sides (:meth:`BuddyKeeper.counters`)."""

    pushes: int
    """Snapshots taken (each pushed when the rank had a buddy)."""
    last_push: PushBytes
    """The latest snapshot and push: its copy once taken, its push once delivered (a push
    that failed adds nothing)."""
    pushed_total: PushBytes
    """Every snapshot and push this keeper made."""
    holds: int
    """Buddy copies received, verified and installed for other ranks."""
    last_hold: PushBytes
    """The latest of those."""
    held_total: PushBytes
    """All of them."""


def _layout_key(captured: Captured) -> tuple[Any, ...]:
    return tuple((e.name, e.dtype, e.shape) for e in captured.manifest.entries)


def _copy_into(captured: Captured, buffers: list[torch.Tensor] | None) -> Captured:
    """A snapshot of ``captured`` in ``buffers`` (new ones when None): each byte copied once.

    Tensors the capture already copied (non-contiguous live ones) are taken as they are. Live CUDA
    tensors are staged into pinned host buffers as they were at the capture's events
    (:mod:`torchpass.core.cuda_staging`).
    """
    if buffers is not None and len(buffers) != len(captured.tensors):
        buffers = None
    out = []
    on_device: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, src in enumerate(captured.tensors):
        if src.device.type == "cuda":
            dst = buffers[i] if buffers is not None else pinned_like(src)
            on_device.append((src, dst))
            out.append(dst)
        elif i in captured.private:
            out.append(src)
        else:
            out.append((torch.empty_like(src) if buffers is None else buffers[i]).copy_(src))
    if on_device:
        stage_to_host([s for s, _ in on_device], into=[d for _, d in on_device], after=captured.device_events)
    return Captured(captured.manifest, out)


class BuddyKeeper:
    """One rank's snapshots, buddy pushes, and the buddy copies it holds for others."""

    def __init__(
        self,
        *,
        rank: int,
        classes_to_push: set[str],
        chunk_bytes: int,
        retries: int,
        timeout: float,
        secret: bytes,
        publish: Callable[[Captured, str], None],
        withdraw: Callable[[str, int], None],
    ):
        self.rank = rank
        self.classes_to_push = classes_to_push
        self._chunk_bytes = chunk_bytes
        self._retries = retries
        self._timeout = timeout
        self._link = HolderLink(timeout, secret)
        """The connection to the current buddy, used by the background thread only."""
        self._publish = publish
        self._withdraw = withdraw
        self._cv = threading.Condition()
        self._snapshots: dict[int, Captured] = {}
        self._held: dict[int, dict[int, Captured]] = {}
        self._todo: tuple[Captured, Address | None] | None = None
        self._copied = -1
        self._pushed = -1
        self._requested = -1
        self._push_target: int = -1
        self.error: BaseException | None = None
        self._undelivered: tuple[int, str] | None = None
        """(version, why) of the current push if it failed; the gate for it is given up, not opened."""
        self._requests = 0
        """Counts start() calls: a failure of a push that a newer request superseded is not the current one's."""
        self._interrupted = False
        self._pushes = 0
        self._last_push = PushBytes()
        self._pushed_total = PushBytes()
        self._holds = 0
        self._last_hold = PushBytes()
        self._held_total = PushBytes()
        self.finishing = False
        """Set once training ended: a push failing because the buddy already exited is expected then."""
        threading.Thread(target=self._work, name="torchpass-buddy", daemon=True).start()

    # ---- the training thread's side ---------------------------------------------
    def start(self, live: Captured, buddy: Address | None) -> None:
        """Snapshot ``live`` (at its version) and push its sharded part to ``buddy`` (None: no buddy).

        ``live`` is a capture made for this call: its live tensors are read until
        :meth:`wait_copied` returns, and the ones the capture copied become the snapshot's.
        """
        with self._cv:
            self._interrupted = False
            self._undelivered = None
            self._requests += 1
            self._todo = (live, buddy)
            self._requested = live.manifest.version
            self._push_target = live.manifest.version if buddy is not None else self._pushed
            self._cv.notify_all()

    def wait_copied(self) -> None:
        """Gate before a commit: the snapshot of the previous version no longer reads live memory."""
        self._wait(lambda: self._copied >= self._requested, "copying the snapshot")

    def wait_pushed(self) -> None:
        """Gate before a gradient collective: the previous version's buddy copy is acknowledged.

        Raises :class:`GateReleased` when that push failed, when :meth:`interrupt` is
        called meanwhile, or after the transfer timeout: never opened without the copy.
        """
        target = self._push_target

        def undelivered() -> bool:
            return self._undelivered is not None and self._undelivered[0] >= target

        with self._cv:
            done = self._cv.wait_for(
                lambda: self._pushed >= target or undelivered() or self._interrupted or self.error is not None, self._timeout
            )
            if self.error is not None:
                raise RuntimeError(f"torchpass: pushing the buddy copy failed: {self.error}") from self.error
            if self._pushed >= target:
                return
            if undelivered():
                assert self._undelivered is not None
                raise GateReleased(f"the buddy copy of step {self._undelivered[0]} could not be delivered: {self._undelivered[1]}")
            if self._interrupted:
                raise GateReleased(f"the generation ended while the buddy copy of step {target} was being pushed")
            assert not done
            raise GateReleased(f"pushing the buddy copy of step {target} took over {self._timeout:.0f} s")

    def interrupt(self) -> None:
        """The generation ended: give up a wait in :meth:`wait_pushed` (and any until the next :meth:`start`)."""
        with self._cv:
            self._interrupted = True
            self._cv.notify_all()

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: done() or self.error is not None, self._timeout):
                raise TimeoutError(f"torchpass: {what} took over {self._timeout:.0f} s")
            if self.error is not None:
                raise RuntimeError(f"torchpass: {what} failed: {self.error}") from self.error

    # ---- background -------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._todo is not None)
                assert self._todo is not None
                live, buddy = self._todo
                self._todo = None
                request = self._requests
                version = live.manifest.version
                reuse = None
                if len(self._snapshots) >= 2:
                    # Keep the newest complete snapshot intact while the next one is written.
                    oldest = min(self._snapshots)
                    old = self._snapshots.pop(oldest)
                    self._withdraw("snapshot", oldest)
                    if _layout_key(old) == _layout_key(live):
                        reuse = old.tensors
            try:
                snap = _copy_into(live, reuse)
                with self._cv:
                    self._snapshots[version] = snap
                    self._copied = version
                    # Every byte once: here, or by the capture for the tensors it had to copy.
                    self._account_push(PushBytes(copied=snap.manifest.nbytes), new=True)
                    self._cv.notify_all()
                self._publish(snap, "snapshot")
                if buddy is not None:
                    part = self._sharded_part(snap)
                    stats = self._link.push(buddy, self.rank, part, chunk_bytes=self._chunk_bytes, retries=self._retries)
                    with self._cv:
                        self._account_push(PushBytes(part.manifest.nbytes, 0, stats.checksummed, stats.nbytes), new=False)
            except (TransferError, OSError) as exc:
                # The buddy is gone (it failed, hangs, or is being replaced): this version is
                # not protected, so the gate that says it is must not open; the rank ends the
                # generation there and the migration re-pairs buddies. After training ended,
                # the buddy exiting first is expected, not news.
                if not self.finishing:
                    print(f"[torchpass] rank {self.rank}: buddy copy of step {version} not delivered: {exc}", flush=True)
                    with self._cv:
                        if request == self._requests:
                            self._undelivered = (version, str(exc)[:300])
                            self._cv.notify_all()
                    continue
            except BaseException as exc:  # surfaced on the training thread by the next gate
                with self._cv:
                    self.error = exc
                    self._cv.notify_all()
                return
            with self._cv:
                self._pushed = max(self._pushed, version)
                self._cv.notify_all()

    def _account_push(self, more: PushBytes, *, new: bool) -> None:
        """Add ``more`` to the latest push's counts (a new push when ``new``) and to the totals; holds the lock."""
        if new:
            self._pushes += 1
            self._last_push = PushBytes()
        self._last_push += more
        self._pushed_total += more

    def counters(self) -> BuddyCounters:
        """Bytes copied and checksummed by this rank's buddy work: its latest push and all, its latest held copy and all."""
        with self._cv:
            return BuddyCounters(self._pushes, self._last_push, self._pushed_total, self._holds, self._last_hold, self._held_total)

    def _sharded_part(self, snap: Captured) -> Captured:
        classes = snap.manifest.meta["classes"]
        components = rebuild(snap.manifest, snap.tensors)
        keep = {name: value for name, value in components.items() if classes[name] in self.classes_to_push}
        return capture(keep, {n: classes[n] for n in keep}, snap.manifest.version, meta={"classes": {n: classes[n] for n in keep}})

    # ---- recovery ---------------------------------------------------------------
    def snapshot_versions(self) -> list[int]:
        with self._cv:
            return sorted(v for v in self._snapshots if v <= self._copied)

    def snapshot(self, version: int) -> Captured | None:
        with self._cv:
            return self._snapshots.get(version) if version <= self._copied else None

    def held_versions(self) -> dict[int, list[int]]:
        with self._cv:
            return {src: sorted(copies) for src, copies in self._held.items()}

    # ---- the holder's side (called by the state server) --------------------------
    def hold_into(self, src: int, manifest: Any) -> list[torch.Tensor]:
        """Buffers for an incoming copy of ``src``: the older slot's when the layout matches."""
        with self._cv:
            slots = self._held.setdefault(src, {})
            if len(slots) >= 2:
                oldest = min(slots)
                old = slots.pop(oldest)
                self._withdraw(f"held:{src}", oldest)
                if tuple((e.name, e.dtype, e.shape) for e in old.manifest.entries) == tuple(
                    (e.name, e.dtype, e.shape) for e in manifest.entries
                ):
                    return old.tensors
        return [torch.empty(e.shape, dtype=getattr(torch, e.dtype)) for e in manifest.entries]

    def on_held(self, src: int, captured: Captured) -> None:
        """Install a copy of ``src``'s state as the state server hands it over: received in place and
        verified, with the CRC table that verified it (which counts the bytes checksummed)."""
        assert captured.crcs is not None  # the state server verified it on receipt
        checked = captured.crcs.checksummed
        with self._cv:
            self._held.setdefault(src, {})[captured.manifest.version] = captured
            self._holds += 1
            self._last_hold = PushBytes(pushed=captured.manifest.nbytes, checksummed=checked, transferred=checked)
            self._held_total += self._last_hold
        self._publish(captured, f"held:{src}")

    def forget_holdings_except(self, sources: set[int]) -> None:
        """Drop copies of ranks this rank no longer holds for (buddies were re-paired)."""
        with self._cv:
            for src in [s for s in self._held if s not in sources]:
                for version in self._held.pop(src):
                    self._withdraw(f"held:{src}", version)
