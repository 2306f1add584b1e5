"""Liveness: staleness on the observer's clock, the store watchdog against a stopped store, no orphan workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from torchpass.core.control import Heartbeat, Keys, try_get
from torchpass.core.liveness import BeatWatch, Heartbeater, StoreWatchdog, cpu_ticks

from tests.support.clock import ManualClock
from tests.support.harness import free_port
from tests.support.secret import SECRET


def test_an_unchanged_beat_ages_on_the_observers_clock_only() -> None:
    clock = ManualClock(100.0)
    watch = BeatWatch(clock)
    assert watch.age("n1", 7) == 0.0
    clock.now += 4.0
    assert watch.age("n1", 7) == 4.0
    # A new beat, whatever the writer's clock said when it wrote it, is fresh.
    assert watch.age("n1", 8) == 0.0
    clock.now += 1.5
    assert watch.age("n1", 8) == 1.5
    watch.forget("n1")
    assert watch.age("n1", 8) == 0.0


def test_old_beats_written_back_do_not_keep_a_silent_process_alive() -> None:
    """A stranger replaying genuine sealed beats (they open: same key, same secret) changes the value, not its age."""
    clock = ManualClock(100.0)
    watch = BeatWatch(clock)
    for seq in range(1, 6):
        watch.age("w", seq)
        clock.now += 1.0
    last_growth = clock.now - 1.0
    for replayed in (3, 4, 3, 4, 5):
        assert watch.age("w", replayed) == clock.now - last_growth
        clock.now += 1.0
    assert watch.age("w", 6) == 0.0
    # Progress marks are (generation, step): a rollback to an earlier step in a new generation is progress.
    assert watch.age("job", (0, 40)) == 0.0
    clock.now += 2.0
    assert watch.age("job", (0, 39)) == 2.0
    assert watch.age("job", (1, 38)) == 0.0


@pytest.fixture
def store_server():
    port = free_port()
    code = f"import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    yield port, proc
    os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait()


def test_the_watchdog_fires_when_a_stopped_store_stops_answering(store_server) -> None:
    """A request to a SIGSTOPped server never returns (whatever the client's timeout): only the watchdog bounds it."""
    port, server = store_server
    from torchpass.core.control import StoreAddress

    address = StoreAddress("127.0.0.1", port, SECRET)
    reader = address.connect()
    lost = threading.Event()
    silent: list[float] = []
    watchdog = StoreWatchdog(1.5, lambda s: (silent.append(s), lost.set()))
    beats = Heartbeater(address, "n0-a0", 0.2, lambda: (3, 0, "train"), watchdog)
    deadline = time.monotonic() + 20
    while try_get(reader, Keys.heartbeat("n0-a0"), Heartbeat) is None:
        assert time.monotonic() < deadline, "no heartbeat written"
        time.sleep(0.05)
    first = try_get(reader, Keys.heartbeat("n0-a0"), Heartbeat)
    assert first.step == 3 and first.seq >= 1
    time.sleep(2.0)
    assert not lost.is_set(), "the watchdog fired while the store answered"
    os.kill(server.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    noticed = lost.wait(10)
    waited = time.monotonic() - t0
    # Let the blocked beat fail and the thread end before the interpreter does.
    beats.stop()
    server.kill()
    os.kill(server.pid, signal.SIGCONT)
    beats.join(10)
    assert noticed, "a stopped store was never noticed"
    assert waited < 1.5 + 1.0 + 0.5 and silent[0] > 1.5
    assert not beats.is_alive()


def test_a_worker_dies_with_its_launcher(tmp_path) -> None:
    """The parent-death signal: SIGKILL the parent, and the child (in its own session) is gone too."""
    pid_file = tmp_path / "child.pid"
    child = textwrap.dedent(
        f"""
        import os, time
        from torchpass.core.liveness import die_with_parent
        die_with_parent(os.getppid())
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(600)
        """
    )
    parent = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        # A zombie reparented to init is reaped shortly; a live orphan would stay.
        assert time.monotonic() < deadline, f"worker {pid} outlived its launcher"
        time.sleep(0.05)


def test_cpu_ticks_grow_while_a_process_runs_and_stand_still_while_it_is_stopped():
    """The agent's second beat: a stopped worker's CPU time stands still, a busy one's grows."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        first = cpu_ticks(busy.pid)
        time.sleep(0.5)
        running = cpu_ticks(busy.pid)
        assert first is not None and running is not None and running > first
        busy.send_signal(signal.SIGSTOP)
        time.sleep(0.1)
        stopped = cpu_ticks(busy.pid)
        time.sleep(0.5)
        assert cpu_ticks(busy.pid) == stopped
    finally:
        busy.kill()
        busy.wait()
    assert cpu_ticks(busy.pid) is None  # reaped: gone from /proc


def test_a_worker_is_hung_only_when_its_heartbeat_and_its_cpu_time_both_stood_still_past_the_timeout():
    from torchpass.core.liveness import HangWatch

    clock = ManualClock()
    ticks: dict[int, int | None] = {1: 100, 2: 100, 3: None}
    watch = HangWatch(clock, lambda pid: ticks[pid])
    for pid in ticks:
        assert watch.hung(pid, pid, 1, 3.0) is None
    for _ in range(8):  # 4 s without a heartbeat; pid 1 keeps using CPU (starved of the GIL), pid 2 is stopped
        clock.now += 0.5
        ticks[1] += 10
        busy, stopped, unknown = (watch.hung(pid, pid, 1, 3.0) for pid in (1, 2, 3))
    assert busy is None
    assert stopped == "stopped heartbeating 4.0 s ago and used no CPU for 4.0 s (hung)"
    assert unknown == "stopped heartbeating 4.0 s ago and used no CPU for 4.0 s (hung)"  # no /proc: the heartbeat alone
    # pid 1 now stops too: hung once its CPU has stood still past the timeout
    for _ in range(6):
        clock.now += 0.5
        assert watch.hung(1, 1, 1, 3.0) is None
    clock.now += 0.5
    assert watch.hung(1, 1, 1, 3.0) == "stopped heartbeating 7.5 s ago and used no CPU for 3.5 s (hung)"
    assert watch.hung(2, 2, 2, 3.0) is None  # a new heartbeat
