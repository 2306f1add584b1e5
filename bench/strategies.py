"""How each strategy is launched and how a fault reaches it.

=============  =====================================================================================
strategy       launch
=============  =====================================================================================
baseline       ``torchrun --standalone``: plain DDP, no fault tolerance (never receives faults)
torchpass      ``torchpass launch`` with one hot spare per scheduled fault; faults via ``core/inject.py``
checkpoint     ``torchrun --max-restarts F``: a checkpoint every K steps, restart from the newest one
               (``ddp``: torch.distributed.checkpoint; ``deepspeed``: ``engine.save_checkpoint``;
               ``torchtitan``: TorchTitan's checkpointer)
torchft        a lighthouse plus one ``torchrun --max-restarts F`` per replica group (one rank each)
=============  =====================================================================================

The job each strategy runs is ``cfg.framework``'s (``bench/jobs/``): the workload's GPT in plain DDP or in a
DeepSpeed engine, or TorchTitan's trainer.

Every process is started in its own session so the driver can end what it
started, and only that. The victim of a fault is the process that currently
holds the rank: torchpass looks it up in its ``workers.json``; the others by
the pid of the newest ``start`` record in the rank's log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from torchpass.core.inject import inject

from .config import BenchConfig
from .workload import workload_json
from torchpass.core.free_port import free_port

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



def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(extra or {})}


def _start(cmd: list[str], out: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(out, "ab") as sink:
        return subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _job(name: str, cfg: BenchConfig, run: Strategy) -> tuple[list[str], dict[str, str]]:
    """Strategy ``name``'s training job for ``cfg.framework``: the script and its arguments, and its environment."""
    mode = {"baseline": "plain"}.get(name, name)
    logs = ["--log-dir", str(run.logs)]
    every = str(cfg.schedule.checkpoint_every)
    if cfg.framework == "ddp":
        job = [str(JOBS / f"gpt_{mode}.py"), "--workload", workload_json(cfg.workload), *logs]
        if name == "checkpoint":
            job += ["--checkpoint-dir", str(run.work / "checkpoints"), "--checkpoint-every", every]
        return job, _env()
    if cfg.framework == "deepspeed":
        ds_config = run.work / "ds_config.json"
        ds_config.write_text(json.dumps(deepspeed_config(cfg, torchpass=name == "torchpass"), indent=1))
        job = [str(JOBS / "deepspeed_gpt.py"), "--workload", workload_json(cfg.workload), *logs, "--mode", mode]
        job += ["--deepspeed_config", str(ds_config)]
        if name == "checkpoint":
            job += ["--checkpoint-dir", str(run.work / "checkpoints"), "--checkpoint-every", every]
        return job, _env()
    from tests.support.torchtitan.jobs import job_env

    job = [str(JOBS / "torchtitan_job.py"), *logs, "--mode", mode, *titan_args(cfg, run.work, torchpass=name == "torchpass")]
    if name == "checkpoint":
        job += ["--checkpoint.enable", "--checkpoint.interval", every, "--checkpoint.folder", "checkpoints"]
    # The test support's CPU shim and offline datasets cache; not its probe (the job logs its own steps).
    titan = {k: v for k, v in job_env(run.work.parent / "hf_cache").items() if k != "TORCHPASS_TEST_TORCHTITAN_PROBE"}
    env = _env(titan)
    env["PYTHONPATH"] = os.pathsep.join([titan["PYTHONPATH"], str(REPO)])
    return job, env


def deepspeed_config(cfg: BenchConfig, torchpass: bool) -> dict[str, object]:
    """The DeepSpeed config of the ``deepspeed`` framework mode: the workload's batch, AdamW, ``cfg.zero_stage``;
    with ``torchpass``, the block that enables it."""
    config: dict[str, object] = {
        "train_micro_batch_size_per_gpu": cfg.workload.batch_per_rank,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.workload.lr, "torch_adam": True}},
        "zero_optimization": {"stage": cfg.zero_stage},
    }
    if torchpass:
        config["torchpass"] = {"enabled": True}
    return config


