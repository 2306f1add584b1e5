"""A plain PyTorch DDP job made migratable with torchpass (CPU, gloo).

    torchpass launch --nproc-per-node 4 --spares-per-node 1 examples/ddp/train.py --steps 20

Run it with plain `torchrun` and it trains the same way, without migration.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchpass
from torchpass.core.manifest import state_digest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", default="", help="write final losses and a state digest here (rank 0)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra work per step (demos)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(4096, 32, generator=g)
    y = (x @ torch.randn(32, 1, generator=g)).squeeze(1) + 0.1 * torch.randn(4096, generator=g)
    dataset = TensorDataset(x, y)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, world, rank, seed=7))

    net = torch.nn.Sequential(
        torch.nn.Linear(32, args.hidden), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(args.hidden, 1)
    )
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))

    losses = {}
    run = torchpass.Run(model=model, optimizer=opt, scheduler=sched, data=loader)
    for step in run.steps(args.steps):
        with step:
            xb, yb = step.batch()
            loss = torch.nn.functional.mse_loss(model(xb).squeeze(1), yb)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            losses[step.number] = loss.item()
            if rank == 0 and step.number % 5 == 0:
                print(f"step {step.number} loss {losses[step.number]:.6f}", flush=True)
            if args.step_sleep:
                time.sleep(args.step_sleep)

    if args.out:
        digest = state_digest({"model": model.state_dict(), "optimizer": opt.state_dict()})
        gathered = [None] * world
        dist.all_gather_object(gathered, {"rank": rank, "losses": losses, "digest": digest, "pid": os.getpid()})
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
