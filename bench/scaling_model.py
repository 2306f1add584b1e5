"""A scaling model on paper: recovery time and GPU-hours lost per day at 1,024 and 16,384 H200 GPUs (issue 14).

    python bench/scaling_model.py                          # print the headline table
    python bench/scaling_model.py --write docs/scaling.md  # write the page
    python bench/scaling_model.py --out-dir bench/out      # where measured figures are read from (the default)

Nothing here runs a job. The model adds up, per failure, the phases each strategy goes
through (torchpass live migration, checkpoint restart, torchft) from components measured
in this repository on CPU (detection, planning, spare set-up, transfer efficiency, the
control plane at 1K/16K ranks) and published figures (NCCL communicator init at scale,
TCPStore init at scale, InfiniBand NDR bandwidth, H200 memory and PCIe, storage bandwidth,
job MTTF), each field of :class:`Inputs` naming its source. Measured inputs are read from
``bench/out/`` JSON (``compare/*/results.json``, ``control_plane.json``) when those files
exist, otherwise the figures written in ``docs/`` are used.

Standard library only: the page is reproducible without torch.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import math
import statistics
import textwrap
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = ["Inputs", "Outcome", "SCALES", "SLOW", "evaluate", "load_inputs", "markdown", "main"]

REPO = Path(__file__).resolve().parent.parent
DAY_S = 86_400.0
LLAMA3 = "https://arxiv.org/abs/2407.21783"
KOKOLIS = "https://arxiv.org/abs/2410.21680"
NCCLX = "https://arxiv.org/abs/2510.20171"
FT_HSDP = "https://arxiv.org/abs/2602.00277"
SEEDS_BENCH = "https://clockwork.io/blog/keeping-distributed-training-running-through-failures"
SEEDS_CALC = "https://clockwork.io/workload-failover"
SEEDS_COMPARE = "https://clockwork.io/blog/a-comparison-between-torchft-and-torchpass-for-fault-tolerant-training"


@dataclass(frozen=True)
class Scale:
    """One job size and the job's mean time to failure at that size."""

    gpus: int
    mttf_h: float


SCALES = (Scale(1024, 7.9), Scale(16384, 1.8))
"""Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research Clusters" (HPCA 2025,
https://arxiv.org/abs/2410.21680): MTTF projected from 11 months of two A100 research clusters, 7.9 h for a
1,024-GPU job and 1.8 h for a 16,384-GPU job (the figures the seeds quote, https://clockwork.io/?p=3217). Applied
here to H200 jobs unchanged: an assumption."""


