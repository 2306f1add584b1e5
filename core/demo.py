"""``torchpass demo``: a live migration, end to end, checked bitwise against a fault-free run.

The driver runs the same 4-rank DDP job twice with ``torchpass launch`` (CPU,
gloo, local processes): once without faults, once with a rank SIGKILLed (or
SIGSTOPped, or SIGTERMed) mid-training while its output streams to the
console, then compares the two runs' final model and optimizer state and every
step's loss, bit for bit, and prints ``torchpass report``.

The job itself is ``python -m torchpass.core.demo train``: a small MLP with
dropout, AdamW, a warm-up schedule and a shuffled DistributedSampler, written
with the plain-PyTorch API.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["run_demo", "train"]

STEPS = 30
FAULT_STEP = 12
FAULT_RANK = 2


def train(argv: list[str]) -> None:
    """The demo job (runs on every rank)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from .api import Run
    from .manifest import state_digest

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 32, generator=g)
    y = torch.tanh(x @ torch.randn(32, 1, generator=g))
    data = TensorDataset(x, y)
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, world, rank, seed=1))
    net = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(512, 1))
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    curve = open(out / f"losses{rank}.jsonl", "a", buffering=1)
    run = Run(model=model, optimizer=opt, scheduler=sched, data=loader)
    for step in run.steps(args.steps):
        with step:
            (out / f"progress{rank}").write_text(str(step.number))
            xb, yb = step.batch()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            curve.write(json.dumps({"step": step.number, "loss": loss.item()}) + "\n")
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            if rank == 0 and step.number % 5 == 0:
                print(f"step {step.number:3d}  loss {loss.item():.6f}", flush=True)
            time.sleep(0.15)  # stands in for a larger model's step time, so the fault lands mid-run
    digest = state_digest({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()})
    (out / f"final{rank}.json").write_text(json.dumps({"digest": digest, "pid": os.getpid()}))
    dist.destroy_process_group()


def _launch(run_dir: Path, out: Path, quiet: bool) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torchpass.core.cli", "launch", "--standalone", "--nproc-per-node", "4",
        "--spares-per-node", "1", "--run-dir", str(run_dir), "--config", "fast_detect",
        *(["--quiet"] if quiet else []), "-m", "torchpass.core.demo", "train", "--out", str(out),
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL if quiet else None, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _results(out: Path) -> tuple[dict[int, str], dict[int, dict[int, float]]]:
    digests = {int(f.stem[5:]): json.loads(f.read_text())["digest"] for f in out.glob("final*.json")}
    curves: dict[int, dict[int, float]] = {}
    for f in out.glob("losses*.jsonl"):
        curve = curves.setdefault(int(f.stem[6:]), {})
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            curve[rec["step"]] = rec["loss"]
    return digests, curves


def run_demo(run_dir: str, fault: str) -> int:
    from .inject import inject
    from .report import build_report, format_report

    root = Path(run_dir).resolve()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    print(f"torchpass demo: 4-rank DDP job on CPU/gloo, {STEPS} steps, 1 hot spare. Output in {root}\n", flush=True)
    print("1/3  fault-free reference run ...", flush=True)
    t0 = time.time()
    ref = _launch(root / "fault_free", root / "fault_free_out", quiet=True)
    if ref.wait() != 0:
        print("the fault-free run failed; see its logs in", root / "fault_free", file=sys.stderr)
        return 1
    print(f"     done in {time.time() - t0:.0f} s\n", flush=True)
    print(f"2/3  same job; rank {FAULT_RANK} gets a {fault} at step {FAULT_STEP} (watch the [torchpass] lines):\n", flush=True)
    out = root / "migrated_out"
    job = _launch(root / "migrated", out, quiet=False)
    progress = out / f"progress{FAULT_RANK}"
    while not (progress.exists() and progress.read_text() and int(progress.read_text()) >= FAULT_STEP):
        if job.poll() is not None:
            print("the job ended before the fault was injected", file=sys.stderr)
            return 1
        time.sleep(0.02)
    inject(root / "migrated", fault, rank=FAULT_RANK)
    print(f"\n>>> torchpass inject --fault {fault} --rank {FAULT_RANK}   (real signal to pid of rank {FAULT_RANK})\n", flush=True)
    if job.wait() != 0:
        print("the migrated run failed; see", root / "migrated", file=sys.stderr)
        return 1
    print("\n3/3  bitwise check against the fault-free run", flush=True)
    ref_digests, ref_curves = _results(root / "fault_free_out")
    digests, curves = _results(out)
    same_state = digests == ref_digests and len(digests) == 4
    same_curve = curves == ref_curves
    print(f"     final model + optimizer + scheduler state identical on all 4 ranks: {same_state}")
    steps = sum(len(c) for c in curves.values())
    print(f"     loss of every step on every rank identical ({steps} values): {same_curve}\n")
    print(format_report(build_report(root / "migrated")))
    return 0 if same_state and same_curve else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["train"]:
        train(sys.argv[2:])
    else:
        raise SystemExit("usage: python -m torchpass.core.demo train --out DIR (the driver is `torchpass demo`)")
