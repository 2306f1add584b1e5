"""Megatron-LM benchmark: steady-state cost of ``--torchpass`` in Megatron-LM's own ``pretrain()``, and recovery.

    python bench/megatron_lm_bench.py                   # 3 layouts, 3 rounds of 40 iterations
    python bench/megatron_lm_bench.py --rounds 1 --iterations 20 --layouts tp2dp2

The job is the end-to-end tests' ``pretrain_gpt.py``-style script
(tests/support/megatron/pretrain_gpt_lm.py) run by megatron-core 0.17.0's
``megatron.training`` on CPU (4 ranks, the test-only shim; provisioned like the
tests). Per layout, each round runs two jobs back to back, in alternating order,
so they share the machine's conditions: ``torchrun`` (the script without
torchpass) and ``torchpass`` (``torchpass launch ... --torchpass``). The
iteration time is Megatron-LM's own ("elapsed time per iteration", logged every
iteration), the median over the iterations after the first five; a ratio is the
median over rounds of the per-round ratio.

Recovery: per layout one job is killed (rank 1, in iteration ``iterations // 3``)
and the ledger's breakdown and bytes moved are reported; for the distributed-
optimizer layouts a second job has the chaos flags kill rank 1 right after its
optimizer step of that iteration (before its buddy copy of it left), which is
where buddy copies lose a step and the other instance's replica loses none.
Results go to ``bench/out/megatron_lm.json`` and Markdown tables on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.megatron import megatron_lm_wheel  # noqa: E402
from tests.support.megatron.megatron_lm_args import LAYOUTS, MEGATRON_LM_ARGS  # noqa: E402
from torchpass.core.inject import inject  # noqa: E402
from torchpass.core.ledger import read_ledger  # noqa: E402

SCRIPT = REPO / "tests" / "support" / "megatron" / "pretrain_gpt_lm.py"
WARMUP = 5
ITERATION_TIME = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")


def run_job(kind: str, layout: str, work: Path, iterations: int, env: dict[str, str], fault: str | None = None) -> dict[str, Any]:
    """One job. ``fault``: ``kill`` (SIGKILL rank 1 in iteration ``iterations // 3``) or ``after_commit`` (chaos)."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    at = max(3, iterations // 3)
    args = [str(SCRIPT), *MEGATRON_LM_ARGS, *LAYOUTS[layout], "--train-iters", str(iterations)]
    if kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", *args]
    else:
        chaos = ["--torchpass-chaos-kill-rank", "1", "--torchpass-chaos-kill-step", str(at), "--torchpass-chaos-kill-point", "after_commit"]
        cmd = [
            sys.executable, "-m", "torchpass", "launch", "--standalone", "--nproc-per-node", "4", "--spares-per-node", "1",
            "--run-dir", str(work / "run"), "--config", "fast_detect", "--quiet", *args, "--torchpass",
            *(chaos if fault == "after_commit" else []),
        ]  # fmt: skip
    t0 = time.time()
    log = work / "log"
    proc = subprocess.Popen(cmd, cwd=work, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    if fault == "kill":
        progress = work / "progress" / "rank1"
        while not progress.exists() or int(progress.read_text() or 0) < at:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} job ended early:\n{log.read_text()[-2000:]}")
            time.sleep(0.02)
        inject(work / "run", "kill", rank=1)
    if proc.wait() != 0:
        raise RuntimeError(f"{kind} job failed:\n{log.read_text()[-3000:]}")
    # Megatron-LM prints on the last rank: under torchpass launch --quiet, in its worker log.
    logs = [log, *sorted((work / "run" / "logs").glob("*.out"))] if kind != "torchrun" else [log]
    times = {int(i): float(ms) for f in logs for i, ms in ITERATION_TIME.findall(f.read_text(errors="replace"))}
    result: dict[str, Any] = {"wall_s": time.time() - t0, "iteration_ms": [times[i] for i in sorted(times)]}
    if kind != "torchrun":
        result["migrations"] = [e for e in read_ledger(work / "run") if e["type"] == "migration"]
    return result


def recovery(job: dict[str, Any]) -> dict[str, Any]:
    migration = job["migrations"][-1]
    optimizer_copies = sorted({s["copy"].split(":")[0] for r in migration["sources"].values() for s in r["from"].get("optimizer", [])})
    return {
        "outcome": migration["outcome"],
        "steps_lost": migration["steps_lost"],
        "bytes_moved": migration["bytes_moved"],
        "optimizer_from": optimizer_copies,
        "timings_s": migration["timings"],
    }


def bench_layout(layout: str, rounds: int, iterations: int, scratch: Path, env: dict[str, str]) -> dict[str, Any]:
    per_kind: dict[str, list[float]] = {"torchrun": [], "torchpass": []}
    for r in range(rounds):
        for kind in (("torchrun", "torchpass") if r % 2 == 0 else ("torchpass", "torchrun")):
            job = run_job(kind, layout, scratch / f"{layout}-{kind}", iterations, env)
            per_kind[kind].append(statistics.median(job["iteration_ms"][WARMUP:]))
            print(f"  {layout} round {r + 1} {kind}: {per_kind[kind][-1]:.1f} ms/iteration", flush=True)
    result: dict[str, Any] = {
        "iteration_ms": per_kind,
        "ratio": statistics.median(t / b for t, b in zip(per_kind["torchpass"], per_kind["torchrun"])),
        "recovery": {"kill": recovery(run_job("torchpass", layout, scratch / f"{layout}-kill", iterations, env, "kill"))},
    }
    if "distopt" in layout:
        job = run_job("torchpass", layout, scratch / f"{layout}-after-commit", iterations, env, "after_commit")
        result["recovery"]["after_commit"] = recovery(job)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=40)
    args = p.parse_args()
    site = megatron_lm_wheel.ensure()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    results: dict[str, Any] = {"rounds": args.rounds, "iterations": args.iterations, "layouts": {}}
    with tempfile.TemporaryDirectory(prefix="megatron-lm-bench-") as tmp:
        for layout in args.layouts:
            results["layouts"][layout] = bench_layout(layout, args.rounds, args.iterations, Path(tmp), env)
    out = REPO / "bench" / "out" / "megatron_lm.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print("\n| layout | torchrun ms/iteration | --torchpass ms/iteration | ratio (median of rounds) |")
    print("|---|---|---|---|")
    for layout, r in results["layouts"].items():
        med = {k: statistics.median(v) for k, v in r["iteration_ms"].items()}
        print(f"| {layout} | {med['torchrun']:.1f} | {med['torchpass']:.1f} | {r['ratio']:.3f} |")
    print("\n| layout | fault | outcome | steps lost | optimizer from | bytes moved | detect | report+plan | spare set-up | transfer | rebuild | resume | total |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layout, r in results["layouts"].items():
        for fault, rec in r["recovery"].items():
            t = rec["timings_s"]
            cells = [f"{t.get(k, 0.0):.2f}" for k in ("detect", "report_and_plan", "spare_setup", "transfer", "rebuild", "resume", "total")]
            print(
                f"| {layout} | {fault} | {rec['outcome']} | {rec['steps_lost']} | {'/'.join(rec['optimizer_from'])} "
                f"| {rec['bytes_moved']} | " + " | ".join(cells) + " |"
            )
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