@dataclass(frozen=True)
class Inputs:
    """Every number the model uses. Each field's docstring is its source; the page prints them."""

    # ---- failures and the job ------------------------------------------------------------
    qualifying_fraction: float = 350 / 419
    """Published, derived: share of failures moving the failed rank (or dropping its replica group) can
    handle. Of the 419 unplanned interruptions of Llama 3's 54-day run on 16,384 H100s (Table 5 of
    https://arxiv.org/abs/2407.21783), software bugs (54), dependencies (2), NCCL watchdog timeouts of unknown
    cause (7) and silent data corruption (6) are counted as not handled; they fall back to checkpoint restart
    under every strategy."""
    state_bytes_per_gpu: float = 109e9 * 12 / 64
    """Assumption: training state per GPU, held at both scales (weak scaling). The seeds' own benchmark job,
    Llama-4 Scout (109 B parameters) on 64 H200s (https://clockwork.io/blog/keeping-distributed-training-running-through-failures),
    at 12 bytes per parameter (fp32 parameters and two AdamW moments, as bench/compare.py sizes TorchTitan
    state), evenly sharded."""
    step_s: float = 405 * 60 / 3000
    """Assumption: one training step. The seeds' torchpass run of that job reached 3,000 steps in 405 min
    with its failures included (same page), so this is an upper bound for that job."""
    replica_group_gpus: int = 128
    """Assumption: GPUs per model replica, torchft's failure domain. Llama 3 405B's layout on 16,384 GPUs,
    tensor 8 x pipeline 16 (Table 4 of https://arxiv.org/abs/2407.21783)."""

    # ---- hardware ---------------------------------------------------------------------------
    nic_GBps: float = 400 / 8
    """Published: one ConnectX-7 NDR InfiniBand port, 400 Gb/s (https://docs.nvidia.com/networking/display/ConnectX7VPI/Introduction);
    a DGX H200 has eight single-port ConnectX-7, one per GPU
    (https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/latest/core-components.html)."""
    pcie_GBps: float = 64.0
    """Published: H200 host link, PCIe Gen5 128 GB/s both directions together (https://www.nvidia.com/en-us/data-center/h200/),
    so 64 GB/s each way: device-to-host staging and host-to-device loading."""
    gpu_memory_GB: float = 141.0
    """Published: H200 HBM3e capacity (https://www.nvidia.com/en-us/data-center/h200/). Only checked: the state
    per GPU must fit."""

    # ---- communicators and the store (published, interpolated) -----------------------------
    nccl_init_small: tuple[int, float] = (8, 2.5)
    """Not found published: NCCL communicator init on 8 H100s, ~2.5 s per rank, as the project brief (BRIEF.md
    section 6b) states it without a source. The small end of the line interpolated for NCCL init."""
    nccl_init_large: tuple[int, float] = (98_304, 265.0)
    """Published: stock NCCL initialisation at 96K GPUs, ~265 s, in Meta's NCCLX paper
    (https://arxiv.org/abs/2510.20171; the figure as quoted by summaries of the paper, with NCCLX's own startup
    11x faster). NCCL init at N ranks is interpolated linearly between this and the small end: an assumption
    (the paper calls stock init super-linear, so the line overestimates between the ends)."""
    store_init_large: tuple[int, float] = (98_304, 100.0)
    """Published: TCPStore (libuv backend) initialisation with 96K ranks completes in ~100 s
    (https://docs.pytorch.org/tutorials/intermediate/TCPStore_libuv_backend.html). Scaled linearly with ranks:
    an assumption. Paid by every rank a restart relaunches."""

    # ---- detection (same for every strategy) -------------------------------------------------
    detect_s: float = 10.0
    """Configured: torchpass's default heartbeat_timeout_s (core/config.py), the bound for a stopped process or
    a lost node; used for all three strategies alike. A crashed process was detected in 0.00 s here (agent
    reaps it; docs/benchmarks.md); a rank hung inside a kernel with a live heartbeat waits hang_timeout_s
    (900 s) unless an NCCL error ends it first."""

    # ---- torchpass (measured here on CPU, except the abort) ----------------------------------
    survivor_abort_s: float = 1.0
    """Assumption, no published abort time at scale found: survivors abort their nonblocking NCCL communicators;
    the project brief reports NCCL 2.26.2 fixed abort hangs and made abort much faster
    (https://docs.nvidia.com/deeplearning/nccl/archives/nccl_2262/release-notes/index.html)."""
    report_and_plan_s: float = 0.35
    """Measured: survivors release, report, and the plan is published; mean of 0.42, 0.36, 0.26 s (ledger
    phase report_and_plan, docs/benchmarks.md, 4 ranks)."""
    control_plane_s: tuple[tuple[int, float], ...] = ((64, 0.0110), (256, 0.0118), (1024, 0.0311), (4096, 0.2190), (16384, 0.5450))
    """Measured: the controller's critical path (failure to go) against a real TCPStore with N simulated
    ranks (bench/control_plane.py, docs/benchmarks.md; its controller part: the gloo rendezvous it also measures is
    this model's NCCL init); added on top of report_and_plan_s."""
    spare_setup_s: float = 1.37
    """Measured: the spare runs the script's set-up after its assignment; the largest measured, Megatron-LM
    DP 2 x 2 instances (docs/adapters/megatron.md; 0.06-0.25 s for DDP, DeepSpeed, TorchTitan: docs/performance.md's runs). CPU, small models."""
    transfer_efficiency: float = 0.34
    """Measured: torchpass's fetch rate over the raw link it ran on (0.90 GB/s against 2.65 GB/s loopback TCP,
    docs/benchmarks.md); applied to one 400 Gb/s NIC. Whether the TCP path keeps it over InfiniBand is
    unmeasured."""
    rollback_steps: float = 0.0
    """Measured: steps recomputed per migration when every shard has a replica (HSDP, DDP: 0,
    docs/benchmarks_torchtitan.md); sharded state restored from a buddy copy costs 1 (docs/benchmarks_deepspeed.md)."""

    # ---- checkpoint restart -------------------------------------------------------------------
    relaunch_s: float = 120.0
    """Assumption: tear down and relaunch every process on a hot spare node: scheduler, imports, CUDA
    context, model build, first-step warm-up. Measured here 11-19 s for 4 CPU ranks (detect_and_restart +
    init_and_load minus the load, docs/benchmarks*.md); the seeds assume 15 min of restart in all
    (https://clockwork.io/workload-failover)."""
    storage_read_GBps_per_gpu: float = 7000 / 16384
    """Published: Llama 3's Tectonic storage, 7 TB/s peak for 16K GPUs (https://arxiv.org/abs/2407.21783), per
    GPU. A restore reads every GPU's shard at once; assumed to scale with the cluster."""
    storage_write_GBps_per_gpu: float = 2000 / 16384
    """Published: the same storage's 2 TB/s sustained, per GPU: the floor of the checkpoint interval (a save
    must be written before the next) and the cost of a synchronous save."""
    ckpt_async: bool = True
    """Assumption: saves are asynchronous (torch.distributed.checkpoint async_save): training blocks only for
    ckpt_fixed_s plus a device-to-host copy of the state at pcie_GBps."""
    ckpt_fixed_s: float = 1.0
    """Assumption: the blocking coordination of one async save (planning, barrier)."""
    fixed_interval_s: float = 5400.0
    """The seeds' cost calculator's checkpoint interval, 1.5 h (https://clockwork.io/workload-failover), for the
    second checkpoint-restart row; the first uses Young's optimal interval."""

    # ---- torchft ----------------------------------------------------------------------------------
    ft_quorum_s: float = 0.1
    """Published: the lighthouse's quorum tick, --quorum_tick_ms 100 in torchft's README
    (https://github.com/pytorch/torchft). On a failure the surviving replica groups rebuild only the
    cross-replica communicator (N / replica_group_gpus ranks); the failed group restarts like a small
    checkpoint restart and heals from a peer at the same transfer rate as torchpass."""


