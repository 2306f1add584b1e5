"""End to end: TorchTitan's shipped llama3 job configs, with only ``[torchpass] enable = true`` added, migrate bitwise.

The jobs are TorchTitan 0.2.2's own ``debug_model.toml`` and ``llama3_8b.toml``
(``tests/support/torchtitan/shipped/``), scaled to 4 CPU ranks on the command
line the way a user scales a config down (``jobs.shipped_args``: parallelism,
batch shape, assets, seed and deterministic kernels for the oracle,
checkpointing switched on). Everything else is as shipped: bf16 mixed
precision, selective activation checkpointing, ``[metrics] log_freq``, the
8B config's profiler and TensorBoard.

Each faulted run is compared with a fault-free run of the same command line:
every rank's loss and gradient norm of every step, its final model shards,
optimizer and LR scheduler state, and every checkpoint TorchTitan wrote (read
back whole: model, optimizer, LR scheduler, dataloader and train state) are
bitwise equal; survivors keep their PIDs; the ledger has one successful
qualifying migration. The HSDP reference runs under plain ``torchrun``, so
those runs are compared with TorchTitan's unmodified trainer.

The SIGKILL campaign runs ``TORCHPASS_TEST_TITAN_CAMPAIGN`` faults per layout
(1 in CI, on HSDP only; the issue's acceptance campaign is 10 on HSDP and FSDP, see
docs/adapters/torchtitan.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import JobRun, RunOnce, assert_bitwise, fault_rng, launch
from tests.support.torchtitan.assets import Assets
from tests.support.torchtitan.jobs import (
    ENTRY_POINT,
    SHIPPED,
    checkpoint_digest,
    job_env,
    launch_titan,
    shipped_args,
    torchrun_titan,
)
from tests.support.torchtitan.probe import KILL_IN_SAVE_ENV

pytestmark = pytest.mark.e2e

STEPS = 10
"""``[training] steps`` of the debug config (and of the 8B config as the tests scale it)."""

CAMPAIGN_RUNS = int(os.environ.get("TORCHPASS_TEST_TITAN_CAMPAIGN", "1"))

CAMPAIGN_LAYOUTS = ["hsdp", "fsdp"] if CAMPAIGN_RUNS > 1 else ["hsdp"]
"""In CI (one run) HSDP only: FSDP's random SIGKILL is the 8B config's case, and FSDP is also the
rollback and final-save cases' layout; the acceptance campaign runs both."""

TITAN_OUTPUTS = {"checkpoint", "comm_traces", "tb", "profile_trace"}
"""What TorchTitan itself writes into the dump folder with these configs."""

REPLICATED = {"hsdp"}


@dataclass(frozen=True)
class Job:
    """One command line: a shipped config on a layout, with extra flags."""

    config: str
    layout: str
    extra: tuple[str, ...] = ()


@dataclass
class Outcome:
    results: dict[int, dict[str, Any]]
    checkpoints: dict[str, str]
    """Checkpoint folder name (``step-<k>``) -> digest of everything in it."""


def _checkpoints(run: JobRun) -> dict[str, str]:
    folder = run.workdir / "checkpoint"
    return {d.name: checkpoint_digest(d) for d in sorted(folder.glob("step-*"))} if folder.is_dir() else {}


def _reference(root: Path, job: Job, assets: Assets, hf_cache: Path) -> Outcome:
    workdir = root / "_".join([job.config, job.layout, *(flag.lstrip("-") for flag in job.extra)])
    args = shipped_args(job.config, job.layout, assets, list(job.extra))
    if job.layout == "hsdp":
        run = torchrun_titan(workdir, job.layout, assets, hf_cache, args=args)
    else:
        run = launch_titan(workdir, job.layout, assets, hf_cache, args=args)
        assert run.wait(600) == 0, run.explain()
        assert not run.migrations()
    results = run.results()
    assert sorted(results) == [0, 1, 2, 3] and all(len(r["losses"]) == STEPS for r in results.values())
    assert all(len(r["grad_norms"]) == STEPS for r in results.values())
    outcome = Outcome(results, _checkpoints(run))
    assert f"step-{STEPS}" in outcome.checkpoints
    return outcome


References = RunOnce[Job, Outcome]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory, assets: Assets, hf_cache: Path) -> References:
    """Each job's fault-free outcome, run once per module on first use."""
    root = tmp_path_factory.mktemp("references")
    return RunOnce(lambda job: _reference(root, job, assets, hf_cache))


