"""What a collective costs through a rebuildable group, against gloo directly, side by side in one run.

    python -m bench.collective_overhead [--rounds 5] [--iters 400]

Two local processes. Each round times the same collectives first on a bare
``ProcessGroupGloo`` and then through torchpass's ``RebuildableProcessGroup``
(the forwarding and the abandonable ``Work`` of ``core/pending_work.py``),
both on their own gloo transport over the same store. Reported per operation
and size: the median per-call latency of each over the rounds, and their
ratio. ``_reduce_scatter_base`` is the case gloo gives no future for, so its
completion goes through the transport's waiter thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

SIZES = {"4 KiB": 1024, "4 MiB": 1024 * 1024}


def _ops(group: dist.ProcessGroup, numel: int) -> dict[str, Callable[[], None]]:
    t = torch.ones(numel)
    out = torch.empty(numel // 2)
    return {
        "allreduce": lambda: group.allreduce([t]).wait(),
        "_reduce_scatter_base": lambda: group._reduce_scatter_base(out, t).wait(),
    }


def _time(fn: Callable[[], None], iters: int) -> float:
    for _ in range(max(iters // 10, 5)):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _worker(rank: int, port: int, rounds: int, iters: int) -> None:
    from torchpass.core import comms

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    raw = dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), rank, 2, timedelta(seconds=60))
    comms.install()
    dist.init_process_group("gloo", store=dist.PrefixStore("tp/", store), rank=rank, world_size=2)
    wrapped = dist.group.WORLD
    assert isinstance(wrapped, comms.RebuildableProcessGroup)
    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for size, numel in SIZES.items():
            for name, fn in _ops(raw, numel).items():
                results.setdefault(f"{name} {size}", {}).setdefault("gloo", []).append(_time(fn, iters))
            for name, fn in _ops(wrapped, numel).items():
                results[f"{name} {size}"].setdefault("torchpass", []).append(_time(fn, iters))
    if rank == 0:
        print("RESULT" + json.dumps(results), flush=True)
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.port, args.rounds, args.iters)
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.collective_overhead", "--rounds", str(args.rounds), "--iters", str(args.iters), "--port", str(port)]
    procs = [subprocess.Popen([*cmd, "--worker", str(r)], stdout=subprocess.PIPE, text=True, env=env) for r in range(2)]
    out = procs[0].communicate()[0]
    procs[1].wait()
    results = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[len("RESULT") :])
    print(f"{'collective':<28} {'gloo us':>9} {'torchpass us':>13} {'ratio':>7}   (median of {args.rounds} rounds x {args.iters})")
    for key, by in results.items():
        g, t = statistics.median(by["gloo"]) * 1e6, statistics.median(by["torchpass"]) * 1e6
        print(f"{key:<28} {g:>9.1f} {t:>13.1f} {t / g:>7.3f}")


if __name__ == "__main__":
    main()
