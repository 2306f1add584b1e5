"""End to end: TorchTitan's own trainer survives real faults and ends bitwise identical to the fault-free run.

Every case runs TorchTitan 0.2.2's real trainer and llama3 "debugmodel" through
``torchpass launch -m torchpass.adapters.torchtitan.train`` with 4 active ranks
and a spare on CPU/gloo, injects a real fault with ``torchpass inject`` at a
random rank and step (seed printed), and checks: every rank's per-step losses
and final model shards, optimizer state and LR scheduler state equal the
fault-free run's bit for bit; survivors keep their PIDs; the job wrote nothing
but its outputs (no checkpoint); the ledger accounts for the migration.

The fault-free reference of each layout runs once per module, each in a way
that also checks one more behaviour of the entry point:

* ``ddp``: under ``torchpass launch`` with ``--torchpass.no-enable``:
  TorchTitan's trainer with no torchpass hook at all (checked: the probe
  reports the trainer's hooks and overrides, compared with a torchrun run's);
* ``hsdp``: under plain ``torchrun``: the entry point as TorchTitan's own train;
* ``fsdp``, ``tp_fsdp``: under ``torchpass launch``, migration enabled.

So the migrated runs are compared with TorchTitan's unmodified numerics too.
HSDP and FSDP with TorchTitan's shipped settings (bf16, activation
checkpointing, checkpointing on) are in ``test_torchtitan_shipped_e2e.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import JobRun, RunOnce, assert_bitwise, fault_rng
from tests.support.torchtitan.assets import Assets
from tests.support.torchtitan.jobs import STEPS, launch_titan, torchrun_titan

pytestmark = pytest.mark.e2e

REPLICATED = {"ddp", "hsdp"}
"""Layouts whose parameters and optimizer state have data-parallel replicas; the others rely on buddy copies."""


def _reference_run(workdir: Path, layout: str, assets: Assets, hf_cache: Path) -> JobRun:
    if layout == "hsdp":
        return torchrun_titan(workdir, layout, assets, hf_cache)
    extra = ["--torchpass.no-enable"] if layout == "ddp" else []
    run = launch_titan(workdir, layout, assets, hf_cache, extra=extra)
    assert run.wait(600) == 0, run.explain()
    assert not run.migrations()
    if layout == "ddp":
        assert "the job config sets [torchpass] enable = false: TorchTitan trains without live migration" in run.output()
    return run


def test_enable_false_installs_no_hook(references: RunOnce[str, dict]) -> None:
    off, torchrun = references["ddp"], references["hsdp"]
    for rank in range(4):
        assert off[rank]["hooks"] == torchrun[rank]["hooks"], (off[rank]["hooks"], torchrun[rank]["hooks"])
        assert off[rank]["hooks"] == {"migration": False, "optimizer_step_hooks": off[rank]["hooks"]["optimizer_step_hooks"], "overrides": []}


def _reference_results(root: Path, layout: str, assets: Assets, hf_cache: Path) -> dict:
    run = _reference_run(root / layout, layout, assets, hf_cache)
    results = run.results()
    assert sorted(results) == [0, 1, 2, 3] and all(len(r["losses"]) == STEPS for r in results.values())
    return results


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory, assets: Assets, hf_cache: Path) -> RunOnce[str, dict]:
    """Each layout's fault-free results, run once per module on first use."""
    root = tmp_path_factory.mktemp("references")
    return RunOnce(lambda layout: _reference_results(root, layout, assets, hf_cache))


def _check_migrated(run: JobRun, reference: dict, pids_before: dict[int, int], replaced: int, cause: str, layout: str) -> dict[str, Any]:
    assert run.wait(600) == 0, run.explain()
    results = run.results()
    assert_bitwise(results, reference)
    for rank, pid in pids_before.items():
        if rank == replaced:
            assert results[rank]["pid"] != pid, f"rank {rank} should run in a spare now"
        else:
            assert results[rank]["pid"] == pid, f"survivor rank {rank} changed PID {pid} -> {results[rank]['pid']}"
    assert run.stray_files() == [], "the job wrote files besides its outputs (a checkpoint?)"
    done = [m for m in run.migrations() if m["outcome"] == "success"]
    assert len(done) == 1 and len(run.migrations()) == 1, run.migrations()
    last = done[0]
    assert last["cause"] == cause and last["classification"] == "qualifying", last
    assert [int(r) for r in last["replaced"]] == [replaced], last
    # Replicated state resumes where it stopped; a buddy copy may be one interval behind.
    assert last["bytes_moved"] > 0 and last["steps_lost"] <= (0 if layout in REPLICATED else 1), last
    params_from = last["sources"][str(replaced)]["from"]["params"]
    if cause == "planned":
        assert [s["rank"] for s in params_from] == [replaced], params_from
    elif layout in REPLICATED:
        assert all(s["copy"] == "live" and s["rank"] != replaced for s in params_from), params_from
    else:
        assert [s["copy"] for s in params_from] in (["snapshot"], [f"held:{replaced}"]), params_from
    print(f"[{layout}] {cause}: rank {replaced}, target step {last['target_step']}, steps lost {last['steps_lost']}, "
          f"{last['bytes_moved'] / 1e6:.1f} MB moved, timings {last['timings']}")
    return last


@pytest.mark.parametrize("layout", ["ddp", "tp_fsdp"])
def test_sigkill_random_rank_at_random_step(
    tmp_path: Path, layout: str, references: RunOnce[str, dict], assets: Assets, hf_cache: Path
) -> None:
    expected = references[layout]
    rng = fault_rng(f"torchtitan-{layout}-sigkill")
    rank, step = rng.randrange(4), rng.randint(3, STEPS - 2)
    run = launch_titan(tmp_path, layout, assets, hf_cache)
    try:
        run.wait_step(rank, step, timeout=300)
        pids = run.active_pids()
        run.inject("kill", rank=rank)
        last = _check_migrated(run, expected, pids, rank, "kill", layout)
    finally:
        run.kill()
    assert last["failed_ranks"] == [rank]


def test_sigterm_is_a_planned_migration(tmp_path: Path, references: RunOnce[str, dict], assets: Assets, hf_cache: Path) -> None:
    expected = references["ddp"]
    rng = fault_rng("torchtitan-sigterm")
    rank, step = rng.randrange(4), rng.randint(3, STEPS - 2)
    run = launch_titan(tmp_path, "ddp", assets, hf_cache)
    try:
        run.wait_step(rank, step, timeout=300)
        pids = run.active_pids()
        run.inject("term", rank=rank)
        _check_migrated(run, expected, pids, rank, "planned", "ddp")
    finally:
        run.kill()
