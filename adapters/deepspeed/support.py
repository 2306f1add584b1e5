"""Which DeepSpeed engines torchpass can migrate, checked when the engine is built.

A configuration outside this set is refused with the DeepSpeed setting that
selects it, rather than run without a guarantee: a migration that silently
loses state is worse than a job that stops. The supported set is what the
adapter's state capture, per-step reset and tests cover:

* engines: ``DeepSpeedEngine`` and ``PipelineEngine`` (not the hybrid engine,
  not ``DualPipeVEngine``);
* ZeRO stage 0 with a plain torch optimizer (fp32 training), ZeRO 1 and 2
  (``DeepSpeedZeroOptimizer``) and ZeRO 3 (``DeepSpeedZeroOptimizer_Stage3``),
  fp32, bf16 or fp16;
* data, sequence-data, model (``mpu``) and pipeline parallelism;
* managed gradient accumulation (DeepSpeed's default).

Refused: ZeRO-Offload and ZeRO-Infinity (state outside the engine's tensors),
mixture-of-experts layers (expert-parallel state classes are not captured yet),
hpZ (``zero_hpz_partition_size`` > 1: secondary partitions are not reset),
``BF16_Optimizer`` and the ZeRO-0 fp16/bf16 optimizers, unmanaged gradient
accumulation, ZenFlow and DeepCompile. MiCS cannot reach the adapter: DeepSpeed
0.19.8 itself rejects ``mics_shard_size``.
"""

from __future__ import annotations

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

__all__ = ["UnsupportedEngine", "check_supported"]


class UnsupportedEngine(ValueError):
    """The engine's configuration is one torchpass cannot migrate; the message names the setting."""


def _offloads(engine: DeepSpeedEngine) -> list[str]:
    found = []
    for name, offload in (("offload_optimizer", engine.zero_offload_optimizer()), ("offload_param", engine.zero_offload_param())):
        device = getattr(offload, "device", None)
        if device is not None and str(getattr(device, "value", device)) != "none":
            found.append(f"zero_optimization.{name}.device = {getattr(device, 'value', device)!r}")
    return found


def check_supported(engine: DeepSpeedEngine) -> None:
    """Raise :class:`UnsupportedEngine` naming the setting when torchpass cannot migrate ``engine``."""
    problems: list[str] = []
    if type(engine) not in (DeepSpeedEngine, PipelineEngine):
        problems.append(f"engine class {type(engine).__name__} (supported: DeepSpeedEngine, PipelineEngine)")
    stage = engine.zero_optimization_stage()
    optimizer = engine.optimizer
    expected = {0: torch.optim.Optimizer, 1: DeepSpeedZeroOptimizer, 2: DeepSpeedZeroOptimizer, 3: DeepSpeedZeroOptimizer_Stage3}
    if optimizer is None:
        problems.append('no optimizer (give "optimizer" in the config or optimizer= to deepspeed.initialize)')
    elif stage not in expected or not isinstance(optimizer, expected[stage]):
        hint = ' (at ZeRO stage 0 only fp32 training is supported: drop "bf16"/"fp16" or use stage >= 1)' if stage == 0 else ""
        problems.append(
            f"zero_optimization.stage = {stage} with optimizer wrapper {type(optimizer).__name__}{hint}; "
            "BF16_Optimizer (bf16 with data_types.grad_accum_dtype = fp32, or bf16 pipelines at stage 0) is not supported"
        )
    problems += _offloads(engine)
    if engine.has_moe_layers:
        problems.append("mixture-of-experts layers (expert parallelism)")
    if engine.zero_hpz_partition_size() > 1:
        problems.append(f"zero_optimization.zero_hpz_partition_size = {engine.zero_hpz_partition_size()} (hpZ)")
    if not engine.managed_gradient_accumulation():
        problems.append("managed_gradient_accumulation = false")
    if getattr(engine, "zenflow", False):
        problems.append("ZenFlow (zero_optimization.zenflow)")
    if engine.is_deepcompile_enabled():
        problems.append("DeepCompile (compile.deepcompile = true)")
    if problems:
        raise UnsupportedEngine(
            "torchpass cannot migrate this DeepSpeed engine: "
            + "; ".join(problems)
            + '. Change the setting, or set "torchpass": {"enabled": false} to run without live migration.'
        )
