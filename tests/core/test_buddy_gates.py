"""The buddy-push gate opens only on a delivered copy, and the end of a generation releases it.

Single process, real sockets: a holder address where nothing listens (the buddy
died) and a holder that accepts the connection but never answers (the buddy is
SIGSTOPped or partitioned).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import torch

from torchpass.core.buddy import BuddyKeeper, GateReleased
from torchpass.core.manifest import capture

from tests.support.secret import SECRET
from torchpass.core.free_port import free_port


def _keeper(timeout: float = 3600.0) -> BuddyKeeper:
    return BuddyKeeper(
        rank=0, classes_to_push={"optimizer"}, chunk_bytes=1 << 20, retries=1, timeout=timeout, secret=SECRET,
        publish=lambda captured, copy: None, withdraw=lambda copy, version: None,
    )  # fmt: skip


def _state(version: int):
    classes = {"optimizer": "optimizer"}
    return capture({"optimizer": {"m": torch.arange(8.0)}}, classes, version, meta={"classes": classes})



@pytest.fixture
def silent_holder() -> Iterator[tuple[str, int]]:
    """A holder that accepts connections and never reads or answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()
    try:
        yield server.getsockname()
    finally:
        for conn in accepted:
            conn.close()
        server.close()


def _wait_in_thread(keeper: BuddyKeeper) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            keeper.wait_pushed()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            raised.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread, raised


def test_a_failed_push_gives_the_gate_up_instead_of_opening_it() -> None:
    keeper = _keeper()
    keeper.start(_state(3), ("127.0.0.1", free_port()))  # nothing listens: the buddy is gone
    with pytest.raises(GateReleased, match="buddy copy of step 3 could not be delivered"):
        keeper.wait_pushed()


def test_the_end_of_the_generation_releases_a_rank_waiting_on_a_hung_buddy(silent_holder: tuple[str, int]) -> None:
    keeper = _keeper()
    keeper.start(_state(5), silent_holder)
    thread, raised = _wait_in_thread(keeper)
    thread.join(0.5)
    assert thread.is_alive(), "the gate opened although the holder never acknowledged the copy"
    keeper.interrupt()
    thread.join(30)
    assert not thread.is_alive(), "the end of the generation did not release the gate"
    assert len(raised) == 1 and isinstance(raised[0], GateReleased) and "generation ended" in str(raised[0])


def test_a_delivered_copy_opens_the_gate() -> None:
    holder = _keeper()
    from torchpass.core.transfer import StateServer

    server = StateServer(secret=SECRET, host="127.0.0.1", hold_into=holder.hold_into, on_held=holder.on_held)
    try:
        keeper = _keeper()
        keeper.start(_state(7), server.address)
        keeper.wait_pushed()
        assert holder.held_versions() == {0: [7]}
    finally:
        server.close()


def test_a_new_push_supersedes_the_failure_of_the_one_before(silent_holder: tuple[str, int]) -> None:
    """After a migration the rank pushes the same version to its new buddy: the old buddy's failure is history."""
    holder = _keeper()
    from torchpass.core.transfer import StateServer

    server = StateServer(secret=SECRET, host="127.0.0.1", hold_into=holder.hold_into, on_held=holder.on_held)
    try:
        keeper = _keeper()
        keeper.start(_state(4), ("127.0.0.1", free_port()))  # the old buddy is dead
        with pytest.raises(GateReleased):
            keeper.wait_pushed()
        keeper.start(_state(4), server.address)  # re-paired after the migration
        keeper.wait_pushed()
        assert holder.held_versions() == {0: [4]}
    finally:
        server.close()


def test_a_copy_is_listed_as_held_before_its_push_is_acknowledged() -> None:
    """Once the pusher's gate opens, the holder reports the copy: a migration may ask at once."""
    import time

    from torchpass.core.transfer import StateServer

    holder = _keeper()

    def slow_on_held(src, captured) -> None:
        time.sleep(0.5)  # the holder thread is descheduled right after the last chunk arrived
        holder.on_held(src, captured)

    server = StateServer(secret=SECRET, host="127.0.0.1", hold_into=holder.hold_into, on_held=slow_on_held)
    try:
        keeper = _keeper()
        keeper.start(_state(9), server.address)
        keeper.wait_pushed()
        assert holder.held_versions() == {0: [9]}
    finally:
        server.close()