def _launch(
    tmp_path: Path, job: Job, assets: Assets, hf_cache: Path, env: dict[str, str] | None = None, fault: tuple[str, ...] = ()
) -> JobRun:
    """Start ``job``; ``fault``: flags of this run only (a chaos point), not of its reference."""
    args = shipped_args(job.config, job.layout, assets, [*job.extra, *fault])
    return launch_titan(tmp_path, job.layout, assets, hf_cache, args=args, env=env)


def _check_migrated(
    run: JobRun, reference: Outcome, pids_before: dict[int, int], replaced: int, layout: str, max_steps_lost: int = 1
) -> dict[str, Any]:
    assert run.wait(600) == 0, run.explain()
    results = run.results()
    assert_bitwise(results, reference.results)
    assert _checkpoints(run) == reference.checkpoints, "TorchTitan's checkpoints differ from the fault-free run's"
    for rank, pid in pids_before.items():
        if rank == replaced:
            assert results[rank]["pid"] != pid, f"rank {rank} should run in a spare now"
        else:
            assert results[rank]["pid"] == pid, f"survivor rank {rank} changed PID {pid} -> {results[rank]['pid']}"
    assert set(run.stray_files()) <= TITAN_OUTPUTS, run.stray_files()
    assert "not loading a checkpoint" in run.output(), "the spare did not skip TorchTitan's checkpoint load"
    migrations = run.migrations()
    assert len(migrations) == 1 and migrations[0]["outcome"] == "success", migrations
    last = migrations[0]
    assert last["cause"] == "kill" and last["classification"] == "qualifying", last
    assert [int(r) for r in last["replaced"]] == [replaced], last
    assert last["steps_lost"] <= (0 if layout in REPLICATED else max_steps_lost), last
    print(f"[{layout}] rank {replaced}: target step {last['target_step']}, steps lost {last['steps_lost']}, "
          f"{last['bytes_moved'] / 1e6:.1f} MB moved, timings {last['timings']}")  # fmt: skip
    return last


def _sigkill_at_random(tmp_path: Path, job: Job, references: References, assets: Assets, hf_cache: Path, seed_name: str) -> None:
    """SIGKILL a random rank once it reaches a random step; the run must migrate and match the reference."""
    expected = references[job]
    rng = fault_rng(seed_name)
    rank, step = rng.randrange(4), rng.randint(2, STEPS - 1)
    run = _launch(tmp_path, job, assets, hf_cache)
    try:
        run.wait_step(rank, step, timeout=300)
        pids = run.active_pids()
        run.inject("kill", rank=rank)
        _check_migrated(run, expected, pids, rank, job.layout)
    finally:
        run.kill()


@pytest.mark.parametrize("run_index", range(CAMPAIGN_RUNS))
@pytest.mark.parametrize("layout", CAMPAIGN_LAYOUTS)
def test_debug_model_sigkill_campaign(
    tmp_path: Path, layout: str, run_index: int, references: References, assets: Assets, hf_cache: Path
) -> None:
    _sigkill_at_random(tmp_path, Job("debug_model", layout), references, assets, hf_cache, f"torchtitan-shipped-{layout}-{run_index}")


@pytest.mark.skipif(CAMPAIGN_RUNS == 1, reason="runs with the acceptance campaign (TORCHPASS_TEST_TITAN_CAMPAIGN > 1)")
def test_full_activation_checkpointing_sigkill(tmp_path: Path, references: References, assets: Assets, hf_cache: Path) -> None:
    # The shipped configs use selective AC (per layer in the debug config, per op in the 8B one); the third mode.
    job = Job("debug_model", "hsdp", ("--activation_checkpoint.mode", "full"))
    _sigkill_at_random(tmp_path, job, references, assets, hf_cache, "torchtitan-shipped-full-ac")


def test_llama3_8b_config_scaled_down_sigkill(tmp_path: Path, references: References, assets: Assets, hf_cache: Path) -> None:
    # The 8B config shards over every rank (data_parallel_shard_degree = -1): FSDP over 4.
    _sigkill_at_random(tmp_path, Job("llama3_8b", "fsdp"), references, assets, hf_cache, "torchtitan-shipped-8b")


