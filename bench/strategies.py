"""How each strategy is launched and how a fault reaches it.

=============  =====================================================================================
strategy       launch
=============  =====================================================================================
baseline       ``torchrun --standalone``: plain DDP, no fault tolerance (never receives faults)
torchpass      ``torchpass launch`` with one hot spare per scheduled fault; faults via ``core/inject.py``
checkpoint     ``torchrun --max-restarts F``: DCP save every K steps, restart from the newest checkpoint
torchft        a lighthouse plus one ``torchrun --max-restarts F`` per replica group (one rank each)
=============  =====================================================================================

Every process is started in its own session so the driver can end what it
started, and only that. The victim of a fault is the process that currently
holds the rank: torchpass looks it up in its ``workers.json``; the others by
the pid of the newest ``start`` record in the rank's log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from torchpass.core.inject import inject

from .config import BenchConfig
from .workload import workload_json

__all__ = ["Strategy", "launch", "kill_rank", "REPO"]

REPO = Path(__file__).resolve().parent.parent
JOBS = Path(__file__).resolve().parent / "jobs"


@dataclass
class Strategy:
    """A started run of one strategy."""

    name: str
    work: Path
    """The run's directory: ``logs/`` (rank logs), ``out/`` (process output), and the strategy's own files."""
    main: list[subprocess.Popen[bytes]] = field(default_factory=list)
    """Processes whose exit ends the run (torchft: one per replica group)."""
    helpers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    """Processes stopped once the run ends (the torchft lighthouse)."""

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    @property
    def run_dir(self) -> Path:
        """torchpass's run directory (``workers.json``, ``events.jsonl``)."""
        return self.work / "run"

    def all(self) -> list[subprocess.Popen[bytes]]:
        return self.main + self.helpers

    def stop(self) -> None:
        """SIGKILL every process group this run started that is still alive."""
        for proc in self.all():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(extra or {})}


def _start(cmd: list[str], out: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(out, "ab") as sink:
        return subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def launch(name: str, cfg: BenchConfig, work: Path, faults: int) -> Strategy:
    """Start strategy ``name`` in ``work`` for a run that will receive ``faults`` faults."""
    run = Strategy(name, work)
    run.logs.mkdir(parents=True)
    (work / "out").mkdir()
    job = ["--workload", workload_json(cfg.workload), "--log-dir", str(run.logs)]
    py = sys.executable
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    w = str(cfg.world_size)
    if name == "baseline":
        run.main.append(_start([*torchrun, w, str(JOBS / "gpt_plain.py"), *job], work / "out" / "job.log", _env()))
    elif name == "torchpass":
        cmd = [
            py, "-m", "torchpass", "launch", "--standalone", "--nproc-per-node", w, "--spares-per-node", str(max(1, faults)),
            "--run-dir", str(run.run_dir), "--config", cfg.torchpass_preset, "--quiet", str(JOBS / "gpt_torchpass.py"), *job,
        ]  # fmt: skip
        run.main.append(_start(cmd, work / "out" / "job.log", _env()))
    elif name == "checkpoint":
        ckpt = ["--checkpoint-dir", str(work / "checkpoints"), "--checkpoint-every", str(cfg.schedule.checkpoint_every)]
        cmd = [*torchrun, w, "--max-restarts", str(faults), "--monitor-interval", "0.1", str(JOBS / "gpt_checkpoint.py"), *job, *ckpt]
        run.main.append(_start(cmd, work / "out" / "job.log", _env()))
    elif name == "torchft":
        port = _free_port()
        lighthouse = [
            "torchft_lighthouse", "--min_replicas", "1", "--quorum_tick_ms", str(cfg.lighthouse_tick_ms),
            "--join_timeout_ms", str(cfg.lighthouse_join_timeout_ms), "--bind", f"[::]:{port}",
        ]  # fmt: skip
        run.helpers.append(_start([str(Path(py).parent / lighthouse[0]), *lighthouse[1:]], work / "out" / "lighthouse.log", _env()))
        for group in range(cfg.world_size):
            env = _env(
                {"REPLICA_GROUP_ID": str(group), "NUM_REPLICA_GROUPS": w, "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}
            )
            cmd = [*torchrun, "1", "--max-restarts", str(faults), "--monitor-interval", "0.1", str(JOBS / "gpt_torchft.py"), *job]
            run.main.append(_start(cmd, work / "out" / f"group{group}.log", env))
    else:
        raise ValueError(f"unknown strategy {name!r}")
    return run


def _live_pid(log: Path) -> int | None:
    """The pid of the newest process that started as this rank, if it is still alive."""
    if not log.exists():
        return None
    pids = [r["pid"] for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "start"]
    if not pids:
        return None
    try:
        os.kill(pids[-1], 0)
    except ProcessLookupError:
        return None
    return pids[-1]


def kill_rank(run: Strategy, rank: int, world_size: int) -> int:
    """SIGKILL the process that currently holds ``rank``; return the rank actually hit.

    A torchft replica group killed earlier may still be restarting when its next fault is due: the fault then
    goes to the next rank that has a live process, so every strategy receives the same number of faults.
    """
    if run.name == "baseline":
        raise ValueError("the baseline receives no faults")
    if run.name == "torchpass":
        inject(run.run_dir, "kill", rank=rank)
        return rank
    for victim in [(rank + i) % world_size for i in range(world_size)]:
        pid = _live_pid(run.logs / f"rank{victim}.jsonl")
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            return victim
    raise RuntimeError(f"{run.name}: no rank has a live process to kill")