SLOW: dict[str, tuple[Any, str]] = {
    "spare_setup_s": (60.0, "assumption: a cold set-up of a large model on a GPU (CUDA context, allocation, compilation)"),
    "transfer_efficiency": (0.17, "measured: the lowest fetch/loopback ratio, docs/benchmarks_torchtitan.md"),
    "survivor_abort_s": (10.0, "assumption: ten times the nominal abort"),
    "rollback_steps": (1.0, "measured: sharded state from a buddy copy one step old, docs/benchmarks_deepspeed.md"),
    "relaunch_s": (600.0, "assumption: 10 min relaunch, toward the seeds' 15 min restart"),
    "ckpt_async": (False, "assumption: synchronous saves, each GPU writing at its share of sustained storage bandwidth"),
}
"""The slow case: every uncertain input at a pessimistic value, for all strategies at once."""


def field_docs(cls: type = Inputs) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal after it), whitespace collapsed."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name):
            if isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
                docs[a.target.id] = " ".join(b.value.value.split())
    return docs


# ---- components ------------------------------------------------------------------------------------


def nccl_init_s(inp: Inputs, n: int) -> float:
    """NCCL communicator init at ``n`` ranks: linear between the small and the large published points."""
    (n0, t0), (n1, t1) = inp.nccl_init_small, inp.nccl_init_large
    return t0 + (t1 - t0) * max(0, n - n0) / (n1 - n0)


def store_init_s(inp: Inputs, n: int) -> float:
    """TCPStore init with ``n`` clients, proportional to ``n``."""
    n1, t1 = inp.store_init_large
    return t1 * n / n1


def control_plane_at(inp: Inputs, n: int) -> float:
    """The measured control-plane critical path at ``n`` ranks (log-log interpolation between measured sizes)."""
    points = sorted(inp.control_plane_s)
    exact = dict(points)
    if n in exact or len(points) == 1:
        return exact.get(n, points[0][1])
    lo, hi = (points[0], points[1]) if n < points[0][0] else (points[-2], points[-1])
    for a, b in zip(points, points[1:]):
        if a[0] < n < b[0]:
            lo, hi = a, b
    if lo[1] <= 0 or hi[1] <= 0:
        return max(lo[1], hi[1])
    slope = math.log(hi[1] / lo[1]) / math.log(hi[0] / lo[0])
    return lo[1] * (n / lo[0]) ** slope


def transfer_s(inp: Inputs) -> float:
    """One GPU's state from a healthy replica into the replacement's device memory."""
    rate = min(inp.nic_GBps * inp.transfer_efficiency, inp.pcie_GBps)
    return inp.state_bytes_per_gpu / (rate * 1e9)


def ckpt_load_s(inp: Inputs) -> float:
    """Every GPU reads its shard of the newest checkpoint from shared storage."""
    return inp.state_bytes_per_gpu / (min(inp.storage_read_GBps_per_gpu, inp.nic_GBps) * 1e9)


def ckpt_blocking_s(inp: Inputs) -> float:
    """What one checkpoint save costs the training loop."""
    if inp.ckpt_async:
        return inp.ckpt_fixed_s + inp.state_bytes_per_gpu / (inp.pcie_GBps * 1e9)
    return inp.state_bytes_per_gpu / (inp.storage_write_GBps_per_gpu * 1e9)


def young_interval_s(inp: Inputs, restores_per_day: float) -> float:
    """Young's optimal interval sqrt(2 C M) (J. W. Young, CACM 17(9), 1974, https://doi.org/10.1145/361147.361115)
    for failures needing a restore every M seconds, no shorter than writing one checkpoint takes."""
    if restores_per_day <= 0:
        return math.inf
    floor = inp.state_bytes_per_gpu / (inp.storage_write_GBps_per_gpu * 1e9)
    return max(math.sqrt(2 * ckpt_blocking_s(inp) * DAY_S / restores_per_day), floor)


def restart_phases(inp: Inputs, n: int) -> dict[str, float]:
    """Checkpoint restart of ``n`` GPUs, failure to training again (lost progress not included)."""
    return {
        "detect": inp.detect_s,
        "relaunch": inp.relaunch_s,
        "store init": store_init_s(inp, n),
        "NCCL init": nccl_init_s(inp, n),
        "checkpoint load": ckpt_load_s(inp),
        "first step": inp.step_s,
    }


def migration_phases(inp: Inputs, n: int) -> dict[str, float]:
    """torchpass on ``n`` GPUs, failure to the re-executed step done (design.md section 4, on NCCL)."""
    return {
        "detect": inp.detect_s,
        "abort": inp.survivor_abort_s,
        "report and plan": inp.report_and_plan_s + control_plane_at(inp, n),
        "spare set-up": inp.spare_setup_s,
        "transfer": transfer_s(inp),
        "rebuild (NCCL init)": nccl_init_s(inp, n),
        "re-execute step": inp.step_s * (1 + inp.rollback_steps),
    }


