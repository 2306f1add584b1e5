"""The comparison benchmark's pieces without processes: config, schedule, figures from logs, report."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.config import load_config
from bench.metrics import figures, time_lost_per_fault, time_lost_per_fault_paced
from bench.report import goals, markdown, plot_progress
from bench.runner import RunRecord
from bench.schedule import Fault, fault_schedule


def test_configs_compose_and_schedule_is_proportioned() -> None:
    for name in ("quick", "full"):
        cfg = load_config(name, [])
        faults = fault_schedule(cfg.schedule, cfg.workload.steps, cfg.world_size)
        k = cfg.schedule.checkpoint_every
        assert faults, name
        gaps = [b.at_step - a.at_step for a, b in zip([Fault(0, 0)] + faults, faults)]
        assert all(3 * k <= g <= 5 * k for g in gaps), gaps
        assert faults == fault_schedule(cfg.schedule, cfg.workload.steps, cfg.world_size)  # seeded
    assert load_config("quick", ["workload.steps=7"]).workload.steps == 7


def test_framework_modes_compose_and_bad_choices_name_the_field() -> None:
    ds, titan = load_config("deepspeed", []), load_config("torchtitan", [])
    assert (ds.framework, ds.zero_stage, titan.framework, titan.titan_layout) == ("deepspeed", 1, "torchtitan", "hsdp")
    assert "torchft" not in ds.strategies + titan.strategies
    for overrides, field in (
        (["framework=jax"], "framework='jax'"),
        (["strategies=[torchpass,torchft]"], "torchft runs with framework=ddp only"),
        (["zero_stage=4"], "zero_stage=4"),
    ):
        with pytest.raises(ValueError, match=field):
            load_config("deepspeed", overrides)
    with pytest.raises(ValueError, match="titan_layout='tp'"):
        load_config("torchtitan", ["titan_layout=tp"])


def test_deepspeed_mode_config_enables_torchpass_only_for_torchpass() -> None:
    from bench.strategies import deepspeed_config

    cfg = load_config("deepspeed", ["zero_stage=2"])
    assert "torchpass" not in deepspeed_config(cfg, torchpass=False)
    with_block = deepspeed_config(cfg, torchpass=True)
    assert with_block["torchpass"] == {"enabled": True}
    assert with_block["zero_optimization"] == {"stage": 2}
    assert with_block["train_micro_batch_size_per_gpu"] == cfg.workload.batch_per_rank


def _rec(kind: str, t: float, pid: int, rank: int, **kw) -> dict:
    return {"kind": kind, "t": t, "pid": pid, "rank": rank, **kw}


def _restart_run() -> RunRecord:
    """Two ranks, 6 steps, a checkpoint after step 2, rank 1 killed after step 3, restart from step 2."""
    logs: dict[int, list[dict]] = {}
    for rank in (0, 1):
        pid, new = 10 + rank, 20 + rank
        recs = [_rec("start", 0.0, pid, rank), _rec("ready", 1.0, pid, rank, step=0)]
        recs += [_rec("step", 1.0 + s, pid, rank, step=s, seconds=1.0, samples=2) for s in (1, 2, 3)]
        recs += [_rec("start", 5.0, new, rank), _rec("ready", 8.0, new, rank, step=2)]
        recs += [_rec("step", 6.0 + s, new, rank, step=s, seconds=1.0, samples=2) for s in (3, 4, 5, 6)]
        logs[rank] = recs
    return RunRecord("checkpoint", [Fault(3, 1)], 0.0, 12.0, [4.5], [1], logs)


def test_checkpoint_restart_figures() -> None:
    fig = figures(_restart_run(), n_steps=6, world=2, batch=1)
    assert fig.wall_s == 12.0 and fig.train_s == 10.0
    assert fig.steps_recomputed == 1 and fig.samples_skipped == 0
    (rec,) = fig.recoveries
    assert rec["steps_lost"] == 1
    assert rec["phases"] == {"detect_and_restart": 0.5, "init_and_load": 3.0, "recompute": 1.0}
    assert rec["total_s"] == 4.5


def test_restart_from_a_checkpoint_of_the_step_reached_recomputes_nothing() -> None:
    """The fault lands just after the save of step 2: the restart resumes at step 3, nothing is lost."""
    logs: dict[int, list[dict]] = {}
    for rank in (0, 1):
        pid, new = 10 + rank, 20 + rank
        recs = [_rec("start", 0.0, pid, rank), _rec("ready", 1.0, pid, rank, step=0)]
        recs += [_rec("step", 1.0 + s, pid, rank, step=s, seconds=1.0, samples=2) for s in (1, 2)]
        recs += [_rec("start", 5.0, new, rank), _rec("ready", 8.0, new, rank, step=2)]
        recs += [_rec("step", 6.0 + s, new, rank, step=s, seconds=1.0, samples=2) for s in (3, 4)]
        logs[rank] = recs
    run = RunRecord("checkpoint", [Fault(2, 1)], 0.0, 10.0, [3.5], [1], logs)
    fig = figures(run, n_steps=4, world=2, batch=1)
    (rec,) = fig.recoveries
    assert fig.steps_recomputed == 0 and rec["steps_lost"] == 0
    assert rec["total_s"] == 9.0 - 3.5 and rec["phases"]["recompute"] == 1.0


def test_torchft_skipped_samples_and_stall() -> None:
    logs = {
        0: [_rec("start", 0.0, 1, 0)]
        + [_rec("step", float(s), 1, 0, step=s, seconds=1.0, samples=2 if s < 3 else 1, participants=2 if s < 3 else 1) for s in (1, 2)]
        + [_rec("discarded", 3.0, 1, 0, step=3, seconds=1.0)]
        + [_rec("step", 5.0 + s, 1, 0, step=s, seconds=1.0, samples=1, participants=1) for s in (3, 4)],
        1: [_rec("start", 0.0, 2, 1)] + [_rec("step", float(s), 2, 1, step=s, seconds=1.0, samples=2, participants=2) for s in (1, 2)],
    }
    run = RunRecord("torchft", [Fault(2, 1)], 0.0, 9.0, [2.5], [1], logs)
    fig = figures(run, n_steps=4, world=2, batch=1)
    assert fig.samples_skipped == 2 and fig.steps_discarded == 1 and fig.steps_recomputed == 0
    (rec,) = fig.recoveries
    assert rec["total_s"] == 5.5 and rec["phases"]["group_rejoins"] is None
    clean = dataclasses.replace(fig, faults=0, samples_skipped=0, train_s=fig.train_s - 3.0, step_s=1.0)
    assert time_lost_per_fault(fig, clean, world=2, batch=1) == 3.0 + 1.0
    # Own pace: 1 s per step up to the fault (steps 1 -> 2), 3 steps at that pace, 1 extra step of skipped samples.
    assert fig.pace_s == 1.0
    assert time_lost_per_fault_paced(fig, clean, n_steps=4, world=2, batch=1) == fig.train_s - (4 - 1 - 1) * 1.0


def _results(config: str, overrides: list[str], runs: dict[str, dict]) -> dict:
    """A results mapping as ``bench.compare`` writes it, for a two-rank run with one fault at step 3."""
    return {
        "command": f"python -m bench.compare --config {config}",
        "date": "today",
        "machine": "test",
        "versions": {"torch": "x"},
        "config": dataclasses.asdict(load_config(config, overrides)),
        "params": 1_000_000,
        "state_bytes": 12_000_000,
        "world_size": 2,
        "faults": [{"at_step": 3, "rank": 1}],
        "out_dir": "out",
        "runs": runs,
    }


def _restart_figures() -> dict:
    fig = figures(_restart_run(), n_steps=6, world=2, batch=1)
    return {**dataclasses.asdict(fig), "fault_s": [4.5]}


def test_report_page_plot_and_goals(tmp_path: Path) -> None:
    as_dict = _restart_figures()
    results = _results(
        "quick",
        [],
        {
            "checkpoint": {"clean": as_dict, "faults": as_dict, "time_lost_per_fault_s": 4.0, "steady_ratio": 1.2},
            "torchpass": {"clean": as_dict, "faults": {**as_dict, "steps_recomputed": 0}, "time_lost_per_fault_s": 0.5, "steady_ratio": 1.0},
        },
    )
    results["transfer"] = {"state_bytes": 12_000_000, "fetch_GBps": 1.0, "loopback_GBps": 2.0, "loopback_fresh_GBps": 1.0, "ratio": 0.5}
    results["control_plane"] = [{"ranks": 64, "critical_s": 0.01}, {"ranks": 128, "critical_s": 0.02}]
    met = {goal: ok for goal, _, ok in goals(results)}
    assert met["time lost per failure (vs fault-free run) <= 0.2 x checkpoint's"] is True
    assert met["steady-state step time <= 1.01 x baseline"] is True
    assert met["control plane no worse than linear"] is True
    page = markdown(results, "img/p.png", "| table |")
    assert "| checkpoint | 12.0 / 12.0 |" in page and "| table |" in page
    plot_progress(results, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("overrides", "title", "goal"),
    [
        (["zero_stage=1"], "DeepSpeed's checkpoint restart", "sharded state: <= 1 step recomputed per fault"),
        (["zero_stage=0"], "DeepSpeed's checkpoint restart", "0 steps recomputed, 0 samples skipped"),
    ],
)
def test_framework_page_describes_its_job_and_judges_recompute_by_layout(overrides: list[str], title: str, goal: str) -> None:
    as_dict = _restart_figures()
    runs = {"torchpass": {"clean": as_dict, "faults": {**as_dict, "steps_recomputed": 1}, "time_lost_per_fault_s": 0.5}}
    results = _results("deepspeed", overrides, runs)
    page = markdown(results, "img/p.png", "")
    assert title in page.splitlines()[0]
    assert f"ZeRO stage {results['config']['zero_stage']}" in page and "torchft" not in page
    assert any(g.startswith(goal) for g, _, _ in goals(results))
