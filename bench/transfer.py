"""State transfer against loopback TCP, by state size: where per-migration fixed costs stop mattering.

    python -m bench.transfer [--sizes-mb 25 100 400 1000] [--repeats 3]

For each size, a source process publishes a rank's state (AdamW-shaped:
parameters and two moments, float32, a few dozen tensors) on a real
:class:`~torchpass.core.transfer.StateServer`; this process fetches it with
:func:`~torchpass.core.transfer.fetch_state` into a pre-faulted
:class:`~torchpass.core.transfer.ReceivePool`, as a spare does (manifest,
chunking, CRC32 verification and all). Right before, the same number of bytes
crosses loopback TCP between two processes into touched memory
(``core_bench.loopback_tcp``): the ceiling the transfer is compared with. The
best of ``--repeats`` is reported for both. Results go to
``bench/out/transfer.json`` and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import secrets
import time
from pathlib import Path

import torch

from bench.core_bench import loopback_tcp
from torchpass.core.manifest import capture
from torchpass.core.transfer import ReceivePool, StateServer, fetch_state

TENSORS_PER_CLASS = 16


def _state(nbytes: int) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str]]:
    per = max(1, nbytes // 4 // (3 * TENSORS_PER_CLASS))
    components = {
        name: {f"t{i}": torch.full((per,), float(i)) for i in range(TENSORS_PER_CLASS)}
        for name in ("params", "exp_avg", "exp_avg_sq")
    }
    return components, {"params": "params", "exp_avg": "optimizer", "exp_avg_sq": "optimizer"}


def _source(address_q: "mp.Queue[tuple[str, int]]", done: "mp.Event", nbytes: int, secret: bytes) -> None:
    components, classes = _state(nbytes)
    server = StateServer(secret=secret)
    server.publish(capture(components, classes, version=1))
    address_q.put(server.address)
    done.wait()
    server.close()


def measure(nbytes: int, repeats: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    address_q: mp.Queue[tuple[str, int]] = ctx.Queue()
    done = ctx.Event()
    secret = secrets.token_hex(16).encode()
    source = ctx.Process(target=_source, args=(address_q, done, nbytes, secret), daemon=True)
    source.start()
    address = address_q.get()
    tcp = max(loopback_tcp(nbytes)["touched"] for _ in range(repeats))
    best, moved = 0.0, 0
    for _ in range(repeats):
        pool = ReceivePool(int(nbytes * 1.05))
        t0 = time.perf_counter()
        _, _, stats = fetch_state([(address, "live")], 1, pool=pool, secret=secret)
        elapsed = time.perf_counter() - t0
        moved = stats.nbytes
        best = max(best, stats.nbytes / elapsed / 1e9)
    done.set()
    source.join()
    return {"bytes": moved, "fetch_GBps": best, "loopback_tcp_GBps": tcp, "ratio": best / tcp}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[25, 100, 400, 1000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench/out/transfer.json"))
    args = p.parse_args()
    rows = {str(mb): measure(mb << 20, args.repeats) for mb in args.sizes_mb}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print("| state | fetch (GB/s) | loopback TCP (GB/s) | ratio |\n| --- | --- | --- | --- |")
    for mb, row in rows.items():
        print(f"| {row['bytes'] / 1e6:.0f} MB | {row['fetch_GBps']:.2f} | {row['loopback_tcp_GBps']:.2f} | {row['ratio']:.2f} |")


if __name__ == "__main__":
    main()
