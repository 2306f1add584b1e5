"""TorchTitan adapter benchmark: steady-state overhead of the [torchpass] section, and recovery cost.

    python bench/torchtitan_bench.py [--layouts ddp hsdp fsdp tp_fsdp] [--steps 20] [--pairs 2]
                                     [--buddy-interval N] [--no-recovery] [--out FILE]

Runs TorchTitan's real trainer (llama3 "debugmodel", the test job config) on
CPU/gloo with the test-support CPU shim, 4 ranks, per layout:

* overhead: ``--pairs`` pairs of runs, alternating, of the same TOML without
  the section under plain ``torchrun`` (what a TorchTitan user runs today) and
  with the section under ``torchpass launch`` (4 ranks + 1 spare). The step
  time of a run is the median, over steps 4..N, of rank 0's interval between
  consecutive steps (the test probe's clocks after each backward), in wall
  time and in the process's CPU time (all threads: torchpass's background work
  included; less sensitive to other load on a shared machine). The ratios are
  median(with) / median(without) over the pairs;
* recovery: one run with the section in which a rank is SIGKILLed at step
  N/2; the ledger's phase timings and bytes moved (skip with ``--no-recovery``).

``--buddy-interval`` sets ``[torchpass] buddy_interval_steps`` for the runs with
the section: the refresh period of buddy copies, which sharded layouts (FSDP,
TP x FSDP) pay for in step time.

Prints a Markdown table and writes the raw numbers as JSON. Runs take about a
minute each on 2 CPU cores: the default is ~14 runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.harness import JobRun  # noqa: E402
from tests.support.torchtitan.assets import make_assets  # noqa: E402
from tests.support.torchtitan.jobs import JOB_TOML, LAYOUTS, launch_titan, torchrun_titan, without_section  # noqa: E402

WARMUP_STEPS = 3


def step_times(run: JobRun) -> tuple[float, float]:
    """Rank 0's median wall time and process CPU time (all threads) per step, after the warm-up steps."""
    curve = [json.loads(line) for line in (run.workdir / "losses" / "rank0.jsonl").read_text().splitlines() if line.strip()]
    clock = {r["step"]: (r["t"], r["cpu"]) for r in curve}
    steps = sorted(s for s in clock if s > WARMUP_STEPS and s - 1 in clock)
    wall = statistics.median(clock[s][0] - clock[s - 1][0] for s in steps)
    cpu = statistics.median(clock[s][1] - clock[s - 1][1] for s in steps)
    return wall, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=sorted(LAYOUTS), choices=sorted(LAYOUTS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--buddy-interval", type=int, default=1)
    p.add_argument("--no-recovery", action="store_true")
    p.add_argument("--out", type=Path, default=Path("torchtitan_bench.json"))
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="torchtitan-bench-"))
    assets, hf_cache = make_assets(root / "assets"), root / "hf_cache"
    plain_toml = root / "job_without_torchpass.toml"
    plain_toml.write_text(without_section(JOB_TOML.read_text()))
    steps = ["--training.steps", str(args.steps)]
    with_section = [*steps, "--torchpass.buddy_interval_steps", str(args.buddy_interval)]
    results: dict[str, Any] = {}
    for layout in args.layouts:
        without, with_ = [], []
        for pair in range(args.pairs):
            plain = torchrun_titan(root / f"{layout}-plain-{pair}", layout, assets, hf_cache, extra=steps, config_file=plain_toml)
            without.append(step_times(plain))
            run = launch_titan(root / f"{layout}-torchpass-{pair}", layout, assets, hf_cache, extra=with_section)
            if run.wait(900) != 0:
                raise SystemExit(f"{layout}: torchpass run failed:\n{run.output()[-3000:]}")
            with_.append(step_times(run))
            print(f"{layout} pair {pair}: (wall, cpu) s/step without {without[-1]}, with {with_[-1]}", flush=True)
        wall_without, wall_with = (statistics.median(w for w, _ in runs) for runs in (without, with_))
        cpu_without, cpu_with = (statistics.median(c for _, c in runs) for runs in (without, with_))
        results[layout] = {
            "step_s_without": without,
            "step_s_with": with_,
            "wall": [wall_without, wall_with, wall_with / wall_without],
            "cpu": [cpu_without, cpu_with, cpu_with / cpu_without],
        }
        if not args.no_recovery:
            kill = launch_titan(root / f"{layout}-kill", layout, assets, hf_cache, extra=with_section)
            kill.wait_step(1, args.steps // 2, timeout=600)
            kill.inject("kill", rank=1)
            if kill.wait(900) != 0:
                raise SystemExit(f"{layout}: run with a fault failed:\n{kill.output()[-3000:]}")
            migration = next(m for m in kill.migrations() if m["outcome"] == "success")
            results[layout]["recovery"] = {k: migration[k] for k in ("timings", "bytes_moved", "steps_lost", "target_step")}
    args.out.write_text(json.dumps(results, indent=1))
    print("\n| layout | wall s/step without / with | ratio | CPU s/step without / with | ratio | recovery total s | detect | "
          "report+plan | spare setup | transfer | rebuild | resume | MB moved | steps lost |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layout, r in results.items():
        (w0, w1, wr), (c0, c1, cr) = r["wall"], r["cpu"]
        row = f"| {layout} | {w0:.3f} / {w1:.3f} | {wr:.3f} | {c0:.3f} / {c1:.3f} | {cr:.3f} |"
        if "recovery" in r:
            t = r["recovery"]["timings"]
            phases = ("total", "detect", "report_and_plan", "spare_setup", "transfer", "rebuild", "resume")
            row += " " + " | ".join(f"{t.get(k, 0.0):.2f}" for k in phases)
            row += f" | {r['recovery']['bytes_moved'] / 1e6:.1f} | {r['recovery']['steps_lost']} |"
        print(row)
    print(f"\nraw numbers: {args.out}")


if __name__ == "__main__":
    main()
