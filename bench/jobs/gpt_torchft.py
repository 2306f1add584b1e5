"""Benchmark job, torchft 0.2.0 (baseline only): one replica group of one rank per process, set up as torchft's
own ``train_ddp.py`` example does (Manager, fault-tolerant DDP and optimizer wrappers, gloo, a lighthouse).

Launched once per replica group, each under its own ``torchrun --max-restarts`` (torchft's documented way to
bring a failed group back), with ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE`` set.
A step whose gradient all-reduce failed is not committed; a committed step trains only the participating
groups' batches, which each ``step`` record counts (``samples``, ``participants``).
"""

import os
import time

T_START = time.time()  # before the heavy imports: a restart's cost includes them

from datetime import timedelta
from typing import Any

import torch
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

from bench.workload import StepLog, batch, build_model, loss_of, parse_job_args, slot


def main() -> None:
    args = parse_job_args(__doc__)
    cfg = args.workload
    group = int(os.environ["REPLICA_GROUP_ID"])
    groups = int(os.environ["NUM_REPLICA_GROUPS"])
    log = StepLog(args.log_dir, group, T_START)
    model = build_model(cfg)
    inner_opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner_opt.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner_opt.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench_{group}",
        timeout=timedelta(seconds=30),
    )
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner_opt)
    last = manager.current_step()
    log.event("ready", step=last)
    while last < cfg.steps:
        t0 = time.perf_counter()
        opt.zero_grad()  # starts the quorum for this step
        x, y = batch(cfg, slot(last + 1, group, groups))
        loss_of(ddp, x, y).backward()
        opt.step()
        # A committed step advances the manager's step; a group that healed from a peer jumps to the peers' step.
        now = manager.current_step()
        if now > last:
            participants = manager.num_participants()
            log.step(now, time.perf_counter() - t0, samples=participants * cfg.batch_per_rank, participants=participants)
        else:
            log.event("discarded", step=last + 1, seconds=time.perf_counter() - t0)
        last = now

if __name__ == "__main__":
    main()
