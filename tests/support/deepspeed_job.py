"""The DeepSpeed reference job of the end-to-end tests (real engines, CPU, gloo).

A tiny MLP with dropout, AdamW (``torch_adam``) with weight decay, gradient
clipping, a warm-up LR schedule and gradient accumulation 2: every piece of
state a migration must carry over. Two loop styles:

* ``--zero N`` (0-3): a user-owned forward/backward/step loop driven by
  ``torchpass.adapters.deepspeed.steps`` over the engine's own training
  dataloader (``training_data=``, shuffled ``DistributedSampler``);
* ``--loader-loop``: the loop as DeepSpeed's documentation writes it, unchanged:
  epochs of ``for batch in trainloader`` over the loader ``deepspeed.initialize``
  returned, ``set_epoch`` on its sampler, forward, ``engine.backward``,
  ``engine.step()``; the loss is recorded before the step at the boundary;
* ``--own-loader``: the same loop over the script's own torch ``DataLoader``
  (shuffled ``DistributedSampler``, ``set_epoch``), written as DeepSpeed's
  Getting Started page writes it: ``for step, batch in enumerate(data_loader)``;
* ``--pipe``: a 2-stage ``PipelineModule`` (run it on 4 ranks: PP2 x DP2, ZeRO 1)
  trained with ``engine.train_batch(data_iter)`` in a plain ``for`` loop.

The DeepSpeed config carries ``"torchpass": {"enabled": true}`` (``--block``
replaces the block, ``--no-block`` drops it) and reaches DeepSpeed as a dict,
a JSON file (``--config-form file``) or ``--deepspeed_config`` (``args``).

Each rank writes ``progress/rank<r>`` (the step it is executing) for the
harness to time faults, and appends every step's loss to
``losses/rank<r>.jsonl`` before the optimizer step (the pipeline's first stage
computes no loss and records none). At the end it writes ``out/rank<r>.json``:
a SHA-256 of its state and its PID. The digest covers only meaningful bytes:
full module parameters (gathered under ZeRO-3), this rank's fp32 master
partition and moments, the step counters and the scheduler. ZeRO-3 partitions
end with per-parameter padding that DeepSpeed allocates uninitialized (its
bytes differ run to run and never reach a real value), so for ZeRO-3 the
element ``j`` of parameter ``p``'s partition on data-parallel rank ``r`` is
digested only if ``r * partition_numel + j < p.ds_numel``.

Only the ``steps()`` loop imports torchpass (``steps`` itself); the other
loops import nothing from it, as a user's script would not (the digest is
computed here): the DeepSpeed integration ``torchpass launch`` activates in
each worker hooks the engine when the script imports ``deepspeed``.
"""

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.utils import RepeatingLoader
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


GAS = 2
MICRO_BATCH = 4


def ds_config(zero: int, block: dict | None) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 10**6,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 200, "allgather_bucket_size": 200},
    }
    if zero == 3:
        config["zero_optimization"].update(
            {"stage3_param_persistence_threshold": 40, "stage3_prefetch_bucket_size": 200, "stage3_max_live_parameters": 2000}
        )
    if block is not None:
        config["torchpass"] = block
    return config


def dataset(samples: int = 1024) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 16, generator=g)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(24, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1)
    )


class Regression(torch.nn.Module):
    """The MLP with its loss, so ``engine(batch)`` returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(x), y)


def zero3_valid_mask(optimizer, sub_group: int, dp_rank: int) -> torch.Tensor:
    """Which elements of a ZeRO-3 sub-group's flat partition hold real values (not padding)."""
    flat = optimizer.fp32_partitioned_groups_flat[sub_group]
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    offset = 0
    for param in optimizer.fp16_groups[sub_group]:
        part = param.ds_tensor.numel()
        valid = max(0, min(part, param.ds_numel - dp_rank * part))
        mask[offset : offset + valid] = True
        offset += part
    return mask


