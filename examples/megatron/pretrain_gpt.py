"""GPT pretraining with megatron-core, migratable with ``--torchpass``.

A megatron-core training loop (no Megatron-LM): ``parallel_state`` with tensor
and pipeline parallelism, a ``GPTModel``, megatron-core's
``DistributedDataParallel`` and optimizer, an ``OptimizerParamScheduler``, the
number-of-microbatches calculator, and ``get_forward_backward_func()`` called
through :class:`torchpass.adapters.megatron.MegatronRun`. Started by
``torchpass launch`` with ``--torchpass``, a failed rank's work moves to a hot
spare and the run ends bitwise identical to a fault-free run::

    torchpass launch --nproc-per-node 4 --spares-per-node 1 examples/megatron/pretrain_gpt.py \\
        --tensor-model-parallel-size 2 --train-iters 50 --torchpass

    torchpass inject --run-dir torchpass_run --rank 1 --fault kill     # in another shell

torchpass moves CPU state over gloo in this release, so the job trains on CPU;
megatron-core itself assumes CUDA in a few helpers, see
docs/adapters/megatron.md for how the tests run it on CPU. The data are random
tokens: replace :func:`training_data` with a real dataset (any re-iterable
source of micro-batches for this data-parallel rank).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from torchpass.adapters.megatron import MegatronRun, add_torchpass_args, config_from_args


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="megatron-core GPT pretraining", allow_abbrev=False)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--train-iters", type=int, default=50)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--min-lr", type=float, default=3e-5)
    parser.add_argument("--lr-warmup-iters", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--log-interval", type=int, default=5)
    return add_torchpass_args(parser).parse_args()  # --torchpass, --torchpass-*


def training_data(args: argparse.Namespace) -> DataLoader:
    """Random token sequences, sharded over the data-parallel ranks."""
    tokens = torch.randint(0, args.vocab_size, (4096, args.seq_length + 1), generator=torch.Generator().manual_seed(args.seed))
    dataset = TensorDataset(tokens)
    sampler = DistributedSampler(
        dataset,
        num_replicas=parallel_state.get_data_parallel_world_size(),
        rank=parallel_state.get_data_parallel_rank(),
        shuffle=True,
        seed=args.seed,
    )
    return DataLoader(dataset, batch_size=args.micro_batch_size, sampler=sampler, drop_last=True)


def main() -> None:
    args = parse_args()
    torchpass = config_from_args(args)  # None without --torchpass: the plain loop

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    # Megatron-LM's seeding: one seed per pipeline stage, for torch and the model-parallel RNG tracker.
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    dp = parallel_state.get_data_parallel_world_size()
    init_num_microbatches_calculator(dist.get_rank(), None, args.global_batch_size, args.micro_batch_size, dp)

    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        # Fused kernels need CUDA.
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
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="learned_absolute",
    )
    model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=gpt)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=0.01, clip_grad=0.0), [model]
    )
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=args.train_iters * args.global_batch_size,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=args.train_iters * args.global_batch_size,
        wd_incr_style="constant",
    )
    run = MegatronRun(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        data=training_data(args),
        seq_length=args.seq_length,
        train_iters=args.train_iters,
        torchpass=torchpass,
    )

    causal_mask = torch.triu(torch.ones(1, 1, args.seq_length, args.seq_length, dtype=torch.bool), diagonal=1)
    positions = torch.arange(args.seq_length).unsqueeze(0).expand(args.micro_batch_size, -1)

    def forward_step(data_iterator, chunk):
        (batch,) = next(data_iterator)
        output = chunk(batch[:, :-1], positions, causal_mask, labels=batch[:, 1:])

        def loss_func(per_token_loss: torch.Tensor):
            total = per_token_loss.float().sum()
            tokens = torch.tensor(per_token_loss.numel(), dtype=torch.int)
            return total, tokens, {"lm loss": torch.stack([total.detach(), tokens.float()])}

        return output, loss_func

    while run.iteration < args.train_iters:
        losses = run.train_step(forward_step)
        # Losses are returned on the last pipeline stage; print them once per model replica 0.
        first_replica = parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0
        if losses and first_replica and run.iteration % args.log_interval == 0:
            lr = optimizer.param_groups[0]["lr"]
            print(f"iteration {run.iteration:5d} | lm loss {losses['lm loss']:.6f} | lr {lr:.3e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
