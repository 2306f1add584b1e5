"""``torchpass status``: who is who in a running (or finished) job.

Reads ``workers.json`` from the run directory and, while the job's store is
reachable, the live heartbeats (step, phase, age) of every worker.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["read_workers", "format_status"]


def read_workers(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / "workers.json"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} has no workers.json; is it the --run-dir of a torchpass launch?")
    return json.loads(path.read_text())


def _heartbeats(data: dict[str, Any], run_dir: str | Path, secret_file: str | None) -> dict[str, Any]:
    import torch.distributed as dist  # torch is only needed for the live view

    from .control import Heartbeat, Keys, signed, try_get
    from .job_secret import for_operator

    store_addr = data.get("store")
    if not store_addr:
        return {}
    host, port = store_addr.rsplit(":", 1)
    try:
        base = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=2.0), wait_for_workers=False)
    except (RuntimeError, OSError):
        return {}  # the job is over; workers.json alone tells the final picture
    # A live job: its records are only readable with its secret (SecretError names the ways to give it).
    store = signed(base, for_operator(run_dir, secret_file), timedelta(seconds=2.0))
    beats = {}
    for row in data["workers"]:
        hb = try_get(store, Keys.heartbeat(row["wid"]), Heartbeat)
        if hb is not None:
            beats[row["wid"]] = hb
    return beats


def format_status(run_dir: str | Path, secret_file: str | None = None) -> str:
    data = read_workers(run_dir)
    beats = _heartbeats(data, run_dir, secret_file)
    lines = [
        f"generation {data['generation']}, world size {data['world_size']}"
        + ("" if beats else " (store unreachable: showing the last recorded state)")
    ]
    lines.append(f"  {'worker':<8} {'role':<9} {'rank':>4} {'node':>4} {'pid':>8} {'gen':>4} {'step':>6} {'phase':<8} {'heartbeat':>9}")
    order = {"active": 0, "spare": 1, "retired": 2, "finished": 3, "lost": 4}
    now = time.time()
    for row in sorted(data["workers"], key=lambda r: (order.get(r["role"], 5), r["rank"] if r["rank"] is not None else 1 << 30, r["wid"])):
        hb = beats.get(row["wid"])
        rank = "-" if row["rank"] is None else str(row["rank"])
        step, phase, age = ("", "", "")
        if hb is not None:
            step, phase, age = str(hb.step), hb.phase, f"{now - hb.t:.1f}s ago"
        lines.append(
            f"  {row['wid']:<8} {row['role']:<9} {rank:>4} {row['node']:>4} {row['pid']:>8} {row['generation']:>4} {step:>6} {phase:<8} {age:>9}"
        )
    return "\n".join(lines)
