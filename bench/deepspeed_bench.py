"""DeepSpeed adapter benchmark: steady-state overhead of the "torchpass" block per loop style and ZeRO stage, and recovery.

    python bench/deepspeed_bench.py                 # steps() loop, ZeRO 0-3, 2 ranks, ~4.3M parameters
    python bench/deepspeed_bench.py --stages 2 --rounds 1 --steps 20
    python bench/deepspeed_bench.py --loops steps,tutorial,own-loader,trainer --stages 2,3

Loop styles (the same model, data and config in each): ``steps`` iterates
``torchpass.adapters.deepspeed.steps``; ``tutorial`` is DeepSpeed's tutorial
loop over the engine's training dataloader, unchanged; ``own-loader`` is the
Getting Started loop over the script's own DataLoader; ``trainer`` is Hugging
Face's ``Trainer`` driving the engine (ZeRO 0-2).

For each ZeRO stage, in one invocation so both sides share the machine's
conditions, ``torchrun`` runs of the job without the block and ``torchpass
launch`` runs with the block enabled (buddy redundancy on, as "auto" selects
for sharded ZeRO state) alternate; the steady-state step time is the median
over all rounds after the warm-up steps. On a shared machine other jobs' load
swings step times by more than the overhead being measured, so the 10th
percentile (the steps least disturbed) is reported next to the median. The
step period is also reported over the steps each pair ran after the
``torchpass`` run's spare was ready: until then the spare imports what the
script imports (once per job, seconds of CPU), which on a machine with fewer
cores than processes slows the steps it overlaps; from then on what remains is
the per-step cost. Then one ``torchpass launch`` run is
killed mid-training (rank 1 SIGKILLed) and the ledger gives the recovery's
phase timings and the bytes moved. Results go to ``bench/out/deepspeed.json``
and a Markdown table on stdout.

The same file is the benchmark's training job (``--worker``), in each loop
style, appending each step's wall time to a file (for the loops written here,
from the step's first forward to its ``engine.step()`` at the boundary; for the
Trainer, from ``on_step_begin`` to ``on_step_end``).
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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.utils.data as torch_data

HERE = Path(__file__).resolve()
OUT = HERE.parent / "out" / "deepspeed.json"
WARMUP_STEPS = 5


# ---- the training job (one rank) -----------------------------------------------------------
LOOPS = ("steps", "tutorial", "own-loader", "trainer")


def worker(args: argparse.Namespace) -> None:
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, args.width), torch.nn.GELU()]
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1))

    class Regression(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
            loss = torch.nn.functional.mse_loss(self.net(x), labels)
            return {"loss": loss} if args.loop == "trainer" else loss

    g = torch.Generator().manual_seed(1)
    x = torch.randn(8192, 64, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 64,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10**6,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "zero_optimization": {"stage": args.zero},
    }
    if args.block:
        config["torchpass"] = {"enabled": True}
    times = open(args.times, "a", buffering=1)

    def record(number: int, seconds: float) -> None:
        at = {"at": time.monotonic(), "wall": time.time()}  # wall: to compare with the launcher's timeline
        times.write(json.dumps({"step": number, "seconds": seconds, "rank": int(os.environ["RANK"]), **at}) + "\n")

    model = Regression()
    if args.loop == "trainer":
        _trainer_worker(args, model, data, config, record)
        return
    if args.loop == "steps":
        from torchpass.adapters.deepspeed import steps

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), training_data=data, config=config)
        for step in steps(engine, args.steps):
            with step:
                t0 = time.perf_counter()
                for xb, yb in step.micro_batches():
                    engine.backward(engine(xb, yb))
                    engine.step()
                record(step.number, time.perf_counter() - t0)
        return
    if args.loop == "tutorial":
        engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), training_data=data, config=config)
        sampler = loader.data_sampler
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=5)
        loader = torch.utils.data.DataLoader(data, batch_size=64, sampler=sampler)
    t0 = 0.0
    for epoch in range(10**6):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            if engine.micro_steps % 2 == 0:
                t0 = time.perf_counter()
            engine.backward(engine(xb, yb))
            engine.step()
            if engine.micro_steps % 2 == 0:
                record(engine.global_steps, time.perf_counter() - t0)
            if engine.global_steps >= args.steps:
                return


def _trainer_worker(args: argparse.Namespace, model: Any, data: Any, config: dict, record: Any) -> None:
    """The same job under Hugging Face's Trainer: ``"auto"`` where the Trainer fills the DeepSpeed config in."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    config = {**config, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}

    class Pairs(torch_data.Dataset):
        def __len__(self) -> int:
            return len(data)

        def __getitem__(self, i: int) -> dict:
            x, y = data[i]
            return {"x": x, "labels": y}

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, *__: Any, **___: Any) -> None:
            record(state.global_step, time.perf_counter() - self.t0)

    training = TrainingArguments(
        output_dir=str(Path(args.times).parent / "trainer"), per_device_train_batch_size=64, gradient_accumulation_steps=2,
        max_steps=args.steps, learning_rate=1e-3, weight_decay=0.01, warmup_steps=5, max_grad_norm=1.0, logging_steps=10**6,
        save_strategy="no", report_to=[], deepspeed=config, ddp_backend="gloo", disable_tqdm=True,
    )  # fmt: skip
    Trainer(model=model, args=training, train_dataset=Pairs(), callbacks=[StepTimes()]).train()