def state_digest(tree) -> str:
    """SHA-256 over a nest of dicts, lists and tensors: each tensor's path, dtype, shape and bytes, other leaves' repr."""
    h = hashlib.sha256()

    def walk(obj, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().contiguous()
            h.update(f"{path}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for key in sorted(obj, key=str):
                walk(obj[key], f"{path}/{key}")
        elif isinstance(obj, (list, tuple)):
            for i, item in enumerate(obj):
                walk(item, f"{path}/{i}")
        else:
            h.update(f"{path}={obj!r}".encode())

    walk(tree, "")
    return h.hexdigest()


def final_digest(engine) -> str:
    stage = engine.zero_optimization_stage()
    params = list(engine.module.parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            full = [p.detach().clone() for p in params]
    else:
        full = [p.detach().clone() for p in params]
    optimizer = engine.optimizer
    masters: list[torch.Tensor] = []
    keys: list[torch.Tensor]
    if stage == 0:
        keys = [p for g in optimizer.param_groups for p in g["params"]]
        inner = optimizer
    elif stage in (1, 2):
        keys = masters = list(optimizer.single_partition_of_fp32_groups)
        inner = optimizer.optimizer
    else:
        inner = optimizer.optimizer
        dp_rank = dist.get_rank(group=optimizer.dp_process_group)
        keys = list(optimizer.fp32_partitioned_groups_flat)
        masks = [zero3_valid_mask(optimizer, i, dp_rank) for i in range(len(keys))]
    moments = []
    for i, key in enumerate(keys):
        state = {k: (v[masks[i]] if stage == 3 and v.numel() == key.numel() else v) for k, v in inner.state[key].items()}
        moments.append(state)
    if stage == 3:
        masters = [key[masks[i]] for i, key in enumerate(keys)]
    counters = [engine.global_steps, engine.global_samples, engine.skipped_steps, engine.get_lr()]
    return state_digest(
        {"params": full, "masters": masters, "moments": moments, "counters": counters, "scheduler": engine.lr_scheduler.state_dict()}
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--pipe", action="store_true", help="2-stage pipeline (PP2 x DP2 on 4 ranks)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--workdir", required=True)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--block", default='{"enabled": true}', help='the "torchpass" block, as JSON')
    p.add_argument("--no-block", action="store_true")
    p.add_argument("--config-form", choices=("dict", "file", "args"), default="dict")
    p.add_argument("--loader-loop", action="store_true", help="an unchanged epoch loop over the engine's training dataloader")
    p.add_argument("--own-loader", action="store_true", help="an unchanged epoch loop over the script's own DataLoader")
    p.add_argument("--epochs", type=int, default=3, help="--loader-loop, --own-loader: passes over the data")
    p.add_argument(
        "--samples", type=int, default=48, help="--loader-loop, --own-loader: dataset size (48: 3 steps per epoch on 2 ranks)"
    )
    args = p.parse_args()
    work = Path(args.workdir)
    for sub in ("progress", "out", "losses"):
        (work / sub).mkdir(parents=True, exist_ok=True)

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    config = ds_config(args.zero, None if args.no_block else json.loads(args.block))
    init_kwargs: dict = {"config": config}
    if args.config_form != "dict":
        path = work / "out" / f"ds_config_rank{rank}.json"
        path.write_text(json.dumps(config))
        if args.config_form == "file":
            init_kwargs = {"config": str(path)}
        else:
            init_kwargs = {"args": argparse.Namespace(deepspeed_config=str(path), local_rank=int(os.environ["LOCAL_RANK"]))}

    progress = work / "progress" / f"rank{rank}"
    curve = open(work / "losses" / f"rank{rank}.jsonl", "a", buffering=1)
    torch.manual_seed(0)
    data = dataset()

    def record(step: int, loss: float) -> None:
        curve.write(json.dumps({"step": step, "loss": loss, "pid": os.getpid()}) + "\n")

    if args.pipe:
        pending: list[float] = []

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(out, y)
            micro = len(engine.fwd_outputs)  # micro-batches this stage already ran in this step
            if micro == 0:
                pending.clear()
            pending.append(loss.item())
            if micro == GAS - 1:
                record(engine.global_steps + 1, sum(pending))
            return loss

        net = PipelineModule(layers=list(mlp()), num_stages=2, loss_fn=loss_fn, partition_method="uniform")
        engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), **init_kwargs)
        grid = engine.grid
        sampler = DistributedSampler(data, grid.data_parallel_size, grid.data_parallel_id, shuffle=True, seed=3)
        batches = RepeatingLoader(DataLoader(data, batch_size=MICRO_BATCH, sampler=sampler))
        for _ in range(args.steps):
            progress.write_text(str(engine.global_steps + 1))
            engine.train_batch(batches)
            time.sleep(args.step_sleep)
    elif args.loader_loop or args.own_loader:
        model = Regression()
        if args.loader_loop:
            engine, _, trainloader, _ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), training_data=dataset(args.samples), **init_kwargs
            )
            sampler = trainloader.data_sampler
        else:
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), **init_kwargs)
            own = dataset(args.samples)
            sampler = DistributedSampler(own, shuffle=True, seed=5)
            trainloader = DataLoader(own, batch_size=MICRO_BATCH, sampler=sampler)
        pending: list[float] = []
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for _, (x, y) in enumerate(trainloader):
                progress.write_text(str(engine.global_steps + 1))
                if engine.micro_steps % GAS == 0:
                    pending = []
                loss = engine(x, y)
                pending.append(float(loss.detach()))
                engine.backward(loss)
                if engine.is_gradient_accumulation_boundary():
                    record(engine.global_steps + 1, sum(pending))
                engine.step()
                if engine.micro_steps % GAS == 0:
                    time.sleep(args.step_sleep)
    else:
        from torchpass.adapters.deepspeed import steps

        model = Regression()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), training_data=data, **init_kwargs)
        for step in steps(engine, args.steps):
            with step:
                progress.write_text(str(step.number))
                micro_losses = []
                for x, y in step.micro_batches():
                    loss = engine(x, y)
                    micro_losses.append(loss)
                    if len(micro_losses) == GAS:
                        # Recorded before the optimizer step: a process killed after committing
                        # this step (the survivors then resume after it) has logged it already.
                        record(step.number, sum(float(l.detach()) for l in micro_losses))
                    engine.backward(loss)
                    engine.step()
                time.sleep(args.step_sleep)

    digest = final_digest(engine)
    (work / "out" / f"rank{rank}.json").write_text(json.dumps({"digest": digest, "pid": os.getpid()}))
    dist.barrier()


if __name__ == "__main__":
    main()
