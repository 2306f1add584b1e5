"""Core benchmark: steady-state overhead against torchrun, recovery breakdown, transfer against loopback TCP.

    python bench/core_bench.py            # ~40 MB of migrated state per rank
    python bench/core_bench.py --quick    # ~10 MB, a few minutes

All figures come from one invocation, so they share the machine's conditions:
torchrun and torchpass runs of the same job alternate; the loopback-TCP baseline
moves the same number of bytes between two processes, into touched and into
freshly allocated memory, right before the migrations it is compared with.
Results go to ``bench/out/core.json`` and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from torchpass.core.inject import inject
from torchpass.core.ledger import read_ledger

JOB = Path(__file__).resolve().parent / "jobs" / "ddp_mlp.py"


def _job_args(steps: int, width: int, depth: int, times: Path) -> list[str]:
    return [str(JOB), "--steps", str(steps), "--width", str(width), "--depth", str(depth), "--times", str(times)]


def run_job(kind: str, work: Path, steps: int, width: int, depth: int, fault: tuple[str, int, int] | None = None) -> dict:
    """Run the job under ``torchrun`` or ``torchpass``; optionally inject ``(fault, rank, at_step)``."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    times = work / "times.jsonl"
    args = _job_args(steps, width, depth, times)
    if kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", *args]
    else:
        cmd = [
            sys.executable, "-m", "torchpass", "launch", "--standalone", "--nproc-per-node", "4", "--spares-per-node", "1",
            "--run-dir", str(work / "run"), "--config", "fast_detect", "--quiet", *args,
        ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=work, stdout=open(work / "log", "w"), stderr=subprocess.STDOUT, env=env)
    if fault is not None:
        what, rank, at = fault
        while not times.exists() or sum(1 for _ in open(times)) < at:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} job ended early:\n{(work / 'log').read_text()[-2000:]}")
            time.sleep(0.05)
        inject(work / "run", what, rank=rank)
    if proc.wait() != 0:
        raise RuntimeError(f"{kind} job failed:\n{(work / 'log').read_text()[-3000:]}")
    records = [json.loads(line) for line in open(times)]
    out = {"wall_s": time.time() - t0, "step_s": [r["seconds"] for r in records]}
    if kind == "torchpass":
        out["migrations"] = [e for e in read_ledger(work / "run") if e["type"] == "migration"]
    return out


def _sender(port_q: "mp.Queue[int]", nbytes: int) -> None:
    payload = torch.ones(nbytes // 4)
    view = memoryview(payload.view(torch.uint8).numpy())
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port_q.put(listener.getsockname()[1])
        for _ in range(2):
            conn, _ = listener.accept()
            with conn:
                conn.sendall(view)


def loopback_tcp(nbytes: int) -> dict[str, float]:
    """Loopback TCP throughput (GB/s) for ``nbytes``, into touched and into freshly allocated memory."""
    port_q: mp.Queue[int] = mp.get_context("spawn").Queue()
    sender = mp.get_context("spawn").Process(target=_sender, args=(port_q, nbytes), daemon=True)
    sender.start()
    port = port_q.get()
    out = {}
    for label, fresh in (("touched", False), ("fresh", True)):
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if not fresh:
            buf.fill_(0)
        view = memoryview(buf.numpy())
        with socket.create_connection(("127.0.0.1", port)) as conn:
            t0 = time.perf_counter()
            while len(view):
                n = conn.recv_into(view)
                view = view[n:]
            out[label] = nbytes / (time.perf_counter() - t0) / 1e9
    sender.join()
    return out


def _median_step(run: dict, skip: int) -> float:
    return statistics.median(run["step_s"][skip:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=3, help="alternating torchrun/torchpass pairs for the overhead ratio")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "core.json"))
    args = p.parse_args()
    width, depth, steps = (512, 8, 25) if args.quick else (1024, 8, 30)
    skip = 5
    root = Path(tempfile.mkdtemp(prefix="torchpass-bench-"))
    params = depth * (width * width + width) + width + 1
    result: dict = {"width": width, "depth": depth, "params": params, "torch": torch.__version__, "cpus": os.cpu_count()}

    medians: dict[str, list[float]] = {"torchrun": [], "torchpass": []}
    for i in range(args.rounds):
        for kind in ("torchrun", "torchpass") if i % 2 == 0 else ("torchpass", "torchrun"):
            medians[kind].append(_median_step(run_job(kind, root / f"{kind}{i}", steps, width, depth), skip))
    result["steady_state"] = {
        "median_step_s": {k: statistics.median(v) for k, v in medians.items()},
        "per_round": medians,
        "ratio": statistics.median(medians["torchpass"]) / statistics.median(medians["torchrun"]),
    }

    recoveries = {}
    for fault in ("kill", "hang"):
        run = run_job("torchpass", root / f"fault-{fault}", steps, width, depth, fault=(fault, 2, steps // 2))
        m = [e for e in run["migrations"] if e["outcome"] == "success"][-1]
        recoveries[fault] = {"timings": m["timings"], "bytes_moved": m["bytes_moved"], "wall_s": run["wall_s"]}
    state_bytes = recoveries["kill"]["bytes_moved"]
    tcp = loopback_tcp(state_bytes)
    fetch_s = recoveries["kill"]["timings"].get("fetch", 0.0)
    transfer_gbps = state_bytes / fetch_s / 1e9 if fetch_s else 0.0
    result["recovery"] = recoveries
    result["transfer"] = {
        "state_bytes": state_bytes,
        "fetch_GBps": transfer_gbps,
        "loopback_tcp_GBps": tcp,
        "ratio_vs_touched": transfer_gbps / tcp["touched"],
        "ratio_vs_fresh": transfer_gbps / tcp["fresh"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    ss = result["steady_state"]
    print(f"| model | {params / 1e6:.1f} M parameters, {state_bytes / 1e6:.0f} MB moved per migration |")
    print("|---|---|")
    print(f"| steady-state step (median) | torchrun {ss['median_step_s']['torchrun'] * 1e3:.1f} ms, torchpass {ss['median_step_s']['torchpass'] * 1e3:.1f} ms, ratio {ss['ratio']:.3f} |")
    for fault, rec in recoveries.items():
        phases = ", ".join(f"{k} {v:.2f}" for k, v in rec["timings"].items())
        print(f"| recovery, {fault} | {phases} (s) |")
    tr = result["transfer"]
    print(
        f"| transfer | {tr['fetch_GBps']:.2f} GB/s vs loopback TCP {tcp['touched']:.2f} GB/s into touched memory "
        f"({tr['ratio_vs_touched']:.2f}x), {tcp['fresh']:.2f} GB/s into fresh memory ({tr['ratio_vs_fresh']:.2f}x) |"
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
