"""``torchpass status``: who is who in a running (or finished) job.

Reads ``workers.json`` from the run directory (with the migration running, if
any, and its phase) and, while the job's store is reachable, the live
heartbeats (step, phase, age) of every worker. ``--watch`` redraws it every
interval until the job ends.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

__all__ = ["read_workers", "format_status", "watch_status"]


def read_workers(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / "workers.json"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} has no workers.json; is it the --run-dir of a torchpass launch?")
    return json.loads(path.read_text())


class _LiveView:
    """A connection to the job's store, kept across refreshes (``--watch``), for the workers' heartbeats."""

    def __init__(self, run_dir: str | Path, secret_file: str | None):
        self.run_dir, self.secret_file = run_dir, secret_file
        self._store: Any = None
        self._address: tuple[str, str | None] = ("", None)

    def heartbeats(self, data: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed as dist  # torch is only needed for the live view

        from .control import Heartbeat, Keys, signed, try_get
        from .job_secret import for_operator

        address = data.get("store") or ""
        if not address:
            return {}
        where = (address, data.get("store_etcd"))  # on etcd, the heartbeats are there, not in node 0's set-up store
        if self._store is None or where != self._address:
            try:
                if where[1] is not None:
                    from .etcd_store import EtcdStore, parse_etcd_url

                    base: Any = EtcdStore(parse_etcd_url(where[1]), timedelta(seconds=2.0))
                    if not base.check([Keys.job]):
                        return {}  # the job is over (its keys went with it)
                else:
                    host, port = address.rsplit(":", 1)
                    base = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=2.0), wait_for_workers=False)
            except (RuntimeError, OSError):
                return {}  # the job is over; workers.json alone tells the final picture
            # A live job: its records are only readable with its secret (SecretError names the ways to give it).
            self._store = signed(base, for_operator(self.run_dir, self.secret_file), timedelta(seconds=2.0))
            self._address = where
        beats = {}
        try:
            for row in data["workers"]:
                hb = try_get(self._store, Keys.heartbeat(row["wid"]), Heartbeat)
                if hb is not None:
                    beats[row["wid"]] = hb
        except (RuntimeError, OSError):
            self._store = None  # the store went away between two refreshes: the job ended
            return {}
        return beats


def format_status(run_dir: str | Path, secret_file: str | None = None, view: _LiveView | None = None) -> str:
    data = read_workers(run_dir)
    beats = (view or _LiveView(run_dir, secret_file)).heartbeats(data)
    now = time.time()
    lines = [
        f"generation {data['generation']}, world size {data['world_size']}"
        + ("" if beats else " (store unreachable: showing the last recorded state)")
    ]
    migration = data.get("migration")
    if migration:
        lines.append(
            f"  migration to generation {migration['generation']}: {migration['phase']} for {now - migration['since']:.1f} s "
            f"({migration['cause']}: {migration['message']})"
        )
    summary = Path(run_dir) / "summary.json"
    if summary.exists():
        end = json.loads(summary.read_text())
        lines.append(f"  job ended (exit code {end['exit_code']}): {end['message']}")
    lines.append(f"  {'worker':<8} {'role':<9} {'rank':>4} {'node':>4} {'pid':>8} {'gen':>4} {'step':>6} {'phase':<8} {'heartbeat':>9}")
    order = {"active": 0, "spare": 1, "retired": 2, "finished": 3, "lost": 4}
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


CLEAR = "\x1b[H\x1b[2J"
"""ANSI: cursor home, clear screen (every terminal torchpass runs in understands it)."""


def watch_status(run_dir: str | Path, secret_file: str | None, interval_s: float, out: TextIO, clear: bool = True) -> None:
    """``torchpass status --watch``: the status, redrawn every ``interval_s`` until the job has ended."""
    view = _LiveView(run_dir, secret_file)
    while True:
        text = format_status(run_dir, secret_file, view)
        stamp = time.strftime("%H:%M:%S")
        out.write(f"{CLEAR if clear else ''}torchpass status {run_dir} at {stamp} (every {interval_s:g} s; Ctrl-C to stop)\n{text}\n")
        out.flush()
        if (Path(run_dir) / "summary.json").exists():
            return
        time.sleep(interval_s)
