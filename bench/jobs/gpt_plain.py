"""Benchmark job, no fault tolerance: plain DDP under ``torchrun`` (the steady-state baseline)."""

import time

T_START = time.time()  # before the heavy imports: a restart's cost includes them

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from bench.workload import StepLog, batch, build_model, loss_of, parse_job_args, slot


def main() -> None:
    args = parse_job_args(__doc__)
    cfg = args.workload
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = StepLog(args.log_dir, rank, T_START)
    model = DistributedDataParallel(build_model(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    log.event("ready", step=0)
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        x, y = batch(cfg, slot(step, rank, world))
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        log.step(step, time.perf_counter() - t0, samples=world * cfg.batch_per_rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
