"""One migration on each store backend, side by side: node 0's TCPStore against a 3-member etcd cluster.

    python bench/store_backends.py [--rounds 3]

The DDP benchmark job (4 ranks + 1 spare on this machine) is run alternately on each backend; rank 2 is
SIGKILLed at step 6. Reported per backend (medians over the rounds): the migration's breakdown from the
ledger, and on etcd the requests the job made for the migration, counted by etcd itself (every member's
``grpc_server_started_total``, the gateway's requests included), minus the job's steady rate (heartbeats,
measured over the 2 s before the fault) over the migration's length, per rank. The TCPStore keeps no such
count; the c10d operations behind those requests are the same on both backends (one code path), and
``bench/control_plane.py`` counts them per member.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.etcd import EtcdCluster  # noqa: E402
from tests.support.harness import JOBS, launch  # noqa: E402

STEPS = 16
ARGS = ["--steps", str(STEPS), "--workdir", ".", "--step-sleep", "0.2"]
RANKS = 4
FAULT_RANK, FAULT_STEP = 2, 6


def etcd_requests(cluster: EtcdCluster) -> int:
    """Requests every member has started so far (all gRPC methods: the JSON gateway's calls land there)."""
    total = 0
    for port in cluster.client_ports:
        with urllib.request.urlopen(f"http://{cluster.host}:{port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("grpc_server_started_total"):
                    total += int(float(line.rsplit(" ", 1)[1]))
    return total


def one_round(backend: str, folder: Path, cluster: EtcdCluster) -> dict[str, Any]:
    extra = ["--store", cluster.url, "--rdzv-id", f"bench-{uuid.uuid4().hex[:8]}"] if backend == "etcd" else []
    run = launch(folder, JOBS / "jobs_ddp.py", ARGS, nproc=RANKS, spares=1, extra=extra)
    try:
        run.wait_step(FAULT_RANK, FAULT_STEP - 2)
        t_a, n_a = time.monotonic(), etcd_requests(cluster)
        run.wait_step(FAULT_RANK, FAULT_STEP)
        t_b, n_b = time.monotonic(), etcd_requests(cluster)
        run.inject("kill", rank=FAULT_RANK)
        while not any(m["outcome"] == "success" for m in run.migrations()):
            time.sleep(0.05)
        t_c, n_c = time.monotonic(), etcd_requests(cluster)
        assert run.wait() == 0, run.explain()
    finally:
        run.kill()
    migration = next(m for m in run.migrations() if m["outcome"] == "success")
    row: dict[str, Any] = {"backend": backend, **{k: migration["timings"].get(k, 0.0) for k in ("total", "detect", "report_and_plan", "rebuild", "resume")}}
    if backend == "etcd":
        steady = (n_b - n_a) / (t_b - t_a)
        row["requests_per_rank"] = ((n_c - n_b) - steady * (t_c - t_b)) / RANKS
        row["steady_requests_per_s"] = steady
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "store_backends.json"))
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = EtcdCluster(Path(tmp) / "etcd")
        (Path(tmp) / "etcd").mkdir()
        cluster.start()
        try:
            for i in range(args.rounds):
                for backend in ("tcp", "etcd") if i % 2 == 0 else ("etcd", "tcp"):
                    rows.append(one_round(backend, Path(tmp) / f"{backend}{i}", cluster))
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            cluster.stop()
    summary = {}
    for backend in ("tcp", "etcd"):
        mine = [r for r in rows if r["backend"] == backend]
        summary[backend] = {k: statistics.median(r[k] for r in mine) for k in mine[0] if k != "backend"}
    print(f"{'':22} {'TCPStore':>10} {'etcd':>10}")
    for key in summary["etcd"]:
        tcp = summary["tcp"].get(key)
        print(f"{key:22} {'' if tcp is None else f'{tcp:10.3f}':>10} {summary['etcd'][key]:10.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rounds": rows, "medians": summary}, indent=1))


if __name__ == "__main__":
    main()