# ---- the driver ----------------------------------------------------------------------------
def run_job(kind: str, work: Path, zero: int, loop: str, args: argparse.Namespace, kill_at: int | None = None) -> dict:
    """One job under ``torchrun`` (no block) or ``torchpass`` (block enabled); optionally SIGKILL rank 1 at a step."""
    from torchpass.core.critical_path import read_summaries
    from torchpass.core.inject import inject
    from torchpass.core.ledger import read_ledger
    from torchpass.core.timeline import read_timeline

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    times = work / "times.jsonl"
    job = [str(HERE), "--worker", "--loop", loop, "--zero", str(zero), "--steps", str(args.steps), "--width", str(args.width),
           "--depth", str(args.depth), "--times", str(times)]  # fmt: skip
    if kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc), *job]
    else:
        cmd = [
            sys.executable, "-m", "torchpass", "launch", "--standalone", "--nproc-per-node", str(args.nproc), "--spares-per-node", "1",
            "--run-dir", str(work / "run"), "--config", "fast_detect", "--quiet", *job, "--block",
        ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent.parent)}
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=work, stdout=open(work / "log", "w"), stderr=subprocess.STDOUT, env=env)
    if kill_at is not None:
        # Every rank appends to the times file: a line per rank and step.
        while not times.exists() or sum(1 for _ in open(times)) < args.nproc * kill_at:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} job ended early:\n{(work / 'log').read_text()[-2000:]}")
            time.sleep(0.05)
        inject(work / "run", "kill", rank=1)
    if proc.wait() != 0:
        raise RuntimeError(f"{kind} job failed:\n{(work / 'log').read_text()[-3000:]}")
    records = [json.loads(line) for line in open(times)]
    out: dict = {
        "wall_s": time.time() - t0,
        "step_s": [r["seconds"] for r in records if r["step"] > WARMUP_STEPS],
        "period_s": _periods(records),
        "records": records,
    }
    if kind == "torchpass":
        out["first_warm_step"] = _first_step_after_spares_ready(records, read_timeline(work / "run"))
        out["migrations"] = [e for e in read_ledger(work / "run") if e["type"] == "migration"]
        out["critical_path"] = [asdict(s) for s in read_summaries(work / "run")]
    return out


def _first_step_after_spares_ready(records: list[dict], timeline: list[dict]) -> int | None:
    """The first step every rank began after the launcher's timeline first showed a spare ready; None if never.

    A spare imports what the script imports while the job trains (seconds of CPU, once per job): on a
    machine with fewer cores than processes those steps pay for it. Steps from here on pay only the
    per-step cost. The timeline samples once a second, so the step found is at most a second late.
    """
    ready = next((row["t"] for row in timeline if sum(row["spares_free"].values()) > 0), None)
    if ready is None:
        return None
    started_before = [r["step"] for r in records if r["wall"] - r["seconds"] < ready]
    return max(started_before, default=0) + 1


def _periods(records: list[dict], from_step: int = WARMUP_STEPS + 1) -> list[float]:
    """Each rank's time from one step's end to the next's (all of the step: the loop's and torchpass's hooks too),
    for the periods that end at steps after ``from_step``."""
    by_rank: dict[int, list[dict]] = {}
    for r in records:
        by_rank.setdefault(r["rank"], []).append(r)
    periods = []
    for mine in by_rank.values():
        mine.sort(key=lambda r: r["step"])
        periods += [b["at"] - a["at"] for a, b in zip(mine, mine[1:]) if a["step"] >= from_step and b["step"] == a["step"] + 1]
    return periods


