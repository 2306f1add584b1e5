"""The comparison benchmark's configuration: one schema, composed by Hydra from ``configs/bench/<name>.yaml``.

``python -m bench.compare`` loads ``configs/bench/full.yaml`` (``--quick``:
``quick.yaml``) and applies ``key=value`` overrides in Hydra's syntax, e.g.
``workload.steps=40 schedule.checkpoint_every=4``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

__all__ = ["WorkloadConfig", "ScheduleConfig", "BenchConfig", "load_config"]

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "bench"
STRATEGIES = ("baseline", "torchpass", "checkpoint", "torchft")
FRAMEWORKS = ("ddp", "deepspeed", "torchtitan")
TITAN_LAYOUTS = ("ddp", "hsdp", "fsdp")


@dataclass
class WorkloadConfig:
    """The training job every strategy runs: a GPT-like decoder on synthetic tokens, AdamW, data parallel."""

    vocab: int = 8192
    """Vocabulary size (the tied embedding is ``vocab x d_model`` parameters)."""
    d_model: int = 384
    """Width of the residual stream."""
    layers: int = 6
    """Transformer blocks."""
    heads: int = 6
    """Attention heads per block."""
    seq_len: int = 64
    """Tokens per sample."""
    batch_per_rank: int = 4
    """Samples per rank per step (the global batch is ``world_size`` times this)."""
    steps: int = 60
    """Optimizer steps to train (N)."""
    lr: float = 3e-4
    """AdamW learning rate."""
    seed: int = 0
    """Seed of the model initialisation and of the synthetic token stream."""
    threads: int = 1
    """Intra-op threads per rank (``torch.set_num_threads``)."""


@dataclass
class ScheduleConfig:
    """The failure schedule, proportioned like the commercial product's benchmark: a checkpoint every K steps,
    a fault every 3 to 5 K steps."""

    seed: int = 0
    """Seed of the fault steps and victim ranks."""
    checkpoint_every: int = 5
    """K: the checkpoint-restart strategy saves a torch.distributed.checkpoint every K steps."""
    min_gap_k: float = 3.0
    """Shortest distance between faults (and from the start), in multiples of K."""
    max_gap_k: float = 5.0
    """Longest distance between faults, in multiples of K."""
    tail_steps: int = 3
    """No fault in the last ``tail_steps`` steps (each recovery must be followed by training)."""


@dataclass
class BenchConfig:
    """What ``python -m bench.compare`` runs and where it writes."""

    name: str = "full"
    """Name of the configuration, recorded in the results."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """The training job."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The faults injected into every fault-tolerant strategy."""
    framework: str = "ddp"
    """The job every strategy runs: ``ddp`` (the workload's GPT in plain PyTorch DDP), ``deepspeed`` (the same
    GPT in a DeepSpeed engine; checkpoint restart is DeepSpeed's ``save_checkpoint``/``load_checkpoint``) or
    ``torchtitan`` (TorchTitan's trainer on its llama3 ``debugmodel``, the workload giving steps, batch and
    sequence length; checkpoint restart is TorchTitan's checkpointer). torchft runs with ``ddp`` only."""
    zero_stage: int = 1
    """``deepspeed``: the ZeRO stage (1, the stage most DeepSpeed jobs use, shards the optimizer state: torchpass
    keeps buddy copies of it)."""
    titan_layout: str = "hsdp"
    """``torchtitan``: the data-parallel layout over the ranks (``ddp``, ``hsdp`` = 2 x 2, ``fsdp``)."""
    world_size: int = 4
    """Data-parallel ranks (one node, gloo)."""
    strategies: list[str] = field(default_factory=lambda: list(STRATEGIES))
    """Which strategies to run (``baseline`` runs without faults, the others with and without)."""
    steady_rounds: int = 1
    """Fault-free baseline/torchpass pairs for the steady-state ratio (the median over rounds is reported; on a
    shared machine one pair's ratio moves by several percent from run to run). Extra rounds alternate the order."""
    torchpass_preset: str = "default"
    """``torchpass launch --config`` preset."""
    lighthouse_tick_ms: int = 100
    """torchft lighthouse ``--quorum_tick_ms`` (the value its documentation uses)."""
    lighthouse_join_timeout_ms: int = 10000
    """torchft lighthouse ``--join_timeout_ms`` (the value its documentation uses)."""
    run_timeout_s: float = 900.0
    """A run that takes longer is killed and reported as failed."""
    out: str = "bench/out/compare"
    """Directory for the per-run logs and ``results.json`` (relative to the repository root)."""
    docs: bool = True
    """Write ``docs/benchmarks.md`` and the plot under ``docs/img/``."""
    control_plane_sizes: list[int] = field(default_factory=lambda: [64, 256, 1024, 4096, 16384])
    """Simulated job sizes for the control-plane scaling table (``bench/control_plane.py``); empty to skip it."""


def register() -> None:
    """Register the schema with Hydra's ConfigStore as ``bench_schema`` (the YAML files' first default)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="bench_schema", node=BenchConfig)


def load_config(name: str, overrides: list[str]) -> BenchConfig:
    """Compose ``configs/bench/<name>.yaml`` with Hydra, type-checked against :class:`BenchConfig`."""
    from hydra import compose, initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name=name, overrides=overrides)
    config = OmegaConf.to_object(cfg)
    assert isinstance(config, BenchConfig)
    unknown = set(config.strategies) - set(STRATEGIES)
    if unknown:
        raise ValueError(f"unknown strategies {sorted(unknown)}; choose from {list(STRATEGIES)}")
    if config.framework not in FRAMEWORKS:
        raise ValueError(f"framework={config.framework!r}; choose from {list(FRAMEWORKS)}")
    if config.framework != "ddp" and "torchft" in config.strategies:
        raise ValueError(f"framework={config.framework!r} runs baseline, torchpass and checkpoint; torchft runs with framework=ddp only")
    if config.framework == "deepspeed" and config.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={config.zero_stage}; DeepSpeed's stages are 0, 1, 2, 3")
    if config.framework == "torchtitan" and config.titan_layout not in TITAN_LAYOUTS:
        raise ValueError(f"titan_layout={config.titan_layout!r}; choose from {list(TITAN_LAYOUTS)}")
    if config.framework == "torchtitan" and config.world_size != 4:
        raise ValueError(f"world_size={config.world_size}; the torchtitan layouts are defined over 4 ranks")
    return config
