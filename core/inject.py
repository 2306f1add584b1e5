"""``torchpass inject`` and ``torchpass migrate``: faults and planned migrations on demand.

``inject`` puts a real fault into a running job, to test migration on your workload.

Faults are signals to the processes recorded in ``workers.json`` (so run it on
the machine hosting the target): ``kill`` (SIGKILL, a crash), ``hang``
(SIGSTOP, a wedged process), ``term`` (SIGTERM, a planned drain), ``node``
(SIGKILL to a node's launcher and every worker of that node at once, a node
lost). ``migrate`` asks the controller for a planned migration of a rank, as a
scheduler draining a node would.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from .status import read_workers

__all__ = ["inject", "request_migration", "FAULTS"]

FAULTS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "term": signal.SIGTERM}


def _find(rows: list[dict], rank: int | None, wid: str | None) -> dict:
    for row in rows:
        if wid is not None and row["wid"] == wid:
            return row
        if wid is None and row["rank"] == rank and row["role"] == "active":
            return row
    what = f"worker {wid!r}" if wid is not None else f"active worker with rank {rank}"
    raise LookupError(f"no {what} in workers.json (see `torchpass status`)")


def inject(run_dir: str | Path, fault: str, rank: int | None = None, wid: str | None = None) -> list[int]:
    """Send the fault; returns the PIDs signalled."""
    data = read_workers(run_dir)
    target = _find(data["workers"], rank, wid)
    if fault in FAULTS:
        os.kill(target["pid"], FAULTS[fault])
        return [target["pid"]]
    if fault != "node":
        raise ValueError(f"unknown fault {fault!r}; expected one of kill, hang, term, node")
    node = target["node"]
    info = (data.get("nodes") or {}).get(str(node)) or {}
    pids = []
    if info.get("pid"):
        pids.append(info["pid"])
    pids += [r["pid"] for r in data["workers"] if r["node"] == node and r["role"] in ("active", "spare")]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone: a node loss kills everything, in any order
    return pids


def request_migration(run_dir: str | Path, rank: int, secret_file: str | None = None) -> None:
    """The operator's planned migration: the rank hands its own state to a spare at the next step boundary.

    It is a record in the job's store, so it takes the job secret (``job_secret.for_operator``): the controller
    does not see a request sealed with anything else.
    """
    from .control import Keys, Mailbox, Report, StoreAddress
    from .job_secret import for_operator

    data = read_workers(run_dir)
    _find(data["workers"], rank, None)
    host, port = data["store"].rsplit(":", 1)
    address = StoreAddress(host, int(port), for_operator(run_dir, secret_file), etcd=data.get("store_etcd"))
    Mailbox(address.connect(timeout=10.0), Keys.events).post(Report("migrate", rank=rank, detail={"signal": "operator"}))