def torchft_phases(inp: Inputs, n: int) -> tuple[dict[str, float], dict[str, float]]:
    """torchft on ``n`` GPUs: the stall every surviving group sees, and the failed group's way back."""
    groups = max(1, n // inp.replica_group_gpus)
    stall = {
        "detect": inp.detect_s,
        "quorum": inp.ft_quorum_s,
        "cross-replica NCCL init": nccl_init_s(inp, groups),
        "discarded step": inp.step_s,
    }
    g = inp.replica_group_gpus
    rejoin = {
        "detect": inp.detect_s,
        "relaunch": inp.relaunch_s,
        "store init": store_init_s(inp, g),
        "NCCL init": nccl_init_s(inp, g),
        "heal (transfer)": transfer_s(inp),
        "first step": inp.step_s,
    }
    return stall, rejoin


# ---- strategies -------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One strategy at one scale."""

    strategy: str
    gpus: int
    mttf_h: float
    failures_per_day: float
    recovery_s: float
    """A handled failure: until the job trains at full width again (checkpoint restart: until it is back at the
    step it had reached, half an interval recomputed on average; torchft: the survivors' stall)."""
    phases: dict[str, float]
    interval_s: float
    """Checkpoint interval (for the failures that still need a restore)."""
    lost_failures_gpu_h: float
    """GPU-hours lost per day to recoveries and recomputation."""
    lost_saves_gpu_h: float
    """GPU-hours lost per day to checkpoint saves."""
    lost_per_handled_gpu_h: float
    """GPU-hours one handled failure costs (checkpoint restart: every failure, recomputation included)."""
    notes: dict[str, float] = field(default_factory=dict)

    @property
    def lost_gpu_h(self) -> float:
        return self.lost_failures_gpu_h + self.lost_saves_gpu_h

    @property
    def ettr(self) -> float:
        """Effective training time ratio: the share of the GPU-hours that trains."""
        return 1 - self.lost_gpu_h / (self.gpus * 24)


def _checkpointing(inp: Inputs, n: int, restores_per_day: float, interval_s: float | None = None) -> tuple[float, float, float]:
    """(interval, GPU-seconds lost per day to restores and recomputation, GPU-seconds lost per day to saves)."""
    t = interval_s if interval_s is not None else young_interval_s(inp, restores_per_day)
    if math.isinf(t):
        return t, 0.0, 0.0
    restart = sum(restart_phases(inp, n).values())
    return t, restores_per_day * n * (restart + t / 2), n * ckpt_blocking_s(inp) * DAY_S / t


def evaluate(inp: Inputs, scale: Scale) -> list[Outcome]:
    """Every strategy at ``scale`` under ``inp``."""
    if inp.state_bytes_per_gpu > inp.gpu_memory_GB * 1e9:
        raise ValueError(f"state_bytes_per_gpu {inp.state_bytes_per_gpu:.3g} does not fit in {inp.gpu_memory_GB} GB")
    n = scale.gpus
    per_day = 24 / scale.mttf_h
    handled, fallback = per_day * inp.qualifying_fraction, per_day * (1 - inp.qualifying_fraction)
    out = []
    restart = restart_phases(inp, n)
    for name, fixed in (("checkpoint restart, Young interval", None), ("checkpoint restart, 1.5 h interval", inp.fixed_interval_s)):
        t, lost, saves = _checkpointing(inp, n, per_day, fixed)
        recovery = sum(restart.values()) + t / 2
        phases = {**restart, "half an interval": t / 2}
        out.append(Outcome(name, n, scale.mttf_h, per_day, recovery, phases, t, lost / 3600, saves / 3600, n * recovery / 3600))
    t, lost_fb, saves = _checkpointing(inp, n, fallback)
    mig = migration_phases(inp, n)
    per_failure = n * sum(mig.values())
    lost = handled * per_failure + lost_fb
    out.append(Outcome("torchpass", n, scale.mttf_h, per_day, sum(mig.values()), mig, t, lost / 3600, saves / 3600, per_failure / 3600))
    stall, rejoin = torchft_phases(inp, n)
    g = min(n, inp.replica_group_gpus)
    per_failure = (n - g) * sum(stall.values()) + g * max(sum(stall.values()), sum(rejoin.values()))
    lost = handled * per_failure + lost_fb
    ft = Outcome("torchft", n, scale.mttf_h, per_day, sum(stall.values()), stall, t, lost / 3600, saves / 3600, per_failure / 3600)
    ft.notes = {"group rejoin (s)": sum(rejoin.values()), **{f"rejoin: {k}": v for k, v in rejoin.items()}}
    out.append(ft)
    return out


# ---- measured inputs from bench/out --------------------------------------------------------------


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def load_inputs(out_dir: Path) -> tuple[Inputs, dict[str, str]]:
    """The inputs, with measured fields replaced by what ``out_dir``'s benchmark JSON holds; and for each
    replaced field, the file it came from."""
    updates: dict[str, Any] = {}
    origin: dict[str, str] = {}

    def rel(p: Path) -> str:
        return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)

    full = out_dir / "compare" / "full" / "results.json"
    data = _read(full)
    if isinstance(data, dict):
        recs = ((data.get("runs") or {}).get("torchpass") or {}).get("faults", {}).get("recoveries", [])
        plan = [r["phases"]["report_and_plan"] for r in recs if "report_and_plan" in r.get("phases", {})]
        if plan:
            updates["report_and_plan_s"], origin["report_and_plan_s"] = statistics.mean(plan), rel(full)
        ratio = (data.get("transfer") or {}).get("ratio")
        if ratio:
            updates["transfer_efficiency"], origin["transfer_efficiency"] = float(ratio), rel(full)
        cp = data.get("control_plane") or []
        if cp:
            updates["control_plane_s"] = tuple((int(r["ranks"]), float(r.get("controller_critical_s", r["critical_s"]))) for r in cp)
            origin["control_plane_s"] = rel(full)
    cp_file = out_dir / "control_plane.json"
    rows = _read(cp_file)
    if isinstance(rows, list) and rows:
        updates["control_plane_s"] = tuple((int(r["ranks"]), float(r.get("controller_critical_s", r["critical_s"]))) for r in rows)
        origin["control_plane_s"] = rel(cp_file)
    setups = []
    for results in sorted((out_dir / "compare").glob("*/results.json")):
        recs = (((_read(results) or {}).get("runs") or {}).get("torchpass") or {}).get("faults", {}).get("recoveries", [])
        setups += [(r["phases"]["spare_setup"], results) for r in recs if "spare_setup" in r.get("phases", {})]
    if setups and max(setups)[0] > Inputs.spare_setup_s:
        updates["spare_setup_s"], origin["spare_setup_s"] = max(setups)[0], rel(max(setups)[1])
    return replace(Inputs(), **updates), origin


