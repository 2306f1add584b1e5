"""Benchmark job, checkpoint restart (the status quo): DDP under ``torchrun --max-restarts``, a
torch.distributed.checkpoint save every K steps, and a restart from the newest complete checkpoint."""

import time

T_START = time.time()  # before the heavy imports: a restart's cost includes them

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from bench.workload import StepLog, batch, build_model, loss_of, parse_job_args, slot


def newest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """The newest checkpoint DCP finished writing (its ``.metadata`` is written last, by the coordinator)."""
    done = [(int(p.name.split("_")[1]), p) for p in root.glob("step_*") if (p / ".metadata").exists()]
    return max(done) if done else None


def main() -> None:
    args = parse_job_args(__doc__, checkpointing=True)
    cfg = args.workload
    every = args.checkpoint_every
    root = Path(args.checkpoint_dir)
    # torchrun --standalone keeps one store across restarts, and the restarted group's gloo rendezvous read
    # the dead group's addresses from it (connectFullMesh refused): one key prefix per restart avoids that.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=dist.PrefixStore(f"bench/attempt{attempt}", store), rank=rank, world_size=world)
    log = StepLog(args.log_dir, rank, T_START)
    model = DistributedDataParallel(build_model(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    start = 1
    found = newest_checkpoint(root)
    if found is not None:
        t0 = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=found[1])
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = found[0] + 1
        log.event("loaded", step=found[0], seconds=time.perf_counter() - t0)
    log.event("ready", step=start - 1)
    for step in range(start, cfg.steps + 1):
        t0 = time.perf_counter()
        x, y = batch(cfg, slot(step, rank, world))
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        log.step(step, time.perf_counter() - t0, samples=world * cfg.batch_per_rank)
        if step % every == 0 and step < cfg.steps:
            t1 = time.perf_counter()
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root / f"step_{step:06d}")
            log.event("saved", step=step, seconds=time.perf_counter() - t1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
