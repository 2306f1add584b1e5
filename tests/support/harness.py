"""Drive real ``torchpass launch`` jobs from tests: start, time faults by step, inject, collect, compare.

Faults go through ``torchpass inject`` (the product's own command) and are
timed by the ``progress/rank<r>`` files the test jobs write at each step start.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from torchpass.core.inject import inject as inject_fault
from torchpass.core.free_port import free_port

K = TypeVar("K")
V = TypeVar("V")

REPO = Path(__file__).resolve().parents[2]
JOBS = Path(__file__).resolve().parent



def fault_rng(name: str) -> random.Random:
    """A seeded RNG for fault times; the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("TORCHPASS_TEST_SEED", random.randrange(1 << 30)))
    print(f"[{name}] fault seed {seed} (set TORCHPASS_TEST_SEED={seed} to replay)")
    return random.Random(seed)


@dataclass
class JobRun:
    workdir: Path
    procs: list[subprocess.Popen]
    logs: list[Path]
    run_dir: Path
    secret_file: Path | None = None
    """The secret every node was given (multi-node jobs); a single-node job generated its own."""
    started: float = field(default_factory=time.time)
    lost_nodes: set[int] = field(default_factory=set)
    """Nodes whose launcher the test killed with its host: ``wait`` answers with the first other launcher's code."""

    def store(self) -> Any:
        """A client of the job's store, holding the job's secret as an operator's command does."""
        from torchpass.core.control import StoreAddress
        from torchpass.core.job_secret import for_operator

        host, port = self.workers()["store"].rsplit(":", 1)
        return StoreAddress(host, int(port), for_operator(self.run_dir, self.secret_file and str(self.secret_file))).connect(timeout=30.0)

    # ---- observing -----------------------------------------------------------
    def step_of(self, rank: int) -> int:
        try:
            return int((self.workdir / "progress" / f"rank{rank}").read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def wait_step(self, rank: int, step: int, timeout: float = 120.0) -> None:
        deadline = time.time() + timeout
        while self.step_of(rank) < step:
            if any(p.poll() is not None for i, p in enumerate(self.procs) if i not in self.lost_nodes):
                raise AssertionError(f"job ended before rank {rank} reached step {step}:\n{self.output()[-3000:]}")
            if time.time() > deadline:
                raise AssertionError(f"rank {rank} did not reach step {step} in {timeout} s:\n{self.output()[-3000:]}")
            time.sleep(0.02)

    def wait_for_line(self, text: str, timeout: float = 120.0) -> None:
        deadline = time.time() + timeout
        while text not in self.output():
            if time.time() > deadline:
                raise AssertionError(f"{text!r} never appeared:\n{self.output()[-3000:]}")
            time.sleep(0.02)

    def workers(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "workers.json").read_text())

    def active_pids(self) -> dict[int, int]:
        return {w["rank"]: w["pid"] for w in self.workers()["workers"] if w["role"] == "active"}

    def wait_active_pids(self, n: int, timeout: float = 60.0) -> dict[int, int]:
        """The PIDs of the first ``n`` active ranks, read as soon as the launcher lists them (before any fault)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            path = self.run_dir / "workers.json"
            pids = self.active_pids() if path.exists() else {}
            if len(pids) >= n:
                return pids
            time.sleep(0.05)
        raise AssertionError(f"the launcher did not list {n} active ranks within {timeout:.0f} s:\n{self.output()[-3000:]}")

    def output(self) -> str:
        return "\n".join(log.read_text(errors="replace") for log in self.logs if log.exists())

    def explain(self, tail: int = 4000) -> str:
        """For a failed assertion: the launcher's own lines (what the controller decided), then the log's tail.

        A fenced rank's stack dump is long; the tail alone would hide the decisions behind it.
        """
        text = self.output()
        narrative = [line for line in text.splitlines() if line.startswith("[torchpass node") or line.startswith("torchpass:")]
        return "\n".join(narrative) + "\n--- tail ---\n" + text[-tail:]

    # ---- acting --------------------------------------------------------------
    def inject(self, fault: str, *, rank: int | None = None, worker: str | None = None) -> None:
        # The function behind `torchpass inject`, called in-process: a CLI subprocess
        # would land the fault a second later than the step the test chose.
        inject_fault(self.run_dir, fault, rank=rank, wid=worker)

    def wait(self, timeout: float = 240.0) -> int:
        deadline = time.time() + timeout
        for p in self.procs:
            try:
                p.wait(max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"job did not finish in {timeout} s:\n{self.explain()}") from None
        return next(p.returncode for i, p in enumerate(self.procs) if i not in self.lost_nodes)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    # ---- results -------------------------------------------------------------
    def results(self) -> dict[int, dict[str, Any]]:
        """Per rank: final digest and PID, and the loss of every step from whichever process ran it.

        A step re-executed after a migration appears twice only if its first run
        reached the loss line; both runs must then agree, which is checked here.
        Jobs whose probe records gradient norms (``grad_norms/``) get those too,
        under the same rule.
        """
        out: dict[int, dict[str, Any]] = {}
        for f in sorted((self.workdir / "out").glob("rank*.json")):
            out[int(f.stem[4:])] = json.loads(f.read_text())
        for folder, key, name in (("losses", "loss", "losses"), ("grad_norms", "grad_norm", "grad_norms")):
            for f in sorted((self.workdir / folder).glob("rank*.jsonl")):
                rank = int(f.stem[4:])
                curve: dict[int, float] = {}
                for line in f.read_text().splitlines():
                    if not line.strip():
                        continue
                    rec = json.loads(line)
                    if rec["step"] in curve:
                        assert curve[rec["step"]] == rec[key], f"rank {rank} step {rec['step']} ran twice with different {name}"
                    curve[rec["step"]] = rec[key]
                out.setdefault(rank, {})[name] = curve
        return out

    def ledger(self) -> list[dict[str, Any]]:
        path = self.run_dir / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def migrations(self) -> list[dict[str, Any]]:
        return [e for e in self.ledger() if e["type"] == "migration"]

    def report(self) -> dict[str, Any]:
        res = subprocess.run(
            [sys.executable, "-m", "torchpass.core.cli", "report", "--run-dir", str(self.run_dir), "--json"],
            check=True,
            capture_output=True,
            text=True,
        )
        return json.loads(res.stdout)

    def stray_files(self) -> list[str]:
        """Files the job wrote outside its progress, output and run directories (checkpoints, say)."""
        allowed = {"progress", "out", "losses", "logged_losses", "grad_norms", "run", "job.secret", *(log.name for log in self.logs)}
        return sorted(str(p.relative_to(self.workdir)) for p in self.workdir.iterdir() if p.name not in allowed)


def launch(
    workdir: Path,
    script: str | Path,
    script_args: list[str],
    *,
    nproc: int = 4,
    spares: int = 1,
    nnodes: int = 1,
    node_spares: list[int] | None = None,
    config: str = "fast_detect",
    extra: list[str] | None = None,
    module: bool = False,
    env: dict[str, str] | None = None,
    srun: list[str] | None = None,
    node_env: list[dict[str, str]] | None = None,
    hosts: Any = None,
) -> JobRun:
    """Start a job (one launcher per node, all on this machine) with its cwd in ``workdir``.

    With ``srun`` (its command and options), one ``srun`` starts every node's launcher instead, and each
    launcher takes its node count, node rank and node 0's address from the step (``core/slurm.py``).
    ``node_env``: each node's launcher's own additions to ``env`` (a node name, say).
    ``hosts``: a :class:`tests.support.netns.Hosts`; node ``i``'s launcher runs on its host ``i`` and node 0's
    address is host 0's."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    run_dir = workdir / "run"
    procs, logs = [], []
    secret_file = None
    if nnodes > 1:
        # Every node reads one secret, as from a shared file system (a single node generates its own).
        secret_file = workdir / "job.secret"
        secret_file.write_text(secrets.token_hex(32))
        secret_file.chmod(0o600)
        extra = ["--secret-file", str(secret_file), *(extra or [])]
    for node in range(1 if srun else nnodes):
        node_spare = (node_spares or [spares] * nnodes)[node]
        master = hosts.addrs[0] if hosts is not None else "127.0.0.1"
        placement = [] if srun else ["--nnodes", str(nnodes), "--node-rank", str(node), "--master-addr", master]
        cmd = [
            *(srun or []), *(hosts.prefix(node) if hosts is not None else []), sys.executable, "-m", "torchpass.core.cli", "launch", *placement, "--nproc-per-node", str(nproc),
            "--spares-per-node", str(node_spare), "--master-port", str(port),
            "--run-dir", str(run_dir), "--config", config, *(extra or []),
            *(["-m", str(script)] if module else [str(script)]), *script_args,
        ]  # fmt: skip
        log = workdir / f"launcher{node}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}), **(node_env[node] if node_env else {})}
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests" / ".."), full_env.get("PYTHONPATH", "")]))
        procs.append(
            subprocess.Popen(cmd, cwd=workdir, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=full_env)
        )
        logs.append(log)
        if node == 0:
            _wait_file(run_dir / "events.jsonl", procs[0], log)
    return JobRun(workdir, procs, logs, run_dir, secret_file)


