"""Start TorchTitan jobs for the tests: the test job config, the layouts, the CPU test-support environment.

Every job runs TorchTitan's real trainer and llama3 "debugmodel" through the
adapter's entry point, on CPU/gloo via this directory's ``sitecustomize``,
with the probe recording what the harness compares (see ``probe.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.harness import REPO, JobRun, free_port, launch

from .assets import Assets

__all__ = [
    "ENTRY_POINT",
    "JOB_TOML",
    "LAYOUTS",
    "SHIPPED",
    "STEPS",
    "checkpoint_digest",
    "job_args",
    "job_env",
    "launch_titan",
    "shipped_args",
    "torchrun_titan",
    "without_section",
]

SUPPORT = Path(__file__).resolve().parent
JOB_TOML = SUPPORT / "job.toml"
ENTRY_POINT = "torchpass.adapters.torchtitan.train"
STEPS = 8
"""``[training] steps`` of ``job.toml``."""

LAYOUTS: dict[str, list[str]] = {
    "ddp": ["--parallelism.data_parallel_replicate_degree", "4"],
    "hsdp": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
    "fsdp": ["--parallelism.data_parallel_shard_degree", "4"],
    "tp_fsdp": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
}
"""TorchTitan flags of each tested layout over 4 ranks."""


SHIPPED: dict[str, Path] = {name: SUPPORT / "shipped" / f"{name}.toml" for name in ("debug_model", "llama3_8b")}
"""TorchTitan 0.2.2's llama3 job configs, verbatim, plus ``[torchpass] enable = true`` (see ``shipped/``)."""

SHIPPED_SCALE: dict[str, list[str]] = {
    "debug_model": [],
    # The debug flavor, 10 steps; the test dataset (the config's "c4" is the full C4 from the hub); and no
    # profiler: TorchTitan 0.2.2 passes a None device activity to torch.profiler on a machine without CUDA/XPU.
    "llama3_8b": [
        "--model.flavor", "debugmodel", "--training.steps", "10", "--lr_scheduler.warmup_steps", "2",
        "--training.dataset", "c4_test", "--profiling.no-enable-profiling",
    ],
}  # fmt: skip
"""Per shipped config, what scales it to this machine besides the common flags of :func:`shipped_args`."""


def shipped_args(name: str, layout: str, assets: Assets, extra: list[str] | None = None) -> list[str]:
    """TorchTitan's command line running shipped config ``name`` on 4 CPU ranks, the way a user scales one down.

    Only scale and reproducibility change, on the command line: the parallelism
    (``layout``), the batch shape (2 x 32 tokens per rank, as the test job's, not
    8 x 2048: bf16 matmuls on a CPU without bf16 units cost 8 s a step at 2 x 128
    with 4 ranks on 2 cores), the assets and the dump folder, the seed and
    deterministic kernels (the bitwise oracle compares two runs), and
    checkpointing switched on (the configs ship it off). Mixed precision (bf16),
    activation checkpointing, logging and every other value stay as shipped.
    """
    return [
        "--job.config_file", str(SHIPPED[name]), "--job.dump_folder", ".", *assets.overrides(), *LAYOUTS[layout],
        "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--debug.seed", "42", "--debug.deterministic", "--checkpoint.enable",
        *SHIPPED_SCALE[name], *(extra or []),
    ]  # fmt: skip


def checkpoint_digest(folder: Path) -> str:
    """SHA-256 over everything a TorchTitan (DCP) checkpoint folder holds, read without a process group."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from torchpass.core.manifest import state_digest

    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(folder)), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    # By path, sorted: the order of the checkpoint's metadata depends on which rank coordinated the save.
    return state_digest(dict(sorted(_flatten(state).items())))


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}{key}/").items()}
    return {prefix: value}


def job_env(hf_cache: Path) -> dict[str, str]:
    """What a test job needs in its environment: the CPU shim, the probe, an offline private datasets cache."""
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH", "")])),
        "TORCHPASS_TEST_TORCHTITAN_CPU": "1",
        "TORCHPASS_TEST_TORCHTITAN_PROBE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(hf_cache),
    }


def job_args(layout: str, assets: Assets, extra: list[str] | None = None, config_file: Path = JOB_TOML) -> list[str]:
    """TorchTitan's command line for ``layout``; the dump folder is the job's working directory."""
    return ["--job.config_file", str(config_file), "--job.dump_folder", ".", *assets.overrides(), *LAYOUTS[layout], *(extra or [])]


def launch_titan(
    workdir: Path,
    layout: str,
    assets: Assets,
    hf_cache: Path,
    *,
    extra: list[str] | None = None,
    config_file: Path = JOB_TOML,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> JobRun:
    """``torchpass launch`` 4 ranks and a spare running the adapter's entry point.

    The command line is ``args`` when given (e.g. :func:`shipped_args`), else the test job's for ``layout``.
    """
    args = args if args is not None else job_args(layout, assets, extra, config_file)
    return launch(workdir, ENTRY_POINT, args, module=True, env={**job_env(hf_cache), **(env or {})})


def torchrun_titan(
    workdir: Path,
    layout: str,
    assets: Assets,
    hf_cache: Path,
    *,
    extra: list[str] | None = None,
    config_file: Path = JOB_TOML,
    args: list[str] | None = None,
    timeout: float = 600.0,
) -> JobRun:
    """Run the adapter's entry point to completion under plain ``torchrun`` (4 ranks, no torchpass)."""
    args = args if args is not None else job_args(layout, assets, extra, config_file)
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "torchrun.log"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "4",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "-m", ENTRY_POINT, *args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **job_env(hf_cache)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env["PYTHONPATH"]])
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    run = JobRun(workdir, [proc], [log], workdir / "run")
    if run.wait(timeout) != 0:
        raise AssertionError(f"torchrun job failed:\n{run.output()[-4000:]}")
    return run


def without_section(toml: str) -> str:
    """The job config without the lines that enable torchpass (the custom config module and the table)."""
    out, skipping = [], False
    for line in toml.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            skipping = stripped == "[torchpass]" or stripped.startswith("[torchpass.")
        if skipping or stripped.startswith("custom_config_module"):
            continue
        out.append(line)
    return "\n".join(out) + "\n"
