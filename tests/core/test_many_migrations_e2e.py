"""Fifty migrations in one job leave a survivor's open files, threads and memory flat.

Each migration rebuilds every process group; the replaced gloo groups, with
their sockets and threads, must go once gloo has nothing of theirs in flight
(``RebuildableProcessGroup._bury``). The generations are ended from outside
without losing a process (a transient network failure, as the controller sees
it), so no spare is used up and the same survivor is sampled throughout.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from torchpass.core.control import Keys, connect

from tests.support.harness import JOBS, assert_bitwise, fault_free, launch

pytestmark = pytest.mark.e2e

MIGRATIONS = 50


def _resources(pid: int) -> tuple[int, int, int]:
    """(open fds, threads, RSS in MB) of a process."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return len(os.listdir(f"/proc/{pid}/fd")), int(status["Threads"]), int(status["VmRSS"].split()[0]) // 1024


def test_fifty_migrations_leave_fds_threads_and_rss_flat(tmp_path: Path) -> None:
    args = ["--steps", str(3 * MIGRATIONS + 20), "--workdir", ".", "--step-sleep", "0.05"]
    reference = fault_free(tmp_path / "reference", JOBS / "jobs_ddp.py", args, nproc=2, spares=0)
    run = launch(tmp_path / "migrated", JOBS / "jobs_ddp.py", args, nproc=2, spares=0)
    run.wait_step(0, 3)
    pids = run.active_pids()
    host, port = run.workers()["store"].rsplit(":", 1)
    store = connect(host, int(port))
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
    assert run.wait() == 0, run.explain()
    # Fifty re-executed steps later, still the fault-free run's state, losses and processes.
    results = run.results()
    assert_bitwise(results, reference)
    assert {r: results[r]["pid"] for r in pids} == pids
    print(f"[many-migrations] rank 0 (fds, threads, RSS MB): before {samples[0]}, after 1 {samples[1]}, "
          f"after 10 {samples[10]}, after {MIGRATIONS} {samples[-1]}")  # fmt: skip
    migrations = [m for m in run.migrations() if m["outcome"] == "success"]
    assert len(migrations) == MIGRATIONS, [m["outcome"] for m in run.migrations()]
    settled = samples[10]
    for n, (fds, threads, _) in enumerate(samples[10:], start=10):
        # One replaced group may still be in flight when sampled (gloo ends its last operations late).
        assert fds <= settled[0] + 4 and threads <= settled[1] + 3, f"after {n} migrations: {samples[n]} vs {settled} after 10"
    assert samples[-1][2] - settled[2] < 32, f"RSS grew from {settled[2]} MB to {samples[-1][2]} MB"
