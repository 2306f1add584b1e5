"""The megatron-core job of the Megatron adapter's end-to-end tests and benchmark (CPU, gloo, 4 ranks).

A tiny real ``GPTModel`` (2 layers, hidden 64, dropout 0.1) trained through
:class:`torchpass.adapters.megatron.MegatronRun` in one of two layouts:

* ``tp2dp2``: tensor parallel 2 x data parallel 2, torch ``DistributedDataParallel``
  over the data-parallel group, torch ``AdamW``;
* ``pp2dp2``: pipeline parallel 2 (1F1B) x data parallel 2, tied embeddings,
  megatron-core's ``DistributedDataParallel``, Megatron optimizer (Adam) and
  ``finalize_model_grads``;
* ``dp4distopt``: data parallel 4, megatron-core's ``DistributedDataParallel`` and
  Megatron's distributed optimizer (Adam; each rank holds a quarter of the main
  params and moments).

Both use the model-parallel RNG tracker (dropout), an ``OptimizerParamScheduler``
with warm-up and cosine decay, the number-of-microbatches calculator (2
micro-batches per step) and a shuffled ``DistributedSampler`` over the
data-parallel ranks. megatron-core runs on CPU through the test-only
:mod:`tests.support.megatron.cpu_shim`, installed before anything is built.

Outputs, in the layout :mod:`tests.support.harness` reads: ``progress/rank<r>``
(the step being executed), ``losses/rank<r>.jsonl`` (every step's loss on the
last pipeline stage, recorded before the commit), ``out/rank<r>.json`` (a
SHA-256 of the rank's model, optimizer, scheduler, counters and RNG tracker,
its PID, its step times, and which process groups the model and the
data-parallel wrappers hold, with the generation each was last built for).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import megatron.core  # noqa: F401  (the shim patches megatron-core modules)
import torch
import torch.distributed as dist

from tests.support.megatron import cpu_shim
from tests.support.megatron.final_state import optimizer_state, summary

cpu_shim.install()

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.distributed import DistributedDataParallel as MegatronDDP  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from torchpass.adapters.megatron import MegatronRun, add_torchpass_args, config_from_args  # noqa: E402
from torchpass.adapters.megatron import run as megatron_run  # noqa: E402
from torchpass.core import runtime  # noqa: E402
from torchpass.core.comms import RebuildableProcessGroup  # noqa: E402

SEQ, VOCAB, HIDDEN, MICRO_BATCH, MICRO_BATCHES, SEED = 16, 128, 64, 2, 2, 1234
LAYOUTS = {"tp2dp2": (2, 1, False), "pp2dp2": (1, 2, False), "dp4distopt": (1, 1, True)}
"""Layout name -> (tensor parallel, pipeline parallel, distributed optimizer)."""


def build_model(tp: int, pp: int, distributed_optimizer: bool = False) -> tuple[torch.nn.Module, Any, TransformerConfig]:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=4 * HIDDEN,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        # Fused kernels are CUDA-only.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=pp > 1,
        position_embedding_type="learned_absolute",
    )
    if pp == 1 and not distributed_optimizer:
        model: torch.nn.Module = DistributedDataParallel(gpt, process_group=ps.get_data_parallel_group())
        config.no_sync_func = model.no_sync
        optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    else:
        model = MegatronDDP(
            config=config,
            ddp_config=DistributedDataParallelConfig(
                overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
            ),
            module=gpt,
        )
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=1e-3, min_lr=1e-5, weight_decay=0.01, bf16=False, fp16=False, clip_grad=0.0,
                use_distributed_optimizer=distributed_optimizer,
            ), [model]
        )
        config.no_sync_func = model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, config


def training_data() -> DataLoader:
    tokens = torch.randint(0, VOCAB, (256, SEQ + 1), generator=torch.Generator().manual_seed(SEED))
    dataset = TensorDataset(tokens)
    sampler = DistributedSampler(
        dataset, num_replicas=ps.get_data_parallel_world_size(), rank=ps.get_data_parallel_rank(), shuffle=True, seed=7
    )
    return DataLoader(dataset, batch_size=MICRO_BATCH, sampler=sampler, drop_last=True)


def cached_groups(model: torch.nn.Module) -> dict[str, Any]:
    """Every process group the model's modules and the data-parallel wrapper hold, by attribute path."""
    found: dict[str, Any] = {}
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, dist.ProcessGroup):
                found[f"{name or type(module).__name__}.{attr}"] = value
            elif isinstance(value, ProcessGroupCollection):
                for field, group in vars(value).items():
                    if isinstance(group, dist.ProcessGroup):
                        found[f"{name or type(module).__name__}.{attr}.{field}"] = group
    return found


