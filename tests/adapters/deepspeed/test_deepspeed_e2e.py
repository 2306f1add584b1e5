"""End to end: real DeepSpeed engines survive real faults and end bitwise identical to the fault-free run.

Every case runs ``torchpass launch`` on CPU/gloo with the reference job
(``tests/support/deepspeed_job.py``: GA 2, WarmupLR, AdamW ``torch_adam``,
gradient clipping, dropout) and checks the semantics contract against the
fault-free run of the same configuration: every rank's final parameters,
optimizer state, counters and scheduler, and every step's loss, equal bit for
bit; survivors keep their PIDs; no file besides the job's outputs is written;
the ledger and ``torchpass report`` account for the migration. ZeRO 1-3 shard
optimizer state, which comes back from buddy copies: a rollback of at most one
interval is allowed there (0 at ZeRO 0). Fault ranks and steps are random (seed
printed; ``TORCHPASS_TEST_SEED`` replays).

The forward/backward/step jobs use ``torchpass.adapters.deepspeed.steps``;
the pipeline job imports nothing from torchpass, as a user's ``train_batch``
script would not: the integration the worker activates hooks the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from tests.support.harness import JOBS, JobRun, assert_migrated, fault_free, fault_rng, launch

pytestmark = pytest.mark.e2e

STEPS = 10
JOB = JOBS / "deepspeed_job.py"
ARGS = ["--steps", str(STEPS), "--workdir", ".", "--step-sleep", "0.25"]
JOBS_BY_NAME: dict[str, tuple[list[str], int]] = {
    "zero0": (["--zero", "0"], 2),
    "zero2": (["--zero", "2"], 2),
    "zero3": (["--zero", "3"], 2),
    "pp2xdp2-zero1": (["--pipe", "--zero", "1"], 4),
}
"""ZeRO-1 is the pipeline job's stage (its optimizer shards come back from buddy copies as ZeRO-2's do);
docs/reliability.md has the ZeRO-1 chaos campaigns."""
LOADER_STEPS = 9
"""``--loader-loop`` trains 3 epochs of 3 steps: random faults land on both sides of epoch boundaries."""
LOADER_JOBS: dict[str, tuple[list[str], int]] = {
    "loader-zero0": (["--loader-loop", "--zero", "0"], 2),
    "loader-zero3": (["--loader-loop", "--zero", "3"], 2),
}
OWN_LOADER_JOBS: dict[str, tuple[list[str], int]] = {
    "own-zero1": (["--own-loader", "--zero", "1", "--samples", "40", "--epochs", "4"], 2),
    "own-zero3": (["--own-loader", "--zero", "3", "--samples", "40", "--epochs", "4"], 2),
}
"""The Getting Started loop over the script's own DataLoader: 5 micro-batches per epoch and rank, so with GA 2
step 3 takes the last micro-batch of epoch 0 and the first of epoch 1."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """The fault-free results of a configuration, run once per module and shared by its tests."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            extra, nproc = {**JOBS_BY_NAME, **LOADER_JOBS, **OWN_LOADER_JOBS}[name]
            cache[name] = fault_free(tmp_path_factory.mktemp(f"reference-{name}"), JOB, [*ARGS, *extra], nproc=nproc, spares=0)
        return cache[name]

    return get


def _start(tmp_path: Path, name: str, **kwargs: Any) -> JobRun:
    extra, nproc = {**JOBS_BY_NAME, **LOADER_JOBS, **OWN_LOADER_JOBS}[name]
    return launch(tmp_path, JOB, [*ARGS, *extra], nproc=nproc, **kwargs)


@pytest.mark.parametrize("name", list(JOBS_BY_NAME))
def test_sigkill_random_rank_random_step(tmp_path: Path, reference: Callable[[str], dict], name: str) -> None:
    _, nproc = JOBS_BY_NAME[name]
    rng = fault_rng(f"sigkill-{name}")
    rank, step = rng.randrange(nproc), rng.randint(3, STEPS - 3)
    run = _start(tmp_path, name)
    run.wait_step(rank, step)
    pids = run.active_pids()
    run.inject("kill", rank=rank)
    last = assert_migrated(run, reference(name), pids, {rank}, "kill", max_steps_lost=0 if name == "zero0" else 1)
    assert last["failed_ranks"] == [rank]
    # Replicated state comes from a data-parallel replica, ZeRO-sharded state from a buddy copy.
    sharded = {"zero0": set(), "zero3": {"params", "optimizer"}}.get(name, {"optimizer"})
    for cls, sources in last["sources"][str(rank)]["from"].items():
        if cls in sharded:
            assert all(s["copy"] in (f"held:{rank}", "snapshot") for s in sources), (cls, sources)
        else:
            assert all(s["copy"] in ("live", "snapshot") and s["rank"] != rank for s in sources), (cls, sources)


@pytest.mark.parametrize("name", ["loader-zero0"])
def test_an_unchanged_loop_over_the_engine_dataloader_is_migratable(
    tmp_path: Path, reference: Callable[[str], dict], name: str
) -> None:
    """The script's own ``for epoch: for batch in trainloader`` loop, no torchpass call in it."""
    rng = fault_rng(f"sigkill-{name}")
    rank, step = rng.randrange(2), rng.randint(2, LOADER_STEPS - 2)
    run = _start(tmp_path, name)
    run.wait_step(rank, step)
    pids = run.active_pids()
    run.inject("kill", rank=rank)
    last = assert_migrated(run, reference(name), pids, {rank}, "kill", max_steps_lost=0 if name == "loader-zero0" else 1)
    assert last["failed_ranks"] == [rank]


