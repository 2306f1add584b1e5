"""Fifty migrations in one job leave a survivor's open files, threads and memory flat.

Each migration rebuilds every process group; the replaced gloo groups, with
their sockets and threads, must go once gloo has nothing of theirs in flight
(``comms._Graveyard``). An operation caught mid-message by a release ends only
at gloo's own timeout (the process group's ``timeout``; gloo never signals it),
so its group may outlive the migration by that long, never longer: the job runs
with a short group timeout, and the survivor must be back to its settled level
within it once the migrations stop. The generations are ended from outside
without losing a process (a transient network failure, as the controller sees
it), so no spare is used up and the same survivor is sampled throughout.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from torchpass.core.comms import _Graveyard
from torchpass.core.control import Keys

from tests.support.harness import JOBS, assert_bitwise, fault_free, launch

pytestmark = pytest.mark.e2e

MIGRATIONS = 50
PG_TIMEOUT_S = 8


def _resources(pid: int) -> tuple[int, int, int]:
    """(open fds, threads, RSS in MB) of a process."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return len(os.listdir(f"/proc/{pid}/fd")), int(status["Threads"]), int(status["VmRSS"].split()[0]) // 1024


def _describe(pid: int) -> str:
    """Thread names and open files of a process: what a failed flatness check held."""
    threads = sorted(Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() for tid in os.listdir(f"/proc/{pid}/task"))
    fds = []
    for fd in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
        try:
            fds.append(f"{fd}->{os.readlink(f'/proc/{pid}/fd/{fd}')}")
        except FileNotFoundError:
            continue  # closed while listed
    return f"threads {threads}; fds {fds}"


def test_fifty_migrations_leave_fds_threads_and_rss_flat(tmp_path: Path) -> None:
    # Enough steps after the last migration for gloo's timeout to end what the releases caught mid-message.
    steps = ["--steps", str(3 * MIGRATIONS + 400), "--workdir", ".", "--pg-timeout-s", str(PG_TIMEOUT_S)]
    args = steps + ["--step-sleep", "0.05"]
    reference = fault_free(tmp_path / "reference", JOBS / "jobs_ddp.py", steps + ["--step-sleep", "0"], nproc=2, spares=0)
    run = launch(tmp_path / "migrated", JOBS / "jobs_ddp.py", args, nproc=2, spares=0)
    run.wait_step(0, 3)
    pids = run.active_pids()
    store = run.store()
    pid = run.active_pids()[0]
    samples = [_resources(pid)]
    for i in range(MIGRATIONS):
        g = int(json.loads(store.get(Keys.gen)))
        store.compare_set(Keys.end(g), "", f"test: transient network failure {i + 1}")
        deadline = time.time() + 60
        # The migration is closed (every member reported done) before the next generation is ended.
        while len([m for m in run.migrations() if m["outcome"] == "success"]) < i + 1:
            assert time.time() < deadline, run.explain()
            time.sleep(0.05)
        samples.append(_resources(pid))
    # The steady level: one live transport per group (a sample may also hold a group still being let go).
    settled = (min(fds for fds, _, _ in samples[1:]), min(threads for _, threads, _ in samples[1:]), samples[10][2])
    # What gloo still runs for a released group ends at its timeout; the graveyard lets that group go then.
    deadline = time.time() + PG_TIMEOUT_S + 3 * _Graveyard.SWEEP_INTERVAL_S + 5
    while ((now := _resources(pid))[0] > settled[0] or now[1] > settled[1]) and time.time() < deadline:
        time.sleep(0.2)
    held = _describe(pid)
    assert run.wait() == 0, run.explain()
    # Fifty re-executed steps later, still the fault-free run's state, losses and processes.
    results = run.results()
    assert_bitwise(results, reference)
    assert {r: results[r]["pid"] for r in pids} == pids
    print(f"[many-migrations] rank 0 (fds, threads, RSS MB): before {samples[0]}, after 1 {samples[1]}, "
          f"after 10 {samples[10]}, after {MIGRATIONS} {samples[-1]}, steady {settled}, then {now}")  # fmt: skip
    migrations = [m for m in run.migrations() if m["outcome"] == "success"]
    assert len(migrations) == MIGRATIONS, [m["outcome"] for m in run.migrations()]
    fds, threads, rss = now
    assert fds <= settled[0] and threads <= settled[1], f"{PG_TIMEOUT_S} s after {MIGRATIONS} migrations: {now} vs {settled} steady; {held}"
    assert rss - settled[2] < 32, f"RSS grew from {settled[2]} MB to {rss} MB"
