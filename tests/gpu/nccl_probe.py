"""One process of the NCCL checks: a rebuildable NCCL group released by abort and rebuilt in place.

``python nccl_probe.py rebuild STORE_PORT OUT``: a world of one on GPU 0; all-reduce, release (abort), the
released group refusing, rebuild on generation 1, all-reduce again; timings and the group's identity to OUT.

``python nccl_probe.py stuck STORE_PORT OUT RANK``: two ranks on GPU 0 (``NCCL_MULTI_RANK_GPU_ENABLE``); after
one all-reduce, rank 1 signals readiness and the test SIGSTOPs it; rank 0's next all-reduce is stuck on it
until another thread releases the generation, and rank 0 writes how long the abort took to free it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from torchpass.core import comms

TIMEOUT = timedelta(seconds=60)


def _store(port: int, rank: int, world: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=TIMEOUT, wait_for_workers=False)


def rebuild(port: int, out: Path) -> None:
    comms.install()
    torch.cuda.set_device(0)
    store = _store(port, 0, 1)
    t0 = time.perf_counter()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=TIMEOUT)
    init_s = time.perf_counter() - t0
    world = dist.group.WORLD
    assert isinstance(world, comms.RebuildableProcessGroup), type(world)
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    first_nccl = world._get_backend(torch.device("cuda"))
    t0 = time.perf_counter()
    comms.release_generation(0)
    abort_s = time.perf_counter() - t0
    try:
        dist.all_reduce(t)
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    t0 = time.perf_counter()
    comms.rebuild_all(store, 1, TIMEOUT)
    rebuild_s = time.perf_counter() - t0
    t.fill_(3.0)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    report = {
        "init_s": init_s,
        "abort_s": abort_s,
        "rebuild_s": rebuild_s,
        "refused_after_release": refused,
        "same_group_object": dist.group.WORLD is world,
        "new_inner_backend": world._get_backend(torch.device("cuda")) is not first_nccl,
        "backend_name": dist.get_backend(),
        "group_backend_name": world.getBackendName(),
        "value_after_rebuild": float(t[0].item()),
        "generation": world.generation,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
    }
    out.write_text(json.dumps(report))


def stuck(port: int, out: Path, rank: int) -> None:
    comms.install()
    torch.cuda.set_device(0)
    store = _store(port, rank, 2)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, timeout=TIMEOUT)
    t = torch.ones(1 << 16, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    store.set(f"ready/{rank}", "1")
    if rank == 1:
        time.sleep(600)  # the test SIGSTOPs this process, then kills it
        return
    store.wait(["stopped"])
    released: dict[str, float] = {}

    def release_later() -> None:
        time.sleep(1.0)
        released["at"] = time.perf_counter()
        comms.release_generation(0)
        released["abort_s"] = time.perf_counter() - released["at"]

    threading.Thread(target=release_later, daemon=True).start()
    start = time.perf_counter()
    error = ""
    try:
        dist.all_reduce(t)
        torch.cuda.synchronize()
    except Exception as exc:  # the aborted collective's error is the point of the check
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    out.write_text(
        json.dumps(
            {
                "blocked_s": end - start,
                "freed_after_release_s": end - released.get("at", end),
                "abort_s": released.get("abort_s"),
                "error": error[:500],
            }
        )
    )


if __name__ == "__main__":
    mode, port, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    if mode == "rebuild":
        rebuild(port, out)
    else:
        stuck(port, out, int(sys.argv[4]))
