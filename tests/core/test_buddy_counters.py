"""A buddy push costs one copy of the pushed bytes and one CRC32C pass per side, and says so.

Single process, real sockets: a pushing keeper and a holding keeper behind a
real state server. Mechanism only: the counters, and the memory they describe.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from torchpass.core.buddy import BuddyKeeper, PushBytes
from torchpass.core.manifest import Captured, capture, tensor_bytes
from torchpass.core.transfer import StateServer, fetch_state

from tests.support.secret import SECRET

CHUNK = 64 << 10  # the smallest chunk the config allows: a push of many chunks
CLASSES = {"optimizer": "optimizer"}


def _keeper(publish=lambda captured, copy: None) -> BuddyKeeper:
    return BuddyKeeper(
        rank=0, classes_to_push={"optimizer"}, chunk_bytes=CHUNK, retries=1, timeout=60.0, secret=SECRET,
        publish=publish, withdraw=lambda copy, version: None,
    )  # fmt: skip


def _live(version: int) -> Captured:
    g = torch.Generator().manual_seed(version)
    state = {
        "exp_avg": torch.randn(300, 500, generator=g),  # 600 KB: ten chunks
        "exp_avg_sq": torch.randn(500, 300, generator=g).t(),  # non-contiguous: the capture copies it
        "step": torch.tensor(float(version)),
    }
    return capture({"optimizer": state}, CLASSES, version, meta={"classes": CLASSES})


@pytest.fixture
def holder() -> Iterator[tuple[BuddyKeeper, StateServer, list[Captured]]]:
    """A holding keeper behind a state server, and every copy it published."""
    published: list[Captured] = []
    server_box: list[StateServer] = []

    def publish(captured: Captured, copy: str) -> None:
        published.append(captured)
        server_box[0].publish(captured, copy)

    keeper = _keeper(publish)
    server = StateServer(secret=SECRET, hold_into=keeper.hold_into, on_held=keeper.on_held, chunk_bytes=CHUNK)
    server_box.append(server)
    yield keeper, server, published
    server.close()


def test_a_buddy_push_copies_each_byte_once_and_checksums_it_once_per_side(holder) -> None:
    keeper, server, _ = holder
    sender = _keeper()
    live = _live(1)
    n = live.manifest.nbytes
    sender.start(live, server.address)
    sender.wait_pushed()
    assert sender.counters().last_push == PushBytes(pushed=n, copied=n, checksummed=n, transferred=n)
    assert keeper.counters().last_hold == PushBytes(pushed=n, copied=0, checksummed=n, transferred=n)

    snap = sender.snapshot(1)
    assert snap is not None
    for i, (taken, original) in enumerate(zip(snap.tensors, live.tensors)):
        if i in live.private:  # the capture's copy is the snapshot's: not copied a second time
            assert taken is original
        else:
            assert taken.data_ptr() != original.data_ptr()
        assert bytes(tensor_bytes(taken)) == bytes(tensor_bytes(original))

    sender.start(_live(2), server.address)
    sender.wait_pushed()
    sent, held = sender.counters(), keeper.counters()
    assert (sent.pushes, held.holds) == (2, 2)
    assert sent.pushed_total == PushBytes(pushed=2 * n, copied=2 * n, checksummed=2 * n, transferred=2 * n)
    assert held.held_total == PushBytes(pushed=2 * n, copied=0, checksummed=2 * n, transferred=2 * n)
    assert held.pushes == 0 and sent.holds == 0


def test_a_held_copy_is_served_on_the_crcs_its_holder_verified(holder) -> None:
    """A migration reading a buddy copy costs its holder no second checksum pass."""
    _, server, published = holder
    sender = _keeper()
    live = _live(3)
    sender.start(live, server.address)
    sender.wait_pushed()
    (held,) = published
    assert held.crcs is not None and held.crcs.checksummed == live.manifest.nbytes
    _, tensors, stats = fetch_state([(server.address, "held:0")], 3, chunk_bytes=CHUNK, timeout=20.0, secret=SECRET)
    assert stats.nbytes == stats.checksummed == live.manifest.nbytes  # the receiver verified each byte once
    assert held.crcs.checksummed == live.manifest.nbytes  # the holder computed nothing more to send it
    for got, want in zip(tensors, live.tensors):
        assert bytes(tensor_bytes(got)) == bytes(tensor_bytes(want))
