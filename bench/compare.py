"""torchpass against checkpoint restart and torchft on the same failure schedule (issue 5).

    python -m bench.compare                 # configs/bench/full.yaml
    python -m bench.compare --quick         # configs/bench/quick.yaml, under 5 minutes on 2 cores
    python -m bench.compare --quick workload.steps=20 strategies=[baseline,torchpass]
    python -m bench.compare --config deepspeed    # a DeepSpeed job: torchpass vs DeepSpeed's checkpoint restart
    python -m bench.compare --config torchtitan   # a TorchTitan job: torchpass vs TorchTitan's checkpointer
    python -m bench.compare --report bench/out/compare/quick/results.json   # page and plot only

Runs every strategy without faults (the steady state and the reference wall
time) and every fault-tolerant one with the seeded failure schedule, measures
loopback TCP throughput for the migrated state's size and the control plane's
scaling, then writes ``<out>/<name>/results.json``, ``docs/benchmarks.md`` (a framework
mode: ``docs/benchmarks_<framework>.md``) and ``docs/img/benchmark_<name>.png``, and
prints the page.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .config import BenchConfig, load_config
from .control_plane import markdown as control_plane_markdown
from .control_plane import measure as control_plane_measure
from .core_bench import loopback_tcp
from .metrics import RunFigures, figures, time_lost_per_fault, time_lost_per_fault_paced
from .report import markdown, plot_progress
from .runner import run_strategy
from .schedule import fault_schedule
from .strategies import REPO
from .workload import parameter_count, state_bytes
from torchpass.core.free_port import free_port

__all__ = ["main", "compare"]


def _machine() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
        platform.processor() or "unknown CPU",
    )
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model}, {os.cpu_count()} CPUs, {mem:.0f} GiB, {platform.system()} {platform.release()}"


def _versions(cfg: BenchConfig) -> dict[str, str]:
    out = {"python": platform.python_version()}
    framework = {"ddp": "torchft", "deepspeed": "deepspeed", "torchtitan": "torchtitan"}[cfg.framework]
    for dist in ("torch", framework, "torchpass"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _job_size(cfg: BenchConfig) -> dict[str, int]:
    """Parameters of the job's model, and the bytes of model and optimizer state one rank holds."""
    if cfg.framework != "torchtitan":
        params = parameter_count(cfg.workload)
        sharded = cfg.framework == "deepspeed" and cfg.zero_stage >= 1
        # fp32 parameters, AdamW's two moments; ZeRO >= 1 shards the moments (and from stage 3 the parameters).
        if not sharded:
            return {"params": params, "state_bytes": state_bytes(cfg.workload)}
        param_bytes = params * 4 // (cfg.world_size if cfg.zero_stage == 3 else 1)
        return {"params": params, "state_bytes": param_bytes + params * 8 // cfg.world_size}
    import torch
    from torchtitan.models.llama3 import Transformer, llama3_args

    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(llama3_args["debugmodel"]).parameters())
    shards = {"ddp": 1, "hsdp": 2, "fsdp": cfg.world_size}[cfg.titan_layout]
    return {"params": params, "state_bytes": params * 12 // shards}



def _figures(data: dict[str, Any]) -> RunFigures:
    return RunFigures(**{k: v for k, v in data.items() if k != "fault_s"})


def summarize(runs: dict[str, dict[str, Any]], cfg: BenchConfig) -> None:
    """Add each strategy's steady-state ratio to the baseline and its time lost per fault (both definitions)."""
    wl = cfg.workload
    for name, run in runs.items():
        if "baseline" in runs:
            run["steady_ratio"] = run["clean"]["step_s"] / runs["baseline"]["clean"]["step_s"]
        if "faults" in run:
            clean, faulty = _figures(run["clean"]), _figures(run["faults"])
            run["time_lost_per_fault_s"] = time_lost_per_fault(faulty, clean, cfg.world_size, wl.batch_per_rank)
            run["time_lost_per_fault_paced_s"] = time_lost_per_fault_paced(faulty, clean, wl.steps, cfg.world_size, wl.batch_per_rank)
    rounds = runs.get("torchpass", {}).get("steady_rounds")
    if rounds:
        runs["torchpass"]["steady_ratio"] = statistics.median(r["ratio"] for r in rounds)


def compare(cfg: BenchConfig, command: str) -> dict[str, Any]:
    """Run the comparison ``cfg`` describes; the results as a JSON-able mapping."""
    wl = cfg.workload
    if "torchft" in cfg.strategies and importlib.util.find_spec("torchft") is None:
        raise SystemExit(
            "strategies includes torchft but torchft is not installed: "
            'pip install -e ".[bench]" (torchft==0.2.0), or drop it with strategies=[baseline,torchpass,checkpoint]'
        )
    faults = fault_schedule(cfg.schedule, wl.steps, cfg.world_size)
    out_dir = REPO / cfg.out / cfg.name
    fault_tolerant = [s for s in cfg.strategies if s != "baseline"]
    records = {}
    # Fault-free runs first, in the configured order, then the runs with faults.
    for name in cfg.strategies:
        records[(name, "clean")] = run_strategy(name, cfg, [], out_dir / f"{name}-clean")
    for name in fault_tolerant:
        records[(name, "faults")] = run_strategy(name, cfg, faults, out_dir / f"{name}-faults")
    pairs: list[tuple[float, float]] = []
    if {"baseline", "torchpass"} <= set(cfg.strategies):
        step_of = {name: figures(records[(name, "clean")], wl.steps, cfg.world_size, wl.batch_per_rank).step_s for name in ("baseline", "torchpass")}
        pairs.append((step_of["baseline"], step_of["torchpass"]))
        for i in range(1, cfg.steady_rounds):
            order = ("torchpass", "baseline") if i % 2 else ("baseline", "torchpass")
            for name in order:
                step_of[name] = figures(run_strategy(name, cfg, [], out_dir / f"{name}-steady{i}"), wl.steps, cfg.world_size, wl.batch_per_rank).step_s
            pairs.append((step_of["baseline"], step_of["torchpass"]))
    runs: dict[str, dict[str, Any]] = {}
    for (name, kind), record in records.items():
        fig = figures(record, wl.steps, cfg.world_size, wl.batch_per_rank)
        runs.setdefault(name, {})[kind] = {
            **dataclasses.asdict(fig),
            "fault_s": [t - record.t_launch for t in record.fault_times],
        }
    if pairs:
        runs["torchpass"]["steady_rounds"] = [{"baseline_step_s": b, "torchpass_step_s": t, "ratio": t / b} for b, t in pairs]
    summarize(runs, cfg)
    results: dict[str, Any] = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": _machine(),
        "versions": _versions(cfg),
        "config": dataclasses.asdict(cfg),
        **_job_size(cfg),
        "world_size": cfg.world_size,
        "faults": [dataclasses.asdict(f) for f in faults],
        "out_dir": str(out_dir.relative_to(REPO)) if out_dir.is_relative_to(REPO) else str(out_dir),
        "runs": runs,
        "notes": [],
    }
    tp = runs.get("torchpass", {}).get("faults")
    if tp:
        results["time_to_n_ratio"] = {
            f"vs {name}": tp["wall_s"] / runs[name]["faults"]["wall_s"] for name in ("checkpoint", "torchft") if "faults" in runs.get(name, {})
        }
    if tp and tp["bytes_moved"]:
        per_migration = tp["bytes_moved"] // max(1, len(tp["recoveries"]))
        tcp = loopback_tcp(per_migration)
        fetch_gbps = tp["bytes_moved"] / tp["fetch_s"] / 1e9 if tp["fetch_s"] else 0.0
        results["transfer"] = {
            "state_bytes": per_migration,
            "fetch_GBps": fetch_gbps,
            "loopback_GBps": tcp["touched"],
            "loopback_fresh_GBps": tcp["fresh"],
            "ratio": fetch_gbps / tcp["touched"],
        }
    results["control_plane"] = [control_plane_measure(size, free_port()) for size in cfg.control_plane_sizes]
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="full", help="configs/bench/<CONFIG>.yaml: full (default), quick, deepspeed, torchtitan")
    p.add_argument("--quick", action="store_true", help="the same as --config quick")
    p.add_argument("--report", metavar="RESULTS_JSON", help="only rewrite the page and plot from a saved results.json")
    p.add_argument("--note", action="append", default=[], help="a note for the page's Notes section (repeatable)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. workload.steps=40")
    args = p.parse_args()
    cfg = load_config("quick" if args.quick else args.config, args.overrides)
    if args.report:
        results = json.loads(Path(args.report).read_text())
        cfg = load_config(results["config"]["name"], args.overrides)
        summarize(results["runs"], cfg)
    else:
        command = shlex.join(["python", "-m", "bench.compare", *sys.argv[1:]])
        results = compare(cfg, command)
    results["notes"] = list(dict.fromkeys([*results.get("notes", []), *args.note]))
    out_dir = REPO / cfg.out / cfg.name
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    plot_name = f"benchmark_{cfg.name}.png"
    plot_path = (REPO / "docs" / "img" / plot_name) if cfg.docs else out_dir / plot_name
    plot_progress(results, plot_path)
    table = control_plane_markdown(results["control_plane"]) if results["control_plane"] else ""
    page = markdown(results, f"img/{plot_name}", table)
    if cfg.docs:
        page_name = "benchmarks.md" if cfg.framework == "ddp" else f"benchmarks_{cfg.framework}.md"
        (REPO / "docs" / page_name).write_text(page)
    (out_dir / "benchmarks.md").write_text(page)
    print(page)


if __name__ == "__main__":
    main()
