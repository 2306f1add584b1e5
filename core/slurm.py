"""Slurm: a node set to DRAIN, FAIL or under maintenance becomes a planned migration; srun's placement.

Two things a Slurm user expects of ``torchpass launch``:

* **Drain before the node goes.** An administrator drains a node
  (``scontrol update nodename=n1 state=drain reason=...``), marks it failing
  (``state=fail``) or books a maintenance reservation on it
  (``scontrol create reservation flags=maint nodes=n1 starttime=...``). Each
  launcher asks slurmctld about its own node with Slurm's client, ``sinfo``
  and ``scontrol``, every ``signals.poll_interval_s`` (one RPC per node per
  interval: slurmctld serves thousands a second), and its ranks move to spares
  on other nodes while the node still runs them. Slurm's reason goes to the
  ledger.
* **srun's placement.** Under ``srun``, node count, node rank and the first
  node's address come from the step's environment, as torchrun users script
  them by hand (``--nnodes $SLURM_NNODES --node_rank $SLURM_NODEID
  --master_addr $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)``),
  except that the first node is reached at its Slurm ``NodeAddr``, which is
  its name unless the administrator configured another address.

The node this launcher runs on is ``SLURMD_NODENAME`` (set by slurmd in every
step), else the host's short name.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Mapping

from .node_signals import NodeSignal

__all__ = ["SlurmDrainSource", "SlurmPlacement", "slurm_node_name", "slurm_placement", "slurm_available"]

DRAIN_FLAGS = {"drain": "slurm-drain", "fail": "slurm-fail", "maint": "slurm-maint"}
"""``sinfo`` state flags (``%StateComplete``, lower case) that announce a node's end, and the ledger cause each starts.
``drain`` covers DRAINING and DRAINED; ``fail`` is FAIL/FAILING (expected to fail soon); ``maint`` is a maintenance
reservation that has begun."""

CLIENT_TIMEOUT_S = 20.0
"""How long one ``sinfo``/``scontrol`` call may take before the poll counts as failed (slurmctld busy or down)."""


def slurm_available() -> bool:
    """Slurm's client commands are on PATH."""
    return shutil.which("sinfo") is not None and shutil.which("scontrol") is not None


def slurm_node_name(environ: Mapping[str, str] = os.environ) -> str:
    """The Slurm node this process runs on: slurmd's ``SLURMD_NODENAME``, else the short host name."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname().split(".", 1)[0]


def _run(args: list[str]) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(args)} did not answer within {CLIENT_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[:300]}")
    return done.stdout


def expand_hostlist(expression: str) -> list[str]:
    """``n[1-3],m1`` -> ``["n1", "n2", "n3", "m1"]``, by Slurm's own parser."""
    return _run(["scontrol", "show", "hostnames", expression]).split()


def parse_node_state(line: str) -> tuple[set[str], str]:
    """``sinfo -O StateComplete:|,Reason:`` output for one node -> (state flags, reason)."""
    state, _, reason = line.strip().partition("|")
    flags = {f.rstrip("*~#!%$@^-") for f in state.lower().split("+") if f}
    return flags, reason.strip() if reason.strip().lower() != "none" else ""


def parse_reservations(text: str) -> list[dict[str, str]]:
    """``scontrol show reservation --oneliner`` -> one dict per reservation (values may hold no spaces but Reason)."""
    out = []
    for line in text.splitlines():
        if not line.strip() or "ReservationName=" not in line:
            continue
        fields: dict[str, str] = {}
        for token in line.split():
            key, eq, value = token.partition("=")
            if eq:
                fields[key] = value
        out.append(fields)
    return out


class SlurmDrainSource:
    """Polls slurmctld about one node: its DRAIN/FAIL/MAINT state, and maintenance reservations about to start."""

    name = "slurm"

    def __init__(self, node: str, maint_lead_s: float):
        self.node = node
        self.maint_lead_s = maint_lead_s

    def poll(self) -> list[NodeSignal]:
        found = self._node_state() or self._maintenance_ahead()
        return [found] if found is not None else []

    def _node_state(self) -> NodeSignal | None:
        line = _run(["sinfo", "--noheader", "--Node", "--nodes", self.node, "--Format", "StateComplete:|,Reason:512"])
        if not line.strip():
            raise RuntimeError(f"slurmctld does not know node {self.node!r} (set SLURMD_NODENAME to its Slurm name)")
        flags, reason = parse_node_state(line.splitlines()[0])
        for flag, cause in DRAIN_FLAGS.items():
            if flag in flags:
                return NodeSignal(cause, reason or f"node {self.node} is {flag}", {"node": self.node, "state": "+".join(sorted(flags))})
        return None

    def _maintenance_ahead(self) -> NodeSignal | None:
        now = time.time()
        for res in parse_reservations(_run(["scontrol", "show", "reservation", "--oneliner"])):
            if "MAINT" not in res.get("Flags", "").split(",") or not res.get("Nodes"):
                continue
            start = datetime.fromisoformat(res["StartTime"]).timestamp()
            if start - now > self.maint_lead_s or self.node not in expand_hostlist(res["Nodes"]):
                continue
            name = res.get("ReservationName", "?")
            return NodeSignal(
                "slurm-maint",
                f"maintenance reservation {name} starts {res['StartTime']}",
                {"node": self.node, "reservation": name, "start": res["StartTime"]},
            )
        return None


@dataclass(frozen=True)
class SlurmPlacement:
    """Where an ``srun`` step puts this launcher."""

    nnodes: int
    node_rank: int
    master_addr: str


def slurm_placement(environ: Mapping[str, str] = os.environ) -> SlurmPlacement | None:
    """The step's node count, this node's index and the first node's name, if this runs inside an ``srun`` step.

    ``sbatch``'s batch script alone (``SLURM_JOB_ID`` without ``SLURM_STEP_ID``) runs on one node only: its
    ``SLURM_NNODES`` describes the allocation, not the launchers that will start, so it gives nothing."""
    if "SLURM_STEP_ID" not in environ or "SLURM_NODEID" not in environ:
        return None
    nnodes = int(environ.get("SLURM_STEP_NUM_NODES") or environ["SLURM_NNODES"])
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"]
    return SlurmPlacement(nnodes, int(environ["SLURM_NODEID"]), node_address(expand_hostlist(nodelist)[0]))


def node_address(node: str) -> str:
    """The address Slurm reaches ``node`` at (its ``NodeAddr``; the name itself when none is configured)."""
    out = _run(["sinfo", "--noheader", "--Node", "--nodes", node, "--Format", "NodeAddr:|"]).strip()
    return out.split("|", 1)[0].strip() or node
