"""Strangers at a live job's ports: without the job secret they change nothing, read nothing and run nothing.

One two-node job (ZeroRedundancyOptimizer, so snapshots and buddy copies are
served too) trains while a process without the secret attacks every way in:

* the store: for every record the controller, agents and workers act on (the
  event mailbox: migrate, drain, node drain, exit with an error, hung,
  comm_error, crash; a fence in a node's mail; shutdown; a generation's end,
  plan, go and readiness; a spare's assignment; a node declared lost; mirror
  records), the record unsigned,
  signed with another secret, and a genuine sealed record replayed at another
  key or generation; pickles that would run code, at every key a component
  unpickled before;
* every rank's state server: asking for ``live``, ``snapshot`` and ``held``
  copies without the secret, random bytes, an oversized length; the same
  bytes at the store port;
* ``torchpass migrate`` with no secret (refused, naming the ways to give it)
  and with a wrong one (a request nobody acts on).

The job must end exactly as the fault-free run does: bitwise equal state and
losses, the same PIDs, no migration in the ledger, and no canary file.

A genuine record replayed at its *own* key opens (same key, same secret), so
the records a process rewrites in place carry what makes an old one stale:
heartbeats a growing sequence and step, rank addresses their generation. The
second case hangs a rank while a stranger writes its old heartbeats back in
turn: the hang must still be caught by its heartbeat and migrated, not hidden.

Not attacked here, because no authentication can stop it on torch's TCPStore:
overwriting a key the job writes once (its config, the generation counter)
with garbage denies that value to readers. A stranger who can reach the store
can delay a job; it cannot steer it (docs/design.md, section 12b).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from torchpass.core.control import Keys, Plan, Ready, Report
from torchpass.core.signed_store import MAGIC, seal

from tests.support.harness import JOBS, assert_bitwise, assert_migrated, fault_free, launch

pytestmark = pytest.mark.e2e

STEPS = 60
ARGS = ["--steps", str(STEPS), "--workdir", ".", "--step-sleep", "0.2", "--zero"]
LAYOUT = {"nproc": 2, "nnodes": 2, "spares": 1}
WRONG = b"a-guess-at-the-job-secret-000000"


class _Canary:
    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _json(record) -> bytes:
    return json.dumps(dataclasses.asdict(record) if dataclasses.is_dataclass(record) else record).encode()


def _forgeries(key: str, value: bytes, genuine: tuple[str, bytes]) -> list[bytes]:
    """The three ways a stranger can write ``value`` at ``key``; the last replays a genuine sealed record."""
    return [value, seal(WRONG, key, value), genuine[1]]


def _attack_store(raw: dist.TCPStore, workers: dict, canary: Path) -> tuple[int, int]:
    """Write every forged record; returns how many were written, and how many of them went to the event mailbox."""
    rows = workers["workers"]
    spare = next(w["wid"] for w in rows if w["role"] == "spare")
    actives = {w["rank"]: w["wid"] for w in rows if w["role"] == "active"}
    # A genuine record the job wrote (sealed), replayed at every other key: the seal binds its key.
    genuine = (Keys.heartbeat(actives[0]), raw.get(Keys.heartbeat(actives[0])))
    hostile = pickle.dumps(_Canary(canary))
    g = 0
    reports = [
        Report("migrate", rank=1, detail={"signal": "operator"}),
        Report("drain", wid=actives[0], rank=0, generation=g),
        Report("node_drain", node=1),
        Report("exit", wid=actives[1], rank=1, generation=g, detail={"code": 1, "error": "forged"}),
        Report("hung", wid=actives[2], rank=2, generation=g),
        Report("comm_error", wid=actives[3], rank=3, generation=g, detail={"error": "Connection closed by peer"}),
        Report("crash", wid=actives[0], rank=0, generation=g),
    ]
    plan = Plan(generation=g + 1, target_version=0, joins={"0": spare}, ranks={}, addresses={}, cause="forged")
    writes: list[tuple[str, bytes]] = []
    for report in reports:
        for forged in _forgeries("", _json(report), genuine):
            n = raw.add(f"{Keys.events}/seq", 1)
            writes.append((f"{Keys.events}/{n}", forged))
        n = raw.add(f"{Keys.events}/seq", 1)
        writes.append((f"{Keys.events}/{n}", hostile))
    for node in (0, 1):
        for record in ({"fence": actives[node * 2]}, hostile):
            body = record if isinstance(record, bytes) else _json(record)
            n = raw.add(f"{Keys.node_mail(node)}/seq", 1)
            writes.append((f"{Keys.node_mail(node)}/{n}", body))
    singles = {
        Keys.shutdown: b"forged: stop the job",
        Keys.end(g): b"forged: end the generation",
        Keys.plan(g + 1): _json(plan),
        Keys.go(g + 1): b"go",
        Keys.ready(g + 1, 0): _json(Ready(spare, g + 1)),
        Keys.assign(spare): json.dumps({"rank": 0, "generation": g + 1}).encode(),
        Keys.node_lost(1): b"forged: declared lost",
    }
    for key, value in singles.items():
        for forged in _forgeries(key, value, genuine):
            writes.append((key, forged))
        writes.append((key, hostile))
    for rank in range(4):
        for slot in range(3):
            writes.append((Keys.mirror(rank, slot), hostile))
    for key, value in writes:
        raw.set(key, value)
    return len(writes), sum(key.startswith(f"{Keys.events}/") for key, _ in writes)


def _closed_without_a_reply(sock: socket.socket) -> bool:
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data == b""


def _attack_ports(raw: dist.TCPStore, workers: dict, store_port: int) -> None:
    rnd = random.Random(11)
    # Sealed, not encrypted: a stranger reads each worker's record, state-server address included.
    records = [json.loads(raw.get(Keys.worker(w["wid"]))[len(MAGIC) + 32 :]) for w in workers["workers"]]
    addresses = [tuple(r["transfer_addr"]) for r in records if r.get("transfer_addr")]
    assert len(addresses) == len(records)
    for host, port in addresses:
        for request in (
            {"op": "manifest", "copy": "live", "version": 1},
            {"op": "chunks", "copy": "snapshot", "version": 1, "chunks": [[0, 0, 64]]},
            {"op": "manifest", "copy": "held:0", "version": 1},
        ):
            with socket.create_connection((host, port), timeout=15) as sock:
                assert len(sock.recv(64)) == 32  # the server's nonce, then nothing without a proof
                body = json.dumps(request).encode()
                sock.sendall(b"\0" * 64 + len(body).to_bytes(8, "little") + body)
                assert _closed_without_a_reply(sock), (host, port, request)
        for _ in range(5):
            with socket.create_connection((host, port), timeout=15) as sock:
                assert len(sock.recv(64)) == 32
                try:
                    sock.sendall(rnd.randbytes(rnd.randint(1, 4096)))
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    continue  # the server closed on the first 64 bytes: a reset, nothing sent back
                assert _closed_without_a_reply(sock)
    # torch's TCPStore server: garbage and a huge key length (it must neither die nor allocate what is claimed).
    for payload in [rnd.randbytes(rnd.randint(1, 4096)) for _ in range(20)] + [b"\x00" + (1 << 62).to_bytes(8, "little") + b"x" * 64]:
        with socket.create_connection(("127.0.0.1", store_port), timeout=15) as sock:
            sock.sendall(payload)


def _rss_mb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) // 1024


def _migrate(run_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchpass.core.cli", "migrate", "--run-dir", str(run_dir), "--rank", "1"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )  # fmt: skip


def test_a_stranger_without_the_secret_changes_reads_and_runs_nothing(tmp_path: Path) -> None:
    reference = fault_free(tmp_path / "reference", JOBS / "jobs_ddp.py", ARGS, **LAYOUT)
    run = launch(tmp_path / "attacked", JOBS / "jobs_ddp.py", ARGS, **LAYOUT)
    canary = tmp_path / "canary"
    try:
        run.wait_step(0, 4)
        pids = run.active_pids()
        workers = run.workers()
        host, port = workers["store"].rsplit(":", 1)
        raw = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
        nobody = {"TORCHPASS_SECRET": "", "XDG_RUNTIME_DIR": str(tmp_path / "another-user")}
        refused = _migrate(run.run_dir, nobody)
        wrong = _migrate(run.run_dir, {"TORCHPASS_SECRET": WRONG.decode()})
        rss_before = _rss_mb(run.procs[0].pid)
        written, to_the_controller = _attack_store(raw, workers, canary)
        _attack_ports(raw, workers, int(port))
        rss_after = _rss_mb(run.procs[0].pid)
        assert run.step_of(0) < STEPS, "the job ended before the attack did: give it more steps"
        assert run.wait() == 0, run.explain()
    finally:
        run.kill()
    assert refused.returncode != 0 and "no secret for the job" in refused.stderr and "--secret-file" in refused.stderr, refused
    assert wrong.returncode == 0, wrong.stderr  # it cannot know: the controller never sees the request
    results = run.results()
    assert_bitwise(results, reference)
    assert {r: results[r]["pid"] for r in pids} == pids
    assert run.migrations() == [], run.explain()
    assert not canary.exists(), "a stranger's pickle ran"
    output = run.output()
    assert "not sealed with this job's secret: ignored" in output
    assert "refused a connection" in output
    # Logged once, counted: a stranger cannot flood the console or the ledger.
    assert output.count("ignoring record") == 1, output
    end = next(e for e in run.ledger() if e["type"] == "job_end")
    assert end["detail"]["forged_records"] == to_the_controller + 1, end  # and the request `migrate` sealed wrongly
    assert rss_after - rss_before < 64, f"node 0's launcher (the store) grew from {rss_before} MB to {rss_after} MB"
    print(f"[hostile] {written} forged store writes, {len(workers['workers'])} workers' ports probed: no effect")


DDP_ARGS = ["--steps", "20", "--workdir", ".", "--step-sleep", "0.2"]


def test_old_heartbeats_written_back_do_not_hide_a_hung_rank(tmp_path: Path) -> None:
    reference = fault_free(tmp_path / "reference", JOBS / "jobs_ddp.py", DDP_ARGS, nproc=2)
    run = launch(tmp_path / "replayed", JOBS / "jobs_ddp.py", DDP_ARGS, nproc=2)
    stop = threading.Event()
    try:
        run.wait_step(1, 4)
        pids = run.active_pids()
        wid = next(w["wid"] for w in run.workers()["workers"] if w["rank"] == 1 and w["role"] == "active")
        host, port = run.workers()["store"].rsplit(":", 1)
        raw = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
        captured: list[bytes] = []
        while len(captured) < 4:  # four distinct sealed beats (0.5 s apart under fast_detect)
            beat = raw.get(Keys.heartbeat(wid))
            if beat not in captured:
                captured.append(beat)
            time.sleep(0.1)
        run.inject("hang", rank=1)

        def replay() -> None:
            n = 0
            while not stop.wait(0.1):
                try:
                    raw.set(Keys.heartbeat(wid), captured[n % len(captured)])  # each one changes the value
                except dist.DistError:
                    return  # the job ended and took its store with it
                n += 1

        threading.Thread(target=replay, daemon=True).start()
        last = assert_migrated(run, reference, pids, {1}, "hang", max_steps_lost=0)
    finally:
        stop.set()
        run.kill()
    assert last["failed_ranks"] == [1], last
