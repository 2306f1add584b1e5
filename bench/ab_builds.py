"""Two builds of torchpass side by side: steady-state step time and state-transfer rate, pairs interleaved.

    python -m bench.ab_builds --baseline-root ../old --baseline-python ../old-venv/bin/python [--pairs 6]

A change that must cost nothing on the hot paths (authentication, say) is
judged against the build without it, on the same machine in the same
invocation. Each pair runs both builds back to back, in alternating order, so
a machine that drifts faster or slower shifts both halves of a pair:

* **step**: ``bench/jobs/ddp_mlp.py`` of each build (a 4-layer 256-wide MLP,
  DDP over 2 ranks with gloo, one hot spare, 300 steps) under that build's
  ``torchpass launch``; the figure is the median step time after the first
  30 steps, as the job itself times them. Short steps on purpose: the
  per-step work torchpass adds (the small-state mirror record written every
  step, the heartbeats) weighs most there.
* **transfer**: each build's ``bench.transfer`` (a real state server, a real
  ``fetch_state``), the best of 3 fetches per size.

Ratios are this build over the baseline, pair by pair, and their median.
The baseline is a checkout with its own environment (``git worktree add`` at
the revision, then ``pip install --no-deps -e`` it into a venv made with
``--system-site-packages``). Results go to ``bench/out/ab_builds.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS, WARM_STEPS = 300, 30
TRANSFER_SIZES_MB = (25, 100, 400)


def _step_time(python: str, root: Path) -> float:
    with tempfile.TemporaryDirectory(prefix="ab_step_") as tmp:
        times = Path(tmp) / "times.jsonl"
        cmd = [
            python, "-m", "torchpass.core.cli", "launch", "--nproc-per-node", "2", "--spares-per-node", "1",
            "--run-dir", str(Path(tmp) / "run"), "--quiet", str(root / "bench" / "jobs" / "ddp_mlp.py"),
            "--steps", str(STEPS), "--width", "256", "--depth", "4", "--times", str(times),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{python} {root}: the job failed ({done.returncode}):\n{done.stderr[-3000:]}")
        rows = [json.loads(line) for line in times.read_text().splitlines()]
        return statistics.median(r["seconds"] for r in rows if r["step"] > WARM_STEPS)


def _transfer_rates(python: str, root: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="ab_transfer_") as tmp:
        out = Path(tmp) / "transfer.json"
        cmd = [python, "-m", "bench.transfer", "--sizes-mb", *map(str, TRANSFER_SIZES_MB), "--repeats", "3", "--out", str(out)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{python} {root}: bench.transfer failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return {mb: row["fetch_GBps"] for mb, row in json.loads(out.read_text()).items()}


def _ratios(this: list[float], base: list[float]) -> dict[str, object]:
    pairs = [a / b for a, b in zip(this, base)]
    return {"this": this, "baseline": base, "ratio_per_pair": pairs, "median_ratio": statistics.median(pairs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-root", type=Path, required=True, help="the baseline checkout")
    p.add_argument("--baseline-python", required=True, help="the interpreter of the baseline's environment")
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "ab_builds.json")
    args = p.parse_args()
    builds = {"this": (sys.executable, REPO), "baseline": (args.baseline_python, args.baseline_root.resolve())}
    steps: dict[str, list[float]] = {"this": [], "baseline": []}
    rates: dict[str, dict[str, list[float]]] = {"this": {}, "baseline": {}}
    for i in range(args.pairs):
        for name in ("this", "baseline") if i % 2 == 0 else ("baseline", "this"):
            python, root = builds[name]
            steps[name].append(_step_time(python, root))
            if i < 3:  # three transfer pairs are plenty: a fetch is already the best of three
                for mb, rate in _transfer_rates(python, root).items():
                    rates[name].setdefault(mb, []).append(rate)
        print(f"pair {i + 1}/{args.pairs}: step {steps['this'][-1] * 1e3:.2f} ms vs {steps['baseline'][-1] * 1e3:.2f} ms", flush=True)
    result = {
        "step": _ratios(steps["this"], steps["baseline"]),
        "transfer_GBps": {mb: _ratios(rates["this"][mb], rates["baseline"][mb]) for mb in rates["this"]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("| figure | this build | baseline | ratio per pair | median ratio |\n| --- | --- | --- | --- | --- |")
    rows = [("steady-state step (ms)", result["step"], 1e3)]
    rows += [(f"transfer {mb} MB (GB/s)", r, 1.0) for mb, r in result["transfer_GBps"].items()]
    for label, r, scale in rows:
        this = ", ".join(f"{x * scale:.2f}" for x in r["this"])
        base = ", ".join(f"{x * scale:.2f}" for x in r["baseline"])
        pairs = ", ".join(f"{x:.3f}" for x in r["ratio_per_pair"])
        print(f"| {label} | {this} | {base} | {pairs} | {r['median_ratio']:.3f} |")


if __name__ == "__main__":
    main()
