"""State transfer against loopback TCP, by state size: where per-migration fixed costs stop mattering.

    python -m bench.transfer [--sizes-mb 30 200 2000] [--repeats 2]

For each size (decimal megabytes of state per rank), a source process
publishes a rank's state (AdamW-shaped: parameters and two moments, float32,
a few dozen tensors) on a real :class:`~torchpass.core.transfer.StateServer`;
this process fetches it with :func:`~torchpass.core.transfer.fetch_state` into
a pre-faulted :class:`~torchpass.core.transfer.ReceivePool`, as a spare does
(manifest, chunking, CRC32C verification and all), twice per repeat:

* ``live``: the copy a survivor publishes while it waits for the plan, whose
  chunk CRCs the source computes at publication (the source waits for them
  before the measurement starts), as a survivor's are by the time a spare asks;
* ``cold``: a ``snapshot`` copy published anew for each fetch, whose CRCs the
  source computes while it sends: the checksum at both ends inside the timing.

In the same run, right before each pair of fetches, the same number of bytes
crosses loopback TCP between two processes into touched memory
(``core_bench.loopback_tcp``): the ceiling the transfer is compared with.
Alternating them keeps whatever else loads the machine on both sides of the
ratio. The best of ``--repeats`` is reported for each, with the ratios of the
bests. Results go to ``bench/out/transfer.json`` and a Markdown table on stdout.
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


def _source(address_q: "mp.Queue[tuple[str, int]]", done: "mp.Event", nbytes: int, repeats: int, secret: bytes) -> None:
    components, classes = _state(nbytes)
    server = StateServer(secret=secret)
    server.publish(capture(components, classes, version=1))
    server.fingerprint("live", 1)  # returns once the chunk CRCs computed at publication are all in
    for version in range(1, repeats + 1):
        server.publish(capture(components, classes, version=version), "snapshot")
    address_q.put(server.address)
    done.wait()
    server.close()


def _fetch(address: tuple[str, int], copy: str, version: int, nbytes: int, secret: bytes) -> tuple[int, float]:
    """Bytes fetched and GB/s, into a pool pre-faulted beforehand (as a spare's is)."""
    pool = ReceivePool(int(nbytes * 1.05))
    t0 = time.perf_counter()
    _, _, stats = fetch_state([(address, copy)], version, pool=pool, secret=secret)
    return stats.nbytes, stats.nbytes / (time.perf_counter() - t0) / 1e9


def measure(nbytes: int, repeats: int) -> dict[str, float]:
    """Best loopback-TCP and best fetch throughputs (GB/s) for ``nbytes`` of state (``fetch``: live), and their ratios to TCP."""
    ctx = mp.get_context("spawn")
    address_q: mp.Queue[tuple[str, int]] = ctx.Queue()
    done = ctx.Event()
    secret = secrets.token_hex(16).encode()
    source = ctx.Process(target=_source, args=(address_q, done, nbytes, repeats, secret), daemon=True)
    source.start()
    address = address_q.get()
    tcp, live, cold, moved = 0.0, 0.0, 0.0, 0
    for version in range(1, repeats + 1):
        tcp = max(tcp, loopback_tcp(nbytes)["touched"])
        moved, gbps = _fetch(address, "live", 1, nbytes, secret)
        live = max(live, gbps)
        moved, gbps = _fetch(address, "snapshot", version, nbytes, secret)
        cold = max(cold, gbps)
    done.set()
    source.join()
    # fetch_GBps and ratio keep their meaning from before cold fetches were measured (bench.ab_builds reads them).
    return {"bytes": moved, "loopback_tcp_GBps": tcp, "fetch_GBps": live, "ratio": live / tcp, "cold_GBps": cold, "cold_ratio": cold / tcp}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[30, 200, 2000], help="state per rank, in decimal MB")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/out/transfer.json"))
    args = p.parse_args()
    rows = {str(mb): measure(mb * 10**6, args.repeats) for mb in args.sizes_mb}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(
        "| state | loopback TCP, touched (GB/s) | fetch, live (GB/s) | ratio | fetch, cold (GB/s) | ratio |\n"
        "| --- | --- | --- | --- | --- | --- |"
    )
    for row in rows.values():
        print(
            f"| {row['bytes'] / 1e6:.0f} MB | {row['loopback_tcp_GBps']:.2f} | {row['fetch_GBps']:.2f} | {row['ratio']:.2f} "
            f"| {row['cold_GBps']:.2f} | {row['cold_ratio']:.2f} |"
        )


if __name__ == "__main__":
    main()
