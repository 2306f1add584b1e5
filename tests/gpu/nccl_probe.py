"""One process of the NCCL checks: a rebuildable NCCL group released by abort and rebuilt in place.

``python nccl_probe.py rebuild STORE_PORT OUT``: a world of one on GPU 0; all-reduce, release (abort), the
released group refusing, rebuild on generation 1, all-reduce again; timings and the group's identity to OUT.

``python nccl_probe.py frameworks STORE_PORT OUT``: DDP, FSDP2 on a DeviceMesh and a functional collective
over a world of one whose NCCL group is released and rebuilt between steps.

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
    # A nonblocking communicator's init may still be completing when rebuild_all returns: the first
    # collective waits for it, so the rebuild's cost is measured to that collective's end.
    rebuilt_to_first_collective_s = time.perf_counter() - t0
    report = {
        "init_s": init_s,
        "abort_s": abort_s,
        "rebuild_s": rebuild_s,
        "rebuilt_to_first_collective_s": rebuilt_to_first_collective_s,
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


def frameworks(port: int, out: Path) -> None:
    """DDP's reducer, FSDP2 on a DeviceMesh and a functional collective by group name over a rebuildable NCCL
    world of one, released and rebuilt between steps; each model must end bitwise equal to the same model
    trained without any process group (with one rank, every reduction is the identity)."""
    from torch.distributed._functional_collectives import all_reduce as functional_all_reduce
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from torchpass.core.manifest import state_digest

    comms.install()
    torch.cuda.set_device(0)
    store = _store(port, 0, 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=TIMEOUT)
    mesh = init_device_mesh("cuda", (1,))

    def build() -> torch.nn.Module:
        torch.manual_seed(7)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).cuda()

    models = {"plain": build(), "ddp": DistributedDataParallel(build(), device_ids=[0]), "fsdp2": fully_shard(build(), mesh=mesh)}
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in models.items()}
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3)).cuda()
    functional = []
    for step in range(4):
        if step == 2:
            comms.release_generation(0)
            comms.rebuild_all(store, 1, TIMEOUT)
        for name, model in models.items():
            model(x).square().mean().backward()
            opts[name].step()
            opts[name].zero_grad()
        t = torch.full((8,), float(step), device="cuda")
        functional.append(float(functional_all_reduce(t, "sum", dist.group.WORLD.group_name)[0].item()))
    torch.cuda.synchronize()

    def digest(model: torch.nn.Module) -> str:
        state = {k.removeprefix("module."): (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
        return state_digest({"model": state})

    out.write_text(
        json.dumps(
            {
                "digests": {name: digest(m) for name, m in models.items()},
                "functional": functional,
                "mesh_group_is_rebuildable": isinstance(mesh.get_group(), comms.RebuildableProcessGroup),
                "generation": dist.group.WORLD.generation,
            }
        )
    )


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
    elif mode == "frameworks":
        frameworks(port, out)
    else:
        stuck(port, out, int(sys.argv[4]))