def titan_args(cfg: BenchConfig, work: Path, torchpass: bool) -> list[str]:
    """TorchTitan's command line for the ``torchtitan`` framework mode: the test job config (llama3
    ``debugmodel``, with its ``[torchpass]`` section only for ``torchpass``), the workload's steps, batch,
    sequence length and seed, ``cfg.titan_layout``, generated assets, the run directory as dump folder."""
    from tests.support.torchtitan.assets import make_assets
    from tests.support.torchtitan.jobs import JOB_TOML, LAYOUTS, without_section

    assets_dir = work.parent / "titan_assets"
    assets = make_assets(assets_dir)
    toml = JOB_TOML
    if not torchpass:
        toml = work / "job.toml"
        toml.write_text(without_section(JOB_TOML.read_text()))
    wl = cfg.workload
    return [
        "--job.config_file", str(toml), "--job.dump_folder", str(work), *assets.overrides(), *LAYOUTS[cfg.titan_layout],
        "--training.steps", str(wl.steps), "--training.local_batch_size", str(wl.batch_per_rank),
        "--training.seq_len", str(wl.seq_len), "--debug.seed", str(wl.seed), "--optimizer.lr", str(wl.lr),
    ]  # fmt: skip


def launch(name: str, cfg: BenchConfig, work: Path, faults: int) -> Strategy:
    """Start strategy ``name`` in ``work`` for a run that will receive ``faults`` faults."""
    run = Strategy(name, work)
    run.logs.mkdir(parents=True)
    (work / "out").mkdir()
    py = sys.executable
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    w = str(cfg.world_size)
    if name == "torchft":
        port = free_port()
        lighthouse = [
            "torchft_lighthouse", "--min_replicas", "1", "--quorum_tick_ms", str(cfg.lighthouse_tick_ms),
            "--join_timeout_ms", str(cfg.lighthouse_join_timeout_ms), "--bind", f"[::]:{port}",
        ]  # fmt: skip
        run.helpers.append(_start([str(Path(py).parent / lighthouse[0]), *lighthouse[1:]], work / "out" / "lighthouse.log", _env()))
        job = [str(JOBS / "gpt_torchft.py"), "--workload", workload_json(cfg.workload), "--log-dir", str(run.logs)]
        for group in range(cfg.world_size):
            env = _env(
                {"REPLICA_GROUP_ID": str(group), "NUM_REPLICA_GROUPS": w, "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}
            )
            cmd = [*torchrun, "1", "--max-restarts", str(faults), "--monitor-interval", "0.1", *job]
            run.main.append(_start(cmd, work / "out" / f"group{group}.log", env))
        return run
    job, env = _job(name, cfg, run)
    if name == "baseline":
        cmd = [*torchrun, w, *job]
    elif name == "torchpass":
        cmd = [
            py, "-m", "torchpass", "launch", "--standalone", "--nproc-per-node", w, "--spares-per-node", str(max(1, faults)),
            "--run-dir", str(run.run_dir), "--config", cfg.torchpass_preset, "--quiet", *job,
        ]  # fmt: skip
    elif name == "checkpoint":
        cmd = [*torchrun, w, "--max-restarts", str(faults), "--monitor-interval", "0.1", *job]
        if cfg.framework != "ddp":
            # torchrun (torch 2.13) hands restarted workers the rendezvous store of the first attempt, where the
            # dead group's gloo addresses still are: the restarted group's init_process_group then fails with
            # "connectFullMesh ... Connection refused". This switch, torch's own, makes each attempt use a store of
            # its own. (The ddp job, older, prefixes its store per attempt instead: gpt_checkpoint.py.)
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:
        raise ValueError(f"unknown strategy {name!r}")
    run.main.append(_start(cmd, work / "out" / "job.log", env))
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
