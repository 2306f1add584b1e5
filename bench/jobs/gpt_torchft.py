"""Benchmark job, torchft 0.2.0 (baseline only): one replica group of one rank per process, set up as torchft's
own ``train_ddp.py`` example does (a Manager with gloo and a lighthouse, the fault-tolerant optimizer wrapper),
except for the gradient all-reduce.

torchft 0.2.0's ``DistributedDataParallel`` wrapper crashes the survivors on CPU with gloo when a peer dies in
the middle of an all-reduce: its comm hook asserts on the future of the failed work (``assert fut._fut`` in
``torchft/ddp.py``), so every group exits, restarts and, with no healthy peer left to heal from, trains again
from step 0. The job therefore all-reduces the gradients itself, in DDP-sized buckets after the backward pass,
through the Manager's fault-tolerant ``allreduce``: a failed all-reduce is reported to the Manager and
``should_commit`` discards the step, which is what the wrapper intends.

Launched once per replica group, each under its own ``torchrun --max-restarts`` (torchft's documented way to
bring a failed group back), with ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE`` set.
A committed step trains only the participating groups' batches, which each ``step`` record counts
(``samples``, ``participants``).
"""

import os
import time

T_START = time.time()  # before the heavy imports: a restart's cost includes them

from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torchft import Manager, Optimizer, ProcessGroupGloo

from bench.workload import StepLog, batch, build_model, loss_of, parse_job_args, slot


BUCKET_BYTES = 25 << 20
"""Gradient bytes per all-reduce (torch DDP's default bucket size)."""


def buckets(model: nn.Module) -> list[list[torch.nn.Parameter]]:
    """The parameters in groups of about ``BUCKET_BYTES``, in reverse order (the order backward produces them)."""
    out: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for p in reversed(list(model.parameters())):
        if size >= BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel() * p.element_size()
    return out


def allreduce_gradients(manager: Manager, grad_buckets: list[list[torch.nn.Parameter]]) -> None:
    """Average the gradients over the participating replica groups.

    A failed all-reduce is reported to the Manager by ``wait()``; ``should_commit`` then discards the step.
    """
    flats = [torch.cat([p.grad.reshape(-1) for p in bucket]) for bucket in grad_buckets]
    works = [manager.allreduce(flat) for flat in flats]
    for work in works:
        work.wait()
    for bucket, flat in zip(grad_buckets, flats):
        offset = 0
        for p in bucket:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n


def main() -> None:
    args = parse_job_args(__doc__)
    cfg = args.workload
    group = int(os.environ["REPLICA_GROUP_ID"])
    replica_groups = int(os.environ["NUM_REPLICA_GROUPS"])
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
    grad_buckets = buckets(model)
    opt = Optimizer(manager, inner_opt)
    last = manager.current_step()
    log.event("ready", step=last)
    while last < cfg.steps:
        t0 = time.perf_counter()
        opt.zero_grad()  # starts the quorum for this step
        x, y = batch(cfg, slot(last + 1, group, replica_groups))
        loss_of(model, x, y).backward()
        allreduce_gradients(manager, grad_buckets)
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