ZERO3_PHASES = {
    # step_start (the survivor's first gather fails: the forward runs again in place) is the own-loader case below.
    "last_forward": "forward",  # the second micro-batch's gathers fail: a stand-in, then the step from its start
    "backward": "backward",  # the boundary backward's reduce-scatter fails
    "commit": "step",  # inside the optimizer step: the survivor is dirty and rolls back to its snapshot
}


def _chaos(step: int, point: str) -> list[str]:
    return ["--set", "chaos.kill_rank=1", "--set", f"chaos.kill_step={step}", "--set", f"chaos.kill_point={point}"]


@pytest.mark.parametrize("point", list(ZERO3_PHASES))
def test_zero3_unchanged_loop_survives_a_kill_in_each_phase(tmp_path: Path, reference: Callable[[str], dict], point: str) -> None:
    """The tutorial loop at ZeRO-3: rank 1 is killed at a precise point of step 5; the survivor fails where named."""
    run = _start(tmp_path, "loader-zero3", extra=_chaos(5, point))
    run.wait_step(0, 2)
    pids = run.active_pids()
    last = assert_migrated(run, reference("loader-zero3"), pids, {1}, "kill", max_steps_lost=1)
    assert last["failed_ranks"] == [1]
    assert f"rank 0: engine.{ZERO3_PHASES[point]}() was interrupted by a migration" in run.output(), run.output()[-4000:]


@pytest.mark.parametrize("fault, cause", [("hang", "hang"), ("term", "planned")])
def test_zero3_unchanged_loop_survives_a_stop_and_a_drain(
    tmp_path: Path, reference: Callable[[str], dict], fault: str, cause: str
) -> None:
    rng = fault_rng(f"{fault}-loader-zero3")
    rank, step = rng.randrange(2), rng.randint(2, LOADER_STEPS - 2)
    run = _start(tmp_path, "loader-zero3")
    run.wait_step(rank, step)
    pids = run.active_pids()
    run.inject(fault, rank=rank)
    last = assert_migrated(run, reference("loader-zero3"), pids, {rank}, cause, max_steps_lost=0 if fault == "term" else 1)
    assert last["failed_ranks"] == [rank]


@pytest.mark.parametrize("name, point", [("own-zero1", "last_forward"), ("own-zero3", "step_start")])
def test_the_scripts_own_dataloader_loop_survives_a_kill_across_an_epoch_boundary(
    tmp_path: Path, reference: Callable[[str], dict], name: str, point: str
) -> None:
    """Getting Started's ``enumerate(data_loader)`` loop, no torchpass in it: rank 1 dies in step 3, which spans
    epochs 0 and 1. The survivor replays the step's micro-batches from memory (one of them inside epoch 1's
    pass); the spare's loop runs through epoch 0's pass positioned at its last micro-batch (the batches before
    it are not loaded), then into epoch 1 with its own ``set_epoch``."""
    run = _start(tmp_path, name, extra=_chaos(3, point))
    run.wait_step(0, 2)
    pids = run.active_pids()
    last = assert_migrated(run, reference(name), pids, {1}, "kill", max_steps_lost=1)
    assert last["failed_ranks"] == [1] and last["target_step"] == 3, last
    output = run.output()
    assert "the training loop's data loader is a DataLoader of 5 batches" in output
    # ZeRO-1's forward has no collective: the survivor fails in the backward. ZeRO-3's first gather of step 3
    # fails, and the forward runs again in place.
    where = "forward" if name == "own-zero3" else "backward"
    assert f"rank 0: engine.{where}() was interrupted by a migration; step 3" in output, output[-4000:]


def test_sigterm_is_a_planned_migration(tmp_path: Path, reference: Callable[[str], dict]) -> None:
    rng = fault_rng("sigterm-zero2")
    rank, step = rng.randrange(2), rng.randint(3, STEPS - 3)
    run = _start(tmp_path, "zero2")
    run.wait_step(rank, step)
    pids = run.active_pids()
    run.inject("term", rank=rank)
    last = assert_migrated(run, reference("zero2"), pids, {rank}, "planned", max_steps_lost=0)
    # A draining rank hands over its own state, the sharded partitions included.
    assert all(s["rank"] == rank for srcs in last["sources"][str(rank)]["from"].values() for s in srcs), last["sources"]


def test_kill_inside_the_commit_rolls_back_to_snapshots(tmp_path: Path, reference: Callable[[str], dict]) -> None:
    """Rank 1 dies in its optimizer step of step 6 (configs/chaos/kill_in_commit.yaml).

    The survivor has updated its partition and is caught in ZeRO's post-step
    all-gather: it is dirty, restores its own snapshot of step 5, and step 6 is
    executed again.
    """
    run = _start(tmp_path, "zero2", extra=["--chaos", "kill_in_commit"])
    run.wait_step(0, 2)
    pids = run.active_pids()
    last = assert_migrated(run, reference("zero2"), pids, {1}, "kill", max_steps_lost=1)
    assert last["target_step"] == 6, last
    assert [src["copy"] for src in last["sources"]["0"]["from"]["optimizer"]] == ["snapshot"], last["sources"]


def test_misspelled_key_fails_before_training(tmp_path: Path) -> None:
    block = '{"enabled": true, "buddy_interval_step": 2}'
    run = launch(tmp_path, JOB, [*ARGS, "--zero", "1", "--config-form", "args", "--block", block], nproc=2, spares=0)
    assert run.wait() != 0
    out = run.output()
    assert 'DeepSpeed config block "torchpass": unknown key buddy_interval_step' in out, out[-3000:]
    assert "did you mean 'buddy_interval_steps'?" in out
    assert not any((tmp_path / "progress").iterdir()), "a step started before the config was rejected"
