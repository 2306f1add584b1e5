"""Benchmark job, DeepSpeed framework mode: the benchmark's GPT in a DeepSpeed engine, three ways (``--mode``).

* ``plain``: DeepSpeed's own loop (forward, ``engine.backward``, ``engine.step``) under ``torchrun``, no fault
  tolerance: the steady-state baseline;
* ``checkpoint``: the same loop under ``torchrun --max-restarts``, ``engine.save_checkpoint`` every K steps and
  ``engine.load_checkpoint`` of the newest one (DeepSpeed's ``latest`` tag) at start: DeepSpeed's own
  checkpoint restart;
* ``torchpass``: the loop is ``torchpass.adapters.deepspeed.steps``, under ``torchpass launch``, and the
  ``--deepspeed_config`` file carries ``"torchpass": {"enabled": true}``.

The DeepSpeed config file (``--deepspeed_config``) is written by the driver (``bench/strategies.py``).

Every mode trains rank r on batch ``slot(step, r, world)`` of the shared token stream, so the work per step
is the same and a restarted process reads what the failed one would have.
"""

import time

T_START = time.time()  # before the heavy imports: a restart's cost includes them

import argparse
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from bench.workload import GPT, RankBatches, StepLog, batch, build_model, loss_of, parse_job_args, slot


class GPTLoss(torch.nn.Module):
    """The benchmark's GPT with its loss as the forward's output (what a DeepSpeed engine trains)."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_of(self.gpt, x, y)


def main() -> None:
    def configure(p: argparse.ArgumentParser) -> None:
        p.add_argument("--mode", choices=("plain", "checkpoint", "torchpass"), required=True)
        p.add_argument("--checkpoint-dir", help="--mode checkpoint: where engine.save_checkpoint writes")
        p.add_argument("--checkpoint-every", type=int, default=0, help="--mode checkpoint: K, save after every K-th step")
        deepspeed.add_config_arguments(p)

    args = parse_job_args(__doc__, configure=configure)
    if args.mode == "checkpoint" and not (args.checkpoint_dir and args.checkpoint_every > 0):
        raise SystemExit("--mode checkpoint needs --checkpoint-dir and --checkpoint-every K > 0")
    cfg = args.workload
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = StepLog(args.log_dir, rank, T_START)
    model = GPTLoss(build_model(cfg))
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    samples = world * cfg.batch_per_rank

    if args.mode == "torchpass":
        from torchpass.adapters.deepspeed import steps

        log.event("ready", step=0)
        for step in steps(engine, cfg.steps, data=RankBatches(cfg, rank, world)):
            t0 = time.perf_counter()
            with step:
                for x, y in step.micro_batches():
                    engine.backward(engine(x, y))
                    engine.step()
            if step.done:
                log.step(step.number, time.perf_counter() - t0, samples=samples)
        dist.destroy_process_group()
        return

    root = Path(args.checkpoint_dir) if args.mode == "checkpoint" else None
    if root is not None and (root / "latest").exists():
        t0 = time.perf_counter()
        engine.load_checkpoint(str(root))
        log.event("loaded", step=engine.global_steps, seconds=time.perf_counter() - t0)
    log.event("ready", step=engine.global_steps)
    for step in range(engine.global_steps + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        x, y = batch(cfg, slot(step, rank, world))
        engine.backward(engine(x, y))
        engine.step()
        log.step(step, time.perf_counter() - t0, samples=samples)
        if root is not None and step % args.checkpoint_every == 0 and step < cfg.steps:
            t1 = time.perf_counter()
            save_committed(engine, root, f"step_{step:06d}")
            log.event("saved", step=step, seconds=time.perf_counter() - t1)
    dist.destroy_process_group()


def save_committed(engine, root: Path, tag: str) -> None:
    """``engine.save_checkpoint``, then name it ``latest`` once every rank has written its part.

    DeepSpeed 0.19.8's rank 0 writes ``latest`` as soon as its own files are written, before the barrier that
    ends the save: a rank killed during the save then leaves a ``latest`` whose shards are missing and the
    restart fails to load. Committing after the barrier, by an atomic rename, is what a careful user does and
    the fair baseline: a kill mid-save restarts from the previous checkpoint."""
    engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    dist.barrier()
    if dist.get_rank() == 0:
        staged = root / "latest.tmp"
        staged.write_text(tag)
        os.replace(staged, root / "latest")


if __name__ == "__main__":
    main()