PACING_FLAGS = ("--step-sleep", "--test-step-sleep")
"""Test-job flags that only pace a run (a sleep in each step, so that a fault lands mid-job): no value the job
computes depends on them."""


def unpaced(script_args: list[str]) -> list[str]:
    """``script_args`` with every pacing sleep set to 0: a fault-free reference has no fault to wait for."""
    return ["0" if i and script_args[i - 1] in PACING_FLAGS else arg for i, arg in enumerate(script_args)]


def fault_free(workdir: Path, script: str | Path, script_args: list[str], **kwargs: Any) -> dict[int, dict[str, Any]]:
    """The results of a run without faults (the oracle a faulted run is compared with); fails if it migrated.

    It runs unpaced: the faulted run sleeps in each step so that its fault lands mid-job, which changes no value."""
    run = launch(workdir, script, unpaced(script_args), **kwargs)
    assert run.wait() == 0, run.output()[-3000:]
    assert not run.migrations(), run.explain()
    return run.results()


def _wait_file(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None or time.time() > deadline:
            raise AssertionError(f"launcher did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


class RunOnce(Generic[K, V]):
    """Values computed once on first use and kept: a module's fault-free reference runs, keyed by job."""

    def __init__(self, compute: Callable[[K], V]):
        self._compute = compute
        self._values: dict[K, V] = {}

    def __getitem__(self, key: K) -> V:
        if key not in self._values:
            self._values[key] = self._compute(key)
        return self._values[key]


def assert_bitwise(run: dict[int, dict[str, Any]], reference: dict[int, dict[str, Any]]) -> None:
    """Every rank's final state digest and every step's loss (and gradient norm, where recorded) equal the fault-free run's, bit for bit."""
    assert sorted(run) == sorted(reference), f"ranks {sorted(run)} vs reference {sorted(reference)}"
    for rank, ref in reference.items():
        got = run[rank]
        assert got["digest"] == ref["digest"], f"rank {rank}: final model/optimizer state differs from the fault-free run"
        for curve, what in (("losses", "loss"), ("grad_norms", "grad norm")):
            if curve not in ref:
                continue
            assert sorted(got[curve]) == sorted(ref[curve]), (
                f"rank {rank}: steps with a {what} {sorted(set(ref[curve]) ^ set(got[curve]))} differ from the fault-free run"
            )
            for step, value in ref[curve].items():
                assert got[curve][step] == value, f"rank {rank} step {step}: {what} {got[curve][step]!r} != fault-free {value!r}"


def assert_migrated(
    run: JobRun, reference: dict[int, dict[str, Any]], pids_before: dict[int, int], replaced: set[int], cause: str, max_steps_lost: int
) -> dict[str, Any]:
    """The semantics contract after a fault: clean exit, bitwise equal to ``reference``, survivors' PIDs kept,
    no stray files, a qualifying successful migration of at most ``replaced`` ranks in the ledger and in
    ``torchpass report``. Returns the last successful migration's ledger entry."""
    assert run.wait() == 0, run.explain()
    results = run.results()
    assert_bitwise(results, reference)
    for rank, pid in pids_before.items():
        if rank in replaced:
            assert results[rank]["pid"] != pid, f"rank {rank} should run in a spare now"
        else:
            assert results[rank]["pid"] == pid, f"survivor rank {rank} changed PID {pid} -> {results[rank]['pid']}"
    assert run.stray_files() == [], "the job wrote files besides its outputs (a checkpoint?)"
    done = [m for m in run.migrations() if m["outcome"] == "success"]
    assert done, run.explain()
    assert not any(m.get("fenced") for m in done), f"one fault cost a survivor too: {[m['fenced'] for m in done]}"
    last = done[-1]
    assert last["cause"] == cause and last["classification"] == "qualifying", last
    assert set(map(int, last["replaced"])) <= replaced
    # Replicated state resumes exactly where it stopped; buddy copies may be one interval behind.
    assert last["bytes_moved"] > 0 and last["steps_lost"] <= max_steps_lost, last
    report = run.report()
    assert report["success_rate"] == 1.0 and report["qualifying"] == len(done)
    return last