def slow(inp: Inputs) -> Inputs:
    return replace(inp, **{k: v for k, (v, _) in SLOW.items()})


# ---- the page ------------------------------------------------------------------------------------------


def _fmt(value: Any, name: str = "") -> str:
    if name == "state_bytes_per_gpu":
        return f"{value / 1e9:.1f} GB"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):
        return ", ".join(f"{n}: {t:.3g} s" for n, t in value)
    if isinstance(value, tuple):
        return f"{value[1]:g} s at {value[0]:,} GPUs"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.3g}"
    return str(value)


def _unit(name: str) -> str:
    for suffix, unit in (("_s", " s"), ("_GBps", " GB/s"), ("_GBps_per_gpu", " GB/s"), ("_GB", " GB")):
        if name.endswith(suffix) and not isinstance(getattr(Inputs, name, None), tuple):
            return unit
    return ""


def headline(rows: list[Outcome], slow_rows: list[Outcome]) -> list[str]:
    """The headline table: one line per scale and strategy."""
    slow_of = {(o.gpus, o.strategy): o for o in slow_rows}
    lines = [
        "| GPUs | MTTF | failures/day | strategy | recovery per handled failure (s) | GPU-h lost per handled failure | GPU-h lost/day (of which saves) | ETTR | slow case: recovery (s), GPU-h/day |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for o in rows:
        s = slow_of[(o.gpus, o.strategy)]
        name = f"**{o.strategy}**" if o.strategy == "torchpass" else o.strategy
        lines.append(
            f"| {o.gpus:,} | {o.mttf_h:g} h | {o.failures_per_day:.2f} | {name} | {o.recovery_s:,.0f} | {o.lost_per_handled_gpu_h:,.1f} "
            f"| {o.lost_gpu_h:,.0f} ({o.lost_saves_gpu_h:,.0f}) | {o.ettr:.2%} | {s.recovery_s:,.0f}, {s.lost_gpu_h:,.0f} |"
        )
    return lines


def _phases_table(inp: Inputs, rows: list[Outcome]) -> list[str]:
    lines = ["| GPUs | strategy | phases (s) | total (s) |", "|---:|---|---|---:|"]
    for o in rows:
        if o.strategy.endswith("1.5 h interval"):
            continue
        parts = ", ".join(f"{k} {v:.1f}" for k, v in o.phases.items())
        lines.append(f"| {o.gpus:,} | {o.strategy} | {parts} | {o.recovery_s:.1f} |")
        if o.strategy == "torchft":
            rejoin = ", ".join(f"{k.removeprefix('rejoin: ')} {v:.1f}" for k, v in o.notes.items() if k.startswith("rejoin: "))
            lines.append(f"| {o.gpus:,} | torchft, the failed group ({min(o.gpus, inp.replica_group_gpus)} GPUs) back | {rejoin} | {o.notes['group rejoin (s)']:.1f} |")
    return lines


def markdown(inp: Inputs, origin: dict[str, str], command: str) -> str:
    """The page (docs/scaling.md)."""
    rows = [o for sc in SCALES for o in evaluate(inp, sc)]
    slow_inp = slow(inp)
    slow_rows = [o for sc in SCALES for o in evaluate(slow_inp, sc)]
    by = {(o.gpus, o.strategy): o for o in rows}
    docs = field_docs()
    small, big = SCALES[0].gpus, SCALES[1].gpus
    tp = {sc.gpus: by[(sc.gpus, "torchpass")] for sc in SCALES}
    ck = {sc.gpus: by[(sc.gpus, "checkpoint restart, Young interval")] for sc in SCALES}
    ck15 = {sc.gpus: by[(sc.gpus, "checkpoint restart, 1.5 h interval")] for sc in SCALES}
    ft = {sc.gpus: by[(sc.gpus, "torchft")] for sc in SCALES}
    measured_from = ", ".join(sorted(set(origin.values()))) or "none found under bench/out, so the figures written in docs/ (runs of 2026-11-30 to 12-02) are used"
    out = [
        "# Scaling model: recovery and lost GPU-hours at 1,024 and 16,384 H200 GPUs",
        "",
        f"Written by `{command}` on {time.strftime('%Y-%m-%d')}. Measured inputs read from benchmark JSON: {measured_from}.",
        "",
        "A model on paper. Nothing here ran on a GPU, and torchpass itself runs on gloo/CPU only today ([design.md](design.md) section 13):",
        "this models the GPU path as designed (NCCL communicators aborted and rebuilt, state moved over InfiniBand) from the",
        "components measured in this repository on CPU and from published figures, each input below with its source. It is",
        "an estimate of orders of magnitude and of which phase dominates, not a result; the last section lists what a GPU",
        "cluster has to measure to confirm or refute it.",
        "",
        "## Headline",
        "",
        *headline(rows, slow_rows),
        "",
        "Recovery per handled failure: until the job trains at full width again (checkpoint restart: until it is back at the step it had",
        "reached, so half a checkpoint interval of recomputation is included; torchft: the stall of the surviving replica groups, while the",
        "failed group comes back later, see the phases below). GPU-h lost per handled failure: that time x the GPUs it idles. GPU-h lost per",
        f"day adds the failures no strategy handles ({1 - inp.qualifying_fraction:.1%}, restored from a checkpoint under every strategy) and",
        "the checkpoint saves (in brackets).",
        "ETTR: the share of the job's GPU-hours that trains. Slow case: every uncertain input at its pessimistic value (table below).",
        "",
        "## The model",
        "",
        "- Failures per day = 24 h / MTTF of the whole job; every failure stops every GPU of a synchronous job. A share",
        f"  q = {inp.qualifying_fraction:.3f} can be handled by moving the failed rank (torchpass) or dropping its replica group (torchft);",
        "  the rest are restored from the newest checkpoint, under every strategy.",
        "- Lost GPU-hours = recovery time x all GPUs of the job (survivors wait), plus recomputed work, plus checkpoint saves.",
        "  Spare GPUs are not counted: checkpoint restart needs the same replacement nodes to restart at full size.",
        "- **Checkpoint restart** per failure: detect + relaunch + TCPStore init(N) + NCCL init(N) + checkpoint load + one step, then",
        "  half an interval T recomputed on average. Saves cost C each (async: fixed part + device-to-host copy; sync: the write at the",
        "  GPU's share of storage bandwidth), so N x C x 24 h / T per day. T is Young's optimum sqrt(2 C M), M the mean time between",
        "  restores, and no shorter than writing one checkpoint takes; the second row uses the seeds' 1.5 h instead.",
        "- **torchpass** per handled failure (design.md section 4, on NCCL): detect + survivors' abort + report and plan (measured, plus the",
        "  control plane's critical path at N) + spare set-up + state transfer (state / (400 Gb/s x measured efficiency)) + rebuild of",
        "  every communicator (a full NCCL init at N: every group is rebuilt on the new generation) + the re-executed step (+ rollback",
        "  steps for buddy copies). Unhandled failures: checkpoint restart with T optimal for their rate.",
        "- **torchft** per handled failure: the surviving groups stall for detect + quorum + NCCL init of the cross-replica group (N / G",
        "  ranks) + the discarded step; the failed group (G GPUs) is idle until it has relaunched, initialised its own communicators,",
        "  healed from a peer (same transfer rate) and stepped: lost = (N - G) x stall + G x rejoin. Its samples in that time are",
        "  skipped, counted as those GPUs' lost hours. Unhandled failures: as for torchpass.",
        "- Not in the model: per-step overhead in steady state (see below), failures during a recovery, hangs detected only by a",
        "  timeout, stragglers.",
        "",
        "## Inputs",
        "",
        "| input | value | slow case | source |",
        "|---|---|---|---|",
    ]
    for f in dataclasses.fields(Inputs):
        value = getattr(inp, f.name)
        slow_v = SLOW.get(f.name)
        src = docs.get(f.name, "")
        if f.name in origin:
            src += f" **Read from {origin[f.name]}.**"
        slow_txt = f"{_fmt(slow_v[0], f.name)}{_unit(f.name)} ({slow_v[1]})" if slow_v else ""
        out.append(f"| `{f.name}` | {_fmt(value, f.name)}{_unit(f.name)} | {slow_txt} | {src} |")
    out += [
        f"| MTTF | {SCALES[0].mttf_h:g} h at {small:,} GPUs, {SCALES[1].mttf_h:g} h at {big:,} | | Published: projected by Kokolis et al. ({KOKOLIS}) from two A100 clusters; the seeds cite them. Applied to H200 unchanged: an assumption. Llama 3 saw 419 unplanned interruptions in 54 days on 16,384 H100s ({LLAMA3}): one per {54 * 24 / 419:.1f} h, longer than the projected 1.8 h. |",
        "",
        f"Derived: NCCL init {nccl_init_s(inp, small):.1f} s at {small:,} and {nccl_init_s(inp, big):.1f} s at {big:,} GPUs; TCPStore init "
        f"{store_init_s(inp, small):.1f} s and {store_init_s(inp, big):.1f} s; state transfer {transfer_s(inp):.2f} s "
        f"({inp.state_bytes_per_gpu / 1e9:.1f} GB at {min(inp.nic_GBps * inp.transfer_efficiency, inp.pcie_GBps):.1f} GB/s); checkpoint load "
        f"{ckpt_load_s(inp):.0f} s; blocking save {ckpt_blocking_s(inp):.1f} s (slow case {ckpt_blocking_s(slow_inp):.0f} s).",
        "",
        "## Recovery per failure, by phase (nominal inputs)",
        "",
        *_phases_table(inp, rows),
        "",
        "## Against checkpoint restart and torchft",
        "",
    ]
    for n in (small, big):
        gain_ck = ck[n].lost_gpu_h - tp[n].lost_gpu_h
        out.append(
            f"- **{n:,} GPUs.** torchpass recovers a handled failure in {tp[n].recovery_s:.0f} s against {ck[n].recovery_s:.0f} s for checkpoint "
            f"restart at its optimal interval ({ck[n].interval_s / 60:.0f} min) and {ck15[n].recovery_s:.0f} s at 1.5 h; torchft's survivors "
            f"stall {ft[n].recovery_s:.0f} s while the failed group needs {ft[n].notes['group rejoin (s)']:.0f} s. Per day: torchpass "
            f"{tp[n].lost_gpu_h:,.0f} GPU-h, checkpoint restart {ck[n].lost_gpu_h:,.0f} (optimal) / {ck15[n].lost_gpu_h:,.0f} (1.5 h), "
            f"torchft {ft[n].lost_gpu_h:,.0f}. Of torchpass's loss, {_share_fallback(inp, SCALES[0] if n == small else SCALES[1]):.0%} "
            f"is the unhandled failures' checkpoint restarts and the saves that cover them. Its gain over optimal checkpoint restart, "
            f"{gain_ck:,.0f} GPU-h/day, is {gain_ck / (n * 24):.2%} of the job: a steady per-step overhead above that cancels it."
        )
    rebuild_share = tp[big].phases["rebuild (NCCL init)"] / tp[big].recovery_s
    floor = inp.state_bytes_per_gpu / (inp.storage_write_GBps_per_gpu * 1e9)
    bound = [n for n in (small, big) if math.isclose(ck[n].interval_s, floor)]
    if bound:
        out.append(
            f"- At {', '.join(f'{n:,}' for n in bound)} GPUs checkpoint restart's optimal interval is the write floor ({floor:.0f} s): storage "
            f"writes checkpoints without pause at its sustained {inp.storage_write_GBps_per_gpu * 16384 / 1000:.0f} TB/s per 16K GPUs, "
            "which real jobs rarely afford. That row is checkpoint restart's best case, not its common practice."
        )
    out += [
        f"- **Where torchpass's time goes at {big:,} GPUs**: the rebuild, a full NCCL init of the world, is {rebuild_share:.0%} of its recovery "
        f"({nccl_init_s(inp, big):.0f} s of {tp[big].recovery_s:.0f} s), and every GPU waits through it. torchft rebuilds only the "
        f"cross-replica communicator ({big // inp.replica_group_gpus} ranks) and idles one replica group, so its per-failure loss is "
        + (
            f"lower ({ft[big].lost_per_handled_gpu_h:,.0f} against {tp[big].lost_per_handled_gpu_h:,.0f} GPU-h): at this scale torchpass beats "
            "torchft only with a rebuild that does not re-initialise the whole world (NCCL's shrink/grow/split, or an init overlapped with "
            "the spare's set-up and the transfer) or through torchft's steady-state cost, below."
            if ft[big].lost_per_handled_gpu_h < tp[big].lost_per_handled_gpu_h
            else f"{ft[big].lost_per_handled_gpu_h:,.0f} against torchpass's {tp[big].lost_per_handled_gpu_h:,.0f} GPU-h."
        ),
        "- **What the model leaves to steady state.** Per-step overhead multiplies N x 24 h: 1 % of step time is "
        f"{small * 24 * 0.01:,.0f} GPU-h/day at {small:,} GPUs and {big * 24 * 0.01:,.0f} at {big:,}, the same order as the failure losses above. "
        "Measured here on CPU (not transferable to GPUs): torchpass at 0.98 x plain DDP, 1.04 x for TorchTitan HSDP, 1.20 x for DeepSpeed "
        "ZeRO-1 with a buddy copy every step, 1.05-1.62 x for Megatron-LM; torchft 1.09 x (docs/benchmarks*.md, docs/adapters/megatron.md). "
        f"The seeds attribute most of torchft's 930 min (against torchpass's 405 and checkpoint restart's 818 for 3,000 steps on 64 H200s, "
        f"{SEEDS_BENCH}; {SEEDS_COMPARE}) to its per-step cross-replica all-reduce over gloo rather than to recoveries.",
        f"- **The seeds' calculator** ({SEEDS_CALC}: 1.5 h interval, 15 min restart, MTTF 7.9 h at 1,024 GPUs) loses "
        f"{1024 * (900 + 2700) / 3600 * 24 / 7.9:,.0f} GPU-h/day at 1,024 GPUs; the 1.5 h row above loses {ck15[small].lost_gpu_h:,.0f}, and an "
        f"async checkpoint every {ck[small].interval_s / 60:.0f} min {ck[small].lost_gpu_h:,.0f}. Much of the published gap between live "
        "migration and checkpoint restart is the checkpoint interval; with synchronous saves (slow case) the optimal interval is "
        f"{next(o for o in slow_rows if o.gpus == small and o.strategy.endswith('Young interval')).interval_s / 60:.0f} min and the gap reopens.",
        f"- **Published recoveries to compare with.** Meta's FT-HSDP (torchft's approach at O(100K) GPUs, {FT_HSDP}) cut the stall per failure "
        f"from 10 min for synchronous restart to 3 min; this model gives checkpoint restart {sum(restart_phases(inp, big).values()) / 60:.1f} min "
        f"before recomputation at {big:,} GPUs and torchft a {ft[big].recovery_s:.0f} s stall, so either its inputs are optimistic at scale or "
        "FT-HSDP's stall includes phases modelled here as zero (node replacement, waiting for a healthy quorum). The seeds claim "
        "recovery in under 2 min (press coverage, https://letsdatascience.com/news/clockwork-deploys-torchpass-to-avoid-training-restarts-d8e1db6e); "
        f"this model gives torchpass {tp[small].recovery_s:.0f} s at {small:,} GPUs, mostly detection, the re-executed step and NCCL init.",
        "",
        "## What must be measured on a GPU cluster to confirm this",
        "",
        "Each line names the input it would replace; all at 1,024 and at 16,384 H200s unless said otherwise.",
        "",
        "1. **Communicator rebuild** (`nccl_init_*`, the largest term at 16K): `ncclCommInitRank` and `ncclCommInitRankScalable` of the world,",
        "   cold process against a warm spare that already ran a 1-rank init; `ncclCommSplit` of every TP/DP/PP group from the rebuilt world;",
        "   and a delta rebuild (`ncclCommShrink` + `ncclCommGrow` + `ncclCommSplit` with key = the old rank, NCCL >= 2.29) against a full init.",
        "2. **Abort latency** (`survivor_abort_s`): `ncclCommAbort` of every nonblocking communicator on survivors while a kernel waits on a",
        "   dead peer (GPU off the bus, node powered off), NCCL >= 2.26.2, with torch's `_abort_process_group`.",
        "3. **Detection at scale** (`detect_s`): fault to `g/<g>/end` for a SIGKILL, an Xid 79, a node power loss and a hung kernel with a",
        "   live heartbeat; and the store load of 16K heartbeats per second.",
        "4. **State transfer into device memory** (`transfer_efficiency`): GB/s per NIC for torchpass's TCP path (pinned host staging,",
        "   IPoIB or the front-end network) and for NCCL send/recv on the rebuilt world, into the spare's HBM; 8 at once for a node loss.",
        "5. **Spare set-up** (`spare_setup_s`): the real model's set-up on an H200 after assignment: CUDA context, allocation, compilation",
        "   and CUDA-graph capture (which must be redone after a rebuild).",
        "6. **Control plane and store** (`control_plane_s`, `store_init_large`): the bench simulates 16K ranks with one client; 16K real",
        "   clients writing statuses, readiness and mirrors at once, TCPStore against etcd, and store-based barriers.",
        "7. **One step and its re-execution** (`step_s`, `rollback_steps`): the re-executed step's time after a rebuild (allocator, caches),",
        "   and the buddy copy's cost per step on GPU (device-to-host plus push), the steady-state overhead this model leaves out.",
        "8. **The baselines on the same cluster**: checkpoint restart end to end (scheduler, imports, rendezvous, NCCL, DCP load from the",
        "   cluster's storage; async save blocking time) for `relaunch_s` and the storage figures; torchft's stall, rejoin and per-step overhead.",
        "9. **The failure mix** (`qualifying_fraction`, MTTF): which failures a migration resolves, from the ledger over weeks of a real job.",
        "",
    ]
    return "\n".join(out)


def _share_fallback(inp: Inputs, scale: Scale) -> float:
    """The share of torchpass's daily loss due to unhandled failures and their checkpoints."""
    o = next(o for o in evaluate(inp, scale) if o.strategy == "torchpass")
    per_day = 24 / scale.mttf_h
    handled = per_day * inp.qualifying_fraction * scale.gpus * o.recovery_s / 3600
    return 1 - handled / o.lost_gpu_h


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", metavar="PAGE", type=Path, help="write the Markdown page there (docs/scaling.md)")
    p.add_argument("--out-dir", type=Path, default=REPO / "bench" / "out", help="where benchmark JSON is read from")
    args = p.parse_args(argv)
    inp, origin = load_inputs(args.out_dir)
    command = "python bench/scaling_model.py" + (f" --write {args.write}" if args.write else "")
    if args.write:
        args.write.write_text(markdown(inp, origin, command))
    rows = [o for sc in SCALES for o in evaluate(inp, sc)]
    slow_rows = [o for sc in SCALES for o in evaluate(slow(inp), sc)]
    print("\n".join(headline(rows, slow_rows)))
    if origin:
        print("\nmeasured inputs read from: " + ", ".join(f"{k} <- {v}" for k, v in origin.items()))


if __name__ == "__main__":
    main()
