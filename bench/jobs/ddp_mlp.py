"""Benchmark job: a DDP MLP written with the plain-PyTorch API; runs under torchrun or torchpass launch.

Rank 0 appends one JSON line per step (step, wall time of the step) to ``--times``.
The model size sets the migrated state: parameters x 4 bytes, plus 2x for AdamW.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchpass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--times", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(4096, args.width)
    y = torch.randn(4096, 1)
    data = TensorDataset(x, y)
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, world, rank, seed=0))
    layers = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run = torchpass.Run(model=model, optimizer=opt, data=loader)
    out = open(args.times, "a", buffering=1) if rank == 0 else None
    for step in run.steps(args.steps):
        t0 = time.perf_counter()
        with step:
            xb, yb = step.batch()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
        if out is not None and step.done:
            out.write(json.dumps({"step": step.number, "seconds": time.perf_counter() - t0, "t": time.time()}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
