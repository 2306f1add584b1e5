"""Megatron adapter benchmark: steady-state cost of ``--torchpass`` and recovery per layout.

    python bench/megatron_bench.py                 # TP2xDP2 and PP2xDP2, 3 rounds of 40 steps
    python bench/megatron_bench.py --rounds 1 --steps 20

The job is the end-to-end tests' megatron-core GPT job
(tests/support/megatron/gpt_job.py, CPU through the test-only shim), 4 ranks.
Per layout, each round runs three jobs back to back, in rotating order, so they
share the machine's conditions:

* ``torchrun``: the script without ``--torchpass`` under torchrun (what a user runs without torchpass);
* ``launch``: the same under ``torchpass launch`` (rebuildable groups, no flag: the plain loop);
* ``torchpass``: ``torchpass launch ... --torchpass`` (the guarded loop, mirrors, coupling all-reduce),
  which also records the wall time spent inside torchpass's step hooks (the job's ``--time-hooks``).

The steady-state step time of a job is the median over its steps after the
first five of rank 0's ``train_step`` times; a ratio is the median over rounds
of the per-round ratio. Then one job per layout is killed (rank 1, in step
``steps // 3``) and the ledger's recovery breakdown and bytes moved are
reported. Results go to ``bench/out/megatron.json`` and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torchpass.core.inject import inject
from torchpass.core.ledger import read_ledger

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "support" / "megatron" / "gpt_job.py"
KINDS = ("torchrun", "launch", "torchpass")
WARMUP_STEPS = 5


def run_job(kind: str, layout: str, work: Path, steps: int, kill_at: int | None = None) -> dict[str, Any]:
    """One job; with ``kill_at``, SIGKILL rank 1 once it is executing that step."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    args = [str(JOB), "--layout", layout, "--steps", str(steps), "--workdir", "."]
    if kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", *args]
    else:
        cmd = [
            sys.executable, "-m", "torchpass", "launch", "--standalone", "--nproc-per-node", "4", "--spares-per-node", "1",
            "--run-dir", str(work / "run"), "--config", "fast_detect", "--quiet", *args,
            *(["--torchpass", "--time-hooks"] if kind == "torchpass" else []),
        ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=work, stdout=open(work / "log", "w"), stderr=subprocess.STDOUT, env=env)
    if kill_at is not None:
        progress = work / "progress" / "rank1"
        while not progress.exists() or int(progress.read_text() or 0) < kill_at:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} job ended early:\n{(work / 'log').read_text()[-2000:]}")
            time.sleep(0.02)
        inject(work / "run", "kill", rank=1)
    if proc.wait() != 0:
        raise RuntimeError(f"{kind} job failed:\n{(work / 'log').read_text()[-3000:]}")
    out0 = json.loads((work / "out" / "rank0.json").read_text())
    result: dict[str, Any] = {"wall_s": time.time() - t0, "step_s": out0["step_times"], "hook_s": out0["hook_seconds"]}
    if kind != "torchrun":
        result["migrations"] = [e for e in read_ledger(work / "run") if e["type"] == "migration"]
    return result


def steady(step_s: list[float]) -> float:
    return statistics.median(step_s[WARMUP_STEPS:])


def bench_layout(layout: str, rounds: int, steps: int, scratch: Path) -> dict[str, Any]:
    per_kind: dict[str, list[float]] = {k: [] for k in KINDS}
    hook_ms: list[dict[str, float]] = []
    for r in range(rounds):
        order = KINDS[r % 3 :] + KINDS[: r % 3]
        for kind in order:
            job = run_job(kind, layout, scratch / f"{layout}-{kind}", steps)
            per_kind[kind].append(steady(job["step_s"]))
            if kind == "torchpass":
                hook_ms.append({name: round(s * 1e3 / steps, 3) for name, s in job["hook_s"].items()})
            print(f"  {layout} round {r + 1} {kind}: {per_kind[kind][-1] * 1e3:.1f} ms/step", flush=True)
    ratio_torchrun = statistics.median(t / b for t, b in zip(per_kind["torchpass"], per_kind["torchrun"]))
    ratio_flag = statistics.median(t / b for t, b in zip(per_kind["torchpass"], per_kind["launch"]))
    killed = run_job("torchpass", layout, scratch / f"{layout}-kill", steps, kill_at=max(3, steps // 3))
    migration = killed["migrations"][-1]
    return {
        "step_ms": {k: [round(v * 1e3, 2) for v in vs] for k, vs in per_kind.items()},
        "ratio_vs_torchrun": ratio_torchrun,
        "ratio_vs_launch_without_flag": ratio_flag,
        "hook_ms_per_step": hook_ms,
        "recovery": {
            "outcome": migration["outcome"],
            "steps_lost": migration["steps_lost"],
            "bytes_moved": migration["bytes_moved"],
            "timings_s": migration["timings"],
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", default=["tp2dp2", "pp2dp2"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    results: dict[str, Any] = {"rounds": args.rounds, "steps": args.steps, "layouts": {}}
    with tempfile.TemporaryDirectory(prefix="megatron-bench-") as tmp:
        for layout in args.layouts:
            results["layouts"][layout] = bench_layout(layout, args.rounds, args.steps, Path(tmp))
    out = REPO / "bench" / "out" / "megatron.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print("\n| layout | torchrun ms/step | launch, no flag | --torchpass | ratio vs torchrun | ratio vs no flag |")
    print("|---|---|---|---|---|---|")
    for layout, r in results["layouts"].items():
        med = {k: statistics.median(v) for k, v in r["step_ms"].items()}
        print(
            f"| {layout} | {med['torchrun']:.1f} | {med['launch']:.1f} | {med['torchpass']:.1f} "
            f"| {r['ratio_vs_torchrun']:.3f} | {r['ratio_vs_launch_without_flag']:.3f} |"
        )
    print("\nms per step inside torchpass's hooks (--torchpass runs, mean over all steps):")
    for layout, r in results["layouts"].items():
        print(f"  {layout}: " + "; ".join(json.dumps(h, sort_keys=True) for h in r["hook_ms_per_step"]))
    print("\n| layout | outcome | steps lost | bytes moved | detect | report+plan | spare set-up | transfer | rebuild | resume | total |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for layout, r in results["layouts"].items():
        rec, t = r["recovery"], r["recovery"]["timings_s"]
        cells = [f"{t.get(k, 0.0):.2f}" for k in ("detect", "report_and_plan", "spare_setup", "transfer", "rebuild", "resume", "total")]
        print(f"| {layout} | {rec['outcome']} | {rec['steps_lost']} | {rec['bytes_moved']} | " + " | ".join(cells) + " |")
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
