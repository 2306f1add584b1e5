"""Benchmark job, live migration: the same DDP loop written with the plain-PyTorch API, under ``torchpass launch``."""

import time

T_START = time.time()  # before the heavy imports: a spare's set-up includes them

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torchpass
from bench.workload import RankBatches, StepLog, build_model, loss_of, parse_job_args


def main() -> None:
    args = parse_job_args(__doc__)
    cfg = args.workload
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = StepLog(args.log_dir, rank, T_START)
    model = DistributedDataParallel(build_model(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    run = torchpass.Run(model=model, optimizer=opt, data=RankBatches(cfg, rank, world))
    log.event("ready", step=0)
    for step in run.steps(cfg.steps):
        t0 = time.perf_counter()
        with step:
            x, y = step.batch()
            loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        if step.done:
            log.step(step.number, time.perf_counter() - t0, samples=world * cfg.batch_per_rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