def group_report(model: torch.nn.Module) -> dict[str, Any]:
    """For each cached group: whether it is one of parallel_state's group objects, and its generation."""
    owned = [g for g in ps._global_process_group_list if g is not None]
    return {
        path: {
            "rebuildable": isinstance(group, RebuildableProcessGroup),
            "parallel_state_object": any(group is g for g in owned),
            "generation": getattr(group, "generation", None),
        }
        for path, group in cached_groups(model).items()
    }


class HookTimer:
    """Wall time spent inside torchpass's per-step hooks (for bench/megatron_bench.py; ``--time-hooks``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        return timed

    def install(self) -> None:
        """Wrap the runtime's step hooks, its pre-collective flush and the adapter's coupling all-reduce."""
        rt = runtime.current()
        assert rt is not None, "--time-hooks needs torchpass launch"
        for name in ("step_begin", "backward_started", "commit_started", "commit_finished", "step_end"):
            setattr(rt, name, self.wrap(name, getattr(rt, name)))
        # attach() installs rt._before_collective as the hook run before every collective.
        rt._before_collective = self.wrap("flush_before_collective", rt._before_collective)  # type: ignore[method-assign]
        megatron_run._couple_model_replica = self.wrap("coupling_all_reduce", megatron_run._couple_model_replica)


def main() -> None:
    # `kill -USR1 <pid>` prints every thread's stack: how a stuck test job is inspected.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds of sleep per step, inside the forward")
    parser.add_argument("--time-hooks", action="store_true", help="record the time spent in torchpass's step hooks")
    args = add_torchpass_args(parser).parse_args()
    torchpass_config = config_from_args(args)
    work = Path(args.workdir)
    for sub in ("progress", "out", "losses"):
        (work / sub).mkdir(parents=True, exist_ok=True)

    tp, pp, distributed_optimizer = LAYOUTS[args.layout]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    # What Megatron-LM's _set_random_seed does: one seed per pipeline stage, for torch and the tracker.
    seed = SEED + 100 * ps.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    dp = ps.get_data_parallel_world_size()
    init_num_microbatches_calculator(rank, None, MICRO_BATCH * MICRO_BATCHES * dp, MICRO_BATCH, dp)

    model, optimizer, _ = build_model(tp, pp, distributed_optimizer)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=1e-4,
        max_lr=1e-3,
        min_lr=1e-5,
        lr_warmup_steps=2 * MICRO_BATCH * MICRO_BATCHES * dp,
        lr_decay_steps=args.steps * MICRO_BATCH * MICRO_BATCHES * dp,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=args.steps,
        wd_incr_style="constant",
    )
    run = MegatronRun(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        data=training_data(),
        seq_length=SEQ,
        train_iters=args.steps,
        torchpass=torchpass_config,
    )
    hooks = HookTimer()
    if args.time_hooks:
        hooks.install()
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, -1)
    per_microbatch_sleep = args.step_sleep / MICRO_BATCHES

    def forward_step(data_iterator: Any, chunk: torch.nn.Module) -> Any:
        (batch,) = next(data_iterator)
        time.sleep(per_microbatch_sleep)
        output = chunk(batch[:, :-1], positions, mask, labels=batch[:, 1:])

        def loss_func(per_token: torch.Tensor) -> Any:
            total = per_token.float().sum()
            count = torch.tensor(per_token.numel(), dtype=torch.int)
            return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}

        return output, loss_func

    progress = work / "progress" / f"rank{rank}"
    curve = open(work / "losses" / f"rank{rank}.jsonl", "a", buffering=1)

    def record(step: int, losses: dict[str, float]) -> None:
        if losses:
            curve.write(json.dumps({"step": step, "loss": losses["lm loss"], "pid": os.getpid()}) + "\n")

    step_times: list[float] = []
    while run.iteration < args.steps:
        progress.write_text(str(run.iteration + 1))
        start = time.perf_counter()
        run.train_step(forward_step, record_losses=record)
        step_times.append(time.perf_counter() - start)

    final = {
        "model": model.state_dict(),
        "optimizer": optimizer_state(optimizer),
        "scheduler": scheduler.state_dict(),
        "progress": {"iteration": run.iteration, "consumed": run.consumed_train_samples},
        "rng_tracker": get_cuda_rng_tracker().get_states(),
    }
    out = {
        **summary(final),
        "pid": os.getpid(),
        "step_times": step_times,
        "hook_seconds": hooks.seconds,
        "groups": group_report(model),
    }
    (work / "out" / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