def bench_stage(zero: int, loop: str, args: argparse.Namespace, scratch: Path) -> dict:
    per_round: dict[str, list[float]] = {"torchrun": [], "torchpass": []}
    samples: dict[str, list[float]] = {"torchrun": [], "torchpass": []}
    periods: dict[str, list[float]] = {"torchrun": [], "torchpass": []}
    warm: dict[str, list[float]] = {"torchrun": [], "torchpass": []}
    first_warm: list[int | None] = []
    critical: list[dict] = []
    for r in range(args.rounds):
        results = {}
        for kind in ("torchrun", "torchpass"):
            result = results[kind] = run_job(kind, scratch / f"{loop}-zero{zero}-{kind}-{r}", zero, loop, args)
            samples[kind] += result["step_s"]
            periods[kind] += result["period_s"]
            per_round[kind].append(statistics.median(result["step_s"]))
            critical += result.get("critical_path", [])
        # The pair's same steps, those the torchpass run began with its spare ready.
        first = results["torchpass"]["first_warm_step"]
        first_warm.append(first)
        if first is not None:
            for kind, result in results.items():
                warm[kind] += _periods(result["records"], max(first, WARMUP_STEPS + 1))
    median = {kind: statistics.median(values) for kind, values in samples.items()}
    period = {kind: statistics.median(values) for kind, values in periods.items()}
    warm_period = {kind: statistics.median(values) for kind, values in warm.items() if values}
    p10 = {kind: statistics.quantiles(values, n=10)[0] for kind, values in samples.items()}
    recovery: dict[str, Any] = {"timings": {}, "bytes_moved": 0, "steps_lost": 0, "target_step": None, "sources": None}
    if not args.no_kill:
        killed = run_job("torchpass", scratch / f"{loop}-zero{zero}-kill", zero, loop, args, kill_at=args.steps // 2)
        migration = next(m for m in killed["migrations"] if m["outcome"] == "success")
        recovery = {k: migration[k] for k in ("timings", "bytes_moved", "steps_lost", "target_step", "sources")}
    return {
        "median_step_s": median,
        "p10_step_s": p10,
        "per_round_median_step_s": per_round,
        "ratio": median["torchpass"] / median["torchrun"],
        "ratio_p10": p10["torchpass"] / p10["torchrun"],
        "median_period_s": period,
        "period_ratio": period["torchpass"] / period["torchrun"],
        "first_step_spares_ready": first_warm,
        "warm_periods": {kind: len(values) for kind, values in warm.items()},
        "median_period_s_warm": warm_period,
        "period_ratio_warm": warm_period["torchpass"] / warm_period["torchrun"] if len(warm_period) == 2 else None,
        "critical_path_us": statistics.mean(c["total_us"] for c in critical),
        "critical_path_fraction": statistics.mean(c["fraction"] for c in critical),
        "critical_path_sections_us": {k: statistics.mean(c["per_step_us"][k] for c in critical) for k in critical[0]["per_step_us"]},
        "buddy": [c["extra"].get("buddy") for c in critical],
        "recovery": recovery,
    }


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--block", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--times", default="", help=argparse.SUPPRESS)
    p.add_argument("--zero", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--loop", choices=LOOPS, default="steps", help=argparse.SUPPRESS)
    p.add_argument("--loops", default="steps", help=f"loop styles to measure, comma-separated, of {','.join(LOOPS)}")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to measure, comma-separated (the Trainer: 0-2)")
    p.add_argument("--rounds", type=int, default=2, help="alternating torchrun/torchpass rounds per stage")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2, help="ranks (one node)")
    p.add_argument("--out", type=Path, default=OUT, help="where the results go (JSON)")
    p.add_argument("--no-kill", action="store_true", help="steady state only: skip the run with a SIGKILL")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    scratch = Path(tempfile.mkdtemp(prefix="ds-bench-"))
    results: dict[str, Any] = {"width": args.width, "depth": args.depth, "steps": args.steps, "rounds": args.rounds, "nproc": args.nproc, "cpus": os.cpu_count(), "runs": {}}
    for loop in args.loops.split(","):
        for zero in map(int, args.stages.split(",")):
            if loop == "trainer" and zero == 3:
                continue  # the Trainer is tested at ZeRO 0-2
            results["runs"][f"{loop} zero{zero}"] = bench_stage(zero, loop, args, scratch)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))
    shutil.rmtree(scratch, ignore_errors=True)
    print("| loop, ZeRO | torchrun step ms (median / p10) | torchpass + block step ms (median / p10) | ratio (median / p10) "
          "| period ratio (median; from the step the spare was ready) | torchpass on the training thread, us/step (% of step) "
          "| recovery total (s) | detect | spare_setup | transfer | rebuild | resume | bytes moved | steps lost |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, stage in results["runs"].items():
        t = stage["recovery"]["timings"]
        print(
            f"| {name} | {stage['median_step_s']['torchrun'] * 1e3:.1f} / {stage['p10_step_s']['torchrun'] * 1e3:.1f} | "
            f"{stage['median_step_s']['torchpass'] * 1e3:.1f} / {stage['p10_step_s']['torchpass'] * 1e3:.1f} | "
            f"{stage['ratio']:.3f} / {stage['ratio_p10']:.3f} | {stage['period_ratio']:.3f}; {_ratio(stage['period_ratio_warm'])} | "
            f"{stage['critical_path_us']:.0f} ({stage['critical_path_fraction']:.2%}) | {t.get('total', 0):.2f} | {t.get('detect', 0):.2f} | {t.get('spare_setup', 0):.2f} | "
            f"{t.get('transfer', 0):.2f} | {t.get('rebuild', 0):.2f} | {t.get('resume', 0):.2f} | "
            f"{stage['recovery']['bytes_moved']} | {stage['recovery']['steps_lost']} |"
        )


if __name__ == "__main__":
    main()