def test_a_rollback_past_step_one_re_executes_it_with_the_spare(
    tmp_path: Path, references: References, assets: Assets, hf_cache: Path
) -> None:
    """Survivors roll back to step 0 (buddy copies every 2 steps) from inside step 2, past TorchTitan's step-1 barrier.

    The spare executes step 1 and returns to ``train()``, which would call
    ``set_pg_timeouts`` (a world barrier) while the survivors go on to step 2:
    it must not (it happened in a campaign: the job hung until the hang timeout).
    """
    job = Job("debug_model", "fsdp", ("--torchpass.buddy_interval_steps", "2"))
    expected = references[job]
    rank = fault_rng("torchtitan-rollback-past-step-1").randrange(4)
    # SIGKILL when step 2's backward begins: survivors hold version 1, the lost rank's copies only version 0.
    chaos = ("--torchpass.chaos.kill_rank", str(rank), "--torchpass.chaos.kill_step", "2", "--torchpass.chaos.kill_point", "backward")
    run = _launch(tmp_path, job, assets, hf_cache, fault=chaos)
    try:
        run.wait_step(rank, 1, timeout=300)
        pids = run.active_pids()
        last = _check_migrated(run, expected, pids, rank, "fsdp", max_steps_lost=2)
    finally:
        run.kill()
    assert last["target_step"] == 1 and last["steps_lost"] == 1, last


@pytest.mark.parametrize(
    ("layout", "save_step", "dying"),
    [("hsdp", 5, 0), ("fsdp", STEPS, None)],
    ids=["hsdp-mid-run-save-coordinator", "fsdp-final-save"],
)
def test_sigkill_inside_a_checkpoint_save(
    tmp_path: Path, layout: str, save_step: int, dying: int | None, references: References, assets: Assets, hf_cache: Path
) -> None:
    """A rank dies after writing its shards of a save, before the save's closing collective.

    The survivors' save fails; after the migration every rank, the spare
    included, writes that checkpoint again, and training goes on: both
    checkpoints (step 5 and the final one) are bitwise TorchTitan's. Rank 0 is
    DCP's coordinator, which writes the checkpoint's replicated entries (the
    trainer's step among them): when it dies, the spare that replaces it
    coordinates the save again (it once wrote its own step, 1, there).
    """
    job = Job("debug_model", layout, ("--checkpoint.interval", "5"))
    expected = references[job]
    rank = dying if dying is not None else fault_rng(f"torchtitan-save-{layout}").randrange(4)
    run = _launch(tmp_path, job, assets, hf_cache, env={KILL_IN_SAVE_ENV: f"{rank}:{save_step}"})
    try:
        run.wait_step(rank, 2, timeout=300)
        pids = run.active_pids()
        last = _check_migrated(run, expected, pids, rank, layout)
    finally:
        run.kill()
    assert "inside the checkpoint save" in run.output()
    assert "every rank saves it again" in run.output() or last["steps_lost"] == 1, "the interrupted save was not redone"


def _bad_job(tmp_path: Path, assets: Assets, hf_cache: Path, toml_tail: str, extra: tuple[str, ...] = ()) -> str:
    """Launch the debug config with ``toml_tail`` replacing its section; return the output of the failed job.

    One rank and no spare: the section is read before TorchTitan looks at the world size."""
    toml = tmp_path / "job.toml"
    shipped = SHIPPED["debug_model"].read_text()
    toml.write_text(shipped[: shipped.rindex("[torchpass]")] + toml_tail)
    args = shipped_args("debug_model", "hsdp", assets, list(extra))
    args[args.index("--job.config_file") + 1] = str(toml)
    run = launch(tmp_path / "job", ENTRY_POINT, args, module=True, env=job_env(hf_cache), nproc=1, spares=0)
    try:
        assert run.wait(300) != 0, "the job should have failed at start-up"
    finally:
        run.kill()
    assert not list((run.workdir / "losses").glob("rank*.jsonl")), "a step ran before the error"
    return run.output()


def test_a_misspelled_key_fails_before_training_naming_it(tmp_path: Path, assets: Assets, hf_cache: Path) -> None:
    output = _bad_job(tmp_path, assets, hf_cache, "[torchpass]\nenable = true\nbuddy_interval_step = 2\n")
    assert "unknown key buddy_interval_step (did you mean 'buddy_interval_steps'?)" in output, output[-3000:]


def test_torchtitan_fault_tolerance_with_torchpass_is_refused(tmp_path: Path, assets: Assets, hf_cache: Path) -> None:
    output = _bad_job(tmp_path, assets, hf_cache, "[torchpass]\nenable = true\n", ("--fault_tolerance.enable",))
    assert "[fault_tolerance] enable = true and [torchpass] enable = true: only one of them can drive recovery" in output, output[-3000:]
