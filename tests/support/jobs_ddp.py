"""The DDP reference job of the end-to-end tests (plain PyTorch, CPU, gloo; ``--device cuda`` puts it on GPU 0).

Dropout, AdamW with weight decay, a warm-up LR schedule and a shuffled
DistributedSampler: every piece of state a migration must carry over; with
``--batchnorm``, a BatchNorm layer whose running statistics each rank updates
from its own batches (per-rank buffers, in the digest). Each rank
writes ``progress/rank<r>`` (the step it is executing) for the harness to time
faults, appends each finished step's loss to ``losses/rank<r>.jsonl`` (so the
curve of a process that is killed survives it), and at the end writes
``out/rank<r>.json``: a SHA-256 of its model, optimizer and scheduler state,
and its PID.
"""

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchpass
from torchpass.core.manifest import state_digest


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workdir", required=True)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--zero", action="store_true", help="ZeroRedundancyOptimizer: sharded optimizer state (buddy copies)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="tiny values make DDP's rebuilt layout differ")
    p.add_argument("--spare-setup-sleep", type=float, default=0.0, help="a spare's set-up takes this much longer")
    p.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d after the first layer (per-rank running statistics)")
    p.add_argument("--no-broadcast-buffers", action="store_true", help="DDP(broadcast_buffers=False): ranks' buffers never sync")
    p.add_argument("--pg-timeout-s", type=float, default=0.0, help="the process group's timeout (0: torch's default)")
    p.add_argument("--device", default="cpu", help="'cuda': model, optimizer and data on GPU 0 of every rank (gloo carries CUDA tensors)")
    p.add_argument("--bug-at", default="", help="RANK:STEP: that rank raises a script error mentioning gloo at that step, every time")
    args = p.parse_args()
    work = Path(args.workdir)
    (work / "progress").mkdir(parents=True, exist_ok=True)
    (work / "out").mkdir(parents=True, exist_ok=True)
    (work / "losses").mkdir(parents=True, exist_ok=True)

    if os.environ.get("TORCHPASS_ROLE") == "spare":
        time.sleep(args.spare_setup_sleep)  # a big model's construction: the migration stays in its joining phase
    dist.init_process_group("gloo", **({"timeout": timedelta(seconds=args.pg_timeout_s)} if args.pg_timeout_s else {}))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2048, 16, generator=g)
    y = torch.sin(x.sum(1, keepdim=True))
    data = TensorDataset(x, y)
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, world, rank, shuffle=True, seed=3))
    norm = [torch.nn.BatchNorm1d(64)] if args.batchnorm else []
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), *norm, torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1))
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    net = net.to(device)
    local_buffers = {"broadcast_buffers": False} if args.no_broadcast_buffers else {}  # passing it at all warns in torch 2.13
    model = DistributedDataParallel(net, bucket_cap_mb=args.bucket_cap_mb, **local_buffers)
    if args.zero:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-3, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    progress = work / "progress" / f"rank{rank}"
    curve = open(work / "losses" / f"rank{rank}.jsonl", "a", buffering=1)
    run = torchpass.Run(model=model, optimizer=opt, scheduler=sched, data=loader)
    bug_rank, bug_step = map(int, args.bug_at.split(":")) if args.bug_at else (-1, -1)
    for step in run.steps(args.steps):
        with step:
            progress.write_text(str(step.number))
            if rank == bug_rank and step.number == bug_step:
                # A script bug whose message looks like a transport failure: no spare can fix it.
                raise RuntimeError("gloo: the script passed tensors of mismatched sizes to all_reduce (test bug)")
            xb, yb = (t.to(device) for t in step.batch())
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            # Recorded before the optimizer step: a process killed after committing
            # this step (the survivors then resume after it) has logged it already.
            curve.write(json.dumps({"step": step.number, "loss": loss.item(), "pid": os.getpid()}) + "\n")
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            time.sleep(args.step_sleep)
    local_opt = opt.optim if args.zero else opt
    digest = state_digest({"model": model.state_dict(), "optimizer": local_opt.state_dict(), "scheduler": sched.state_dict()})
    (work / "out" / f"rank{rank}.json").write_text(json.dumps({"digest": digest, "pid": os.getpid()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
