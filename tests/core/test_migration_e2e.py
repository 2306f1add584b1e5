"""End to end: the DDP reference job survives real faults and ends bitwise identical to the fault-free run.

Every case runs ``torchpass launch`` with 4 active ranks on CPU/gloo, injects a
real fault with ``torchpass inject`` at a randomly chosen step (seed printed),
and checks the semantics contract: final model, optimizer and scheduler state
and every step's loss equal the fault-free run's bit for bit; survivors keep
their PIDs; nothing but the job's own outputs is written (no checkpoint); the
ledger and ``torchpass report`` account for the migration.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Imported up front (it loads torch): a request issued mid-run must land at the step the test chose.
from torchpass.core.control import Keys  # noqa: F401
from torchpass.core.inject import request_migration

from tests.support.harness import JOBS, assert_migrated, fault_free, fault_rng, launch

pytestmark = pytest.mark.e2e

STEPS = 20
JOB = JOBS / "jobs_ddp.py"
ARGS = ["--steps", str(STEPS), "--workdir", ".", "--step-sleep", "0.2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fault_free(tmp_path_factory.mktemp("reference"), JOB, ARGS)


def _check_success(
    run, reference, pids_before: dict[int, int], replaced: set[int], cause: str, max_steps_lost: int = 0
) -> dict:
    last = assert_migrated(run, reference, pids_before, replaced, cause, max_steps_lost)
    for rank_s, src in last["sources"].items():
        for cls, sources in src["from"].items():
            # A rank is its own source only when draining, or rolling back to its own snapshot.
            assert all(s["rank"] != int(rank_s) or cause == "planned" or s["copy"] == "snapshot" for s in sources), (cls, sources)
    return last


def test_sigkill_random_rank_random_step(tmp_path: Path, reference: dict) -> None:
    rng = fault_rng("sigkill")
    rank, step = rng.randrange(4), rng.randint(3, STEPS - 4)
    run = launch(tmp_path, JOB, ARGS)
    run.wait_step(rank, step)
    pids = run.active_pids()
    run.inject("kill", rank=rank)
    last = _check_success(run, reference, pids, {rank}, "kill")
    assert last["failed_ranks"] == [rank]


def test_sigstop_hang_recovers_within_heartbeat_timeout(tmp_path: Path, reference: dict) -> None:
    rng = fault_rng("sigstop")
    rank, step = rng.randrange(4), rng.randint(3, STEPS - 4)
    run = launch(tmp_path, JOB, ARGS)
    run.wait_step(rank, step)
    pids = run.active_pids()
    run.inject("hang", rank=rank)
    last = _check_success(run, reference, pids, {rank}, "hang")
    # fast_detect: heartbeat timeout 3 s; the process-group timeout is gloo's 30 min default.
    assert last["timings"]["detect"] < 3.0 + 2.0, last["timings"]
    assert last["timings"]["total"] < 60.0, last["timings"]


def test_sigterm_is_a_planned_migration_from_the_rank_itself(tmp_path: Path, reference: dict) -> None:
    rng = fault_rng("sigterm")
    rank, step = rng.randrange(4), rng.randint(3, STEPS - 4)
    run = launch(tmp_path, JOB, ARGS)
    run.wait_step(rank, step)
    pids = run.active_pids()
    run.inject("term", rank=rank)
    last = _check_success(run, reference, pids, {rank}, "planned")
    assert [s["rank"] for s in last["sources"][str(rank)]["from"]["params"]] == [rank]


def test_whole_node_lost_with_its_launcher(tmp_path: Path, reference: dict) -> None:
    rng = fault_rng("node")
    step = rng.randint(3, STEPS - 4)
    run = launch(tmp_path, JOB, ARGS, nproc=2, nnodes=2, node_spares=[2, 0])
    run.wait_step(2, step)
    pids = run.active_pids()
    run.inject("node", rank=2)
    last = _check_success(run, reference, pids, {2, 3}, "node")
    assert sorted(last["failed_ranks"]) == [2, 3]


def test_two_faults_in_a_row(tmp_path: Path, reference: dict) -> None:
    rng = fault_rng("two-faults")
    first, second = rng.sample(range(4), 2)
    s1 = rng.randint(3, 7)
    s2 = rng.randint(s1 + 4, STEPS - 3)
    run = launch(tmp_path, JOB, ARGS, spares=2)
    run.wait_step(first, s1)
    pids = run.active_pids()
    run.inject("kill", rank=first)
    run.wait_for_line("migration to generation 1 succeeded")
    run.wait_step(second, s2)
    run.inject("kill", rank=second)
    _check_success(run, reference, pids, {first, second}, "kill")
    assert [m["outcome"] for m in run.migrations()] == ["success", "success"]


def test_fault_during_a_migration(tmp_path: Path, reference: dict) -> None:
    rng = fault_rng("fault-during-migration")
    first, second = rng.sample(range(4), 2)
    step = rng.randint(3, STEPS - 6)
    run = launch(tmp_path, JOB, ARGS, spares=2)
    run.wait_step(first, step)
    pids = run.active_pids()
    run.inject("kill", rank=first)
    run.wait_for_line("plan for generation 1")
    run.inject("kill", rank=second)
    _check_success(run, reference, pids, {first, second}, "kill")
    outcomes = [m["outcome"] for m in run.migrations()]
    assert outcomes[-1] == "success" and "superseded" in outcomes, outcomes


def test_assigned_spare_dies_while_joining(tmp_path: Path, reference: dict) -> None:
    rng = fault_rng("spare-dies")
    rank, step = rng.randrange(4), rng.randint(3, STEPS - 6)
    run = launch(tmp_path, JOB, ARGS, spares=2)
    run.wait_step(rank, step)
    pids = run.active_pids()
    run.inject("kill", rank=rank)
    run.wait_for_line("plan for generation 1")
    assigned = next(w["wid"] for w in run.workers()["workers"] if w["role"] == "spare" and w["wid"] == "n0-s0")
    run.inject("kill", worker=assigned)
    _check_success(run, reference, pids, {rank}, "kill")


def test_a_fault_while_the_only_spare_is_still_starting_waits_for_it(tmp_path: Path, reference: dict) -> None:
    """A spare that is spawned but still importing is coming: the migration waits for it, says so, and succeeds."""
    slow_spare = JOBS / "slow_spare"
    rank = fault_rng("spare-still-starting").randrange(4)
    run = launch(tmp_path, JOB, ARGS, env={"PYTHONPATH": str(slow_spare), "TORCHPASS_TEST_SPARE_START_DELAY_S": "15"})
    run.wait_step(rank, 2)
    pids = run.active_pids()
    run.inject("kill", rank=rank)
    _check_success(run, reference, pids, {rank}, "kill")
    assert "spare(s) still starting" in run.output(), run.output()[-3000:]


def test_an_error_that_repeats_at_the_same_step_stops_the_job_as_a_script_bug(tmp_path: Path) -> None:
    """An exception that reads like a gloo failure, raised every time rank 1 runs step 5, with every process alive."""
    run = launch(tmp_path, JOB, [*ARGS, "--bug-at", "1:5"])
    assert run.wait() == 3, run.explain()
    out = run.output()
    assert "step 5 failed 4 times in a row with every process alive" in out, run.explain()
    assert "looks like a bug in the training script" in out and "mismatched sizes" in out, run.explain()
    migrations = run.migrations()
    # Each attempt resumes at step 5, which fails again before the attempt can close.
    assert [m["outcome"] for m in migrations] == ["superseded"] * 3 + ["failed"], migrations
    assert migrations[-1]["classification"] == "disqualifying", migrations[-1]
    assert all(m["cause"] == "comm" and m["failed_ranks"] == [] and m["replaced"] == {} for m in migrations), migrations
    assert run.stray_files() == []


def test_a_drain_asked_for_during_a_migration_follows_it(tmp_path: Path, reference: dict) -> None:
    """SIGTERM to a survivor while a spare is joining: after that migration the survivor hands over too."""
    run = launch(tmp_path, JOB, [*ARGS, "--spare-setup-sleep", "6"], spares=2)
    run.wait_step(1, 3)
    pids = run.active_pids()
    run.inject("kill", rank=1)
    run.wait_for_line("plan for generation 1", timeout=60)
    run.inject("term", rank=2)
    last = assert_migrated(run, reference, pids, {1, 2}, "planned", max_steps_lost=0)
    assert last["failed_ranks"] == [2], last
    assert "it follows once that one ends" in run.output(), run.explain()
    causes = [(m["cause"], m["outcome"]) for m in run.migrations()]
    assert causes == [("kill", "success"), ("planned", "success")], causes


def test_no_spare_left_is_a_clean_disqualified_exit(tmp_path: Path) -> None:
    run = launch(tmp_path, JOB, ARGS, spares=0)
    run.wait_step(1, 5)
    run.inject("kill", rank=1)
    code = run.wait()
    assert code != 0
    assert "no spare left for rank(s) [1]" in run.output()
    assert "torchpass: job failed: cannot migrate" in run.output().splitlines()[-1] or "job failed" in run.output()
    events = run.migrations()
    assert events and events[-1]["classification"] == "disqualifying" and events[-1]["outcome"] == "failed"
    report = run.report()
    assert report["disqualifying"] == 1 and report["success_rate"] is None
    assert not (run.workdir / "out").exists() or not list((run.workdir / "out").iterdir())


# ---- sharded state: ZeRO-1 (torch ZeroRedundancyOptimizer) and buddy copies -------------

ZERO_ARGS = [*ARGS, "--zero"]


@pytest.fixture(scope="module")
def reference_zero(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fault_free(tmp_path_factory.mktemp("reference-zero"), JOB, ZERO_ARGS)


def test_sharded_optimizer_state_comes_from_the_buddy_copy(tmp_path: Path, reference_zero: dict) -> None:
    rng = fault_rng("zero1-kill")
    rank, step = rng.randrange(4), rng.randint(3, STEPS - 4)
    run = launch(tmp_path, JOB, ZERO_ARGS)
    run.wait_step(rank, step)
    pids = run.active_pids()
    run.inject("kill", rank=rank)
    last = _check_success(run, reference_zero, pids, {rank}, "kill", max_steps_lost=1)
    optimizer_sources = last["sources"][str(rank)]["from"]["optimizer"]
    assert [s["copy"] for s in optimizer_sources] in (["held:%d" % rank], ["snapshot"]), optimizer_sources


def test_kill_inside_the_optimizer_step_rolls_back_to_snapshots(tmp_path: Path, reference_zero: dict) -> None:
    """ZeroRedundancyOptimizer broadcasts parameters inside its step: survivors are caught mid-commit (dirty)."""
    run = launch(tmp_path, JOB, ZERO_ARGS, extra=["--chaos", "kill_in_commit"])
    pids = {}
    run.wait_step(0, 2)
    pids = run.active_pids()
    last = _check_success(run, reference_zero, pids, {1}, "kill", max_steps_lost=1)
    assert last["target_step"] == 6, last
    assert any(src["copy"] == "snapshot" for plan in last["sources"].values() for srcs in plan["from"].values() for src in srcs)


def test_a_stalled_rank_is_caught_by_the_hang_timeout(tmp_path: Path, reference: dict) -> None:
    """Rank 3's training thread stops but its heartbeats go on: only step progress reveals it."""
    run = launch(tmp_path, JOB, ARGS, extra=["--chaos", "stall_in_step"])
    run.wait_step(0, 2)
    pids = run.active_pids()
    last = _check_success(run, reference, pids, {3}, "progress")
    assert last["failed_ranks"] == [3] and last["target_step"] == 5
    assert last["fenced"] == {}, "the stalled rank is the fault, not a survivor the migration cost"
    # Fenced, it first wrote where it was stuck: the training thread in the chaos stall.
    assert "Current thread" in run.output() or "Thread 0x" in run.output(), run.output()[-3000:]
    assert 'chaos.py", line' in run.output() and 'in fire' in run.output(), run.output()[-3000:]


def test_operator_asks_for_a_planned_migration(tmp_path: Path, reference: dict) -> None:
    rng = fault_rng("operator-migrate")
    rank, step = rng.randrange(4), rng.randint(3, STEPS - 4)
    run = launch(tmp_path, JOB, ARGS)
    run.wait_step(rank, step)
    pids = run.active_pids()
    request_migration(run.run_dir, rank)
    last = _check_success(run, reference, pids, {rank}, "planned")
    assert [s["rank"] for s in last["sources"][str(rank)]["from"]["params"]] == [rank]


BUCKET_ARGS = [*ARGS, "--bucket-cap-mb", "0.0001"]


def test_kill_while_ddp_rebuilds_its_buckets(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank 1 dies as step 2 starts, while the survivors run DDP's one-time bucket rebuild (two broadcasts).

    With tiny buckets the rebuilt layout differs from the construction-time one, so
    any rank left on the wrong layout changes the reduction order (or hangs).
    """
    ref = fault_free(tmp_path_factory.mktemp("reference-buckets"), JOB, BUCKET_ARGS)
    run = launch(tmp_path, JOB, BUCKET_ARGS, extra=["--chaos", "kill_before_ddp_rebuild"])
    run.wait_step(0, 1)
    pids = run.active_pids()
    last = _check_success(run, ref, pids, {1}, "kill")
    assert last["target_step"] == 2


BATCHNORM_ARGS = [*ARGS, "--batchnorm"]


@pytest.fixture(scope="module")
def reference_batchnorm(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fault_free(tmp_path_factory.mktemp("reference-batchnorm"), JOB, BATCHNORM_ARGS)


def test_batchnorm_statistics_are_per_rank_state(tmp_path: Path, reference_batchnorm: dict) -> None:
    """BatchNorm's running statistics differ per rank (each forward updates them from its own batch).

    The spare must get the lost rank's own statistics, not a replica's, and the
    final digests (buffers included) must match the fault-free run's.
    """
    rng = fault_rng("batchnorm-kill")
    rank, step = rng.randrange(4), rng.randint(3, STEPS - 4)
    run = launch(tmp_path, JOB, BATCHNORM_ARGS)
    run.wait_step(rank, step)
    pids = run.active_pids()
    run.inject("kill", rank=rank)
    _check_success(run, reference_batchnorm, pids, {rank}, "kill")


def test_batchnorm_survivors_reexecute_a_step_without_updating_statistics_twice(tmp_path: Path, tmp_path_factory) -> None:
    """Rank 2 dies as its backward of step 5 begins: every survivor's forward has updated its statistics.

    ``broadcast_buffers=False``: no rank's buffers are ever overwritten by rank
    0's, so a survivor that kept its interrupted forward's update would end with
    different statistics, and so would a spare given anyone's but rank 2's.
    """
    args = [*BATCHNORM_ARGS, "--no-broadcast-buffers"]
    ref = fault_free(tmp_path_factory.mktemp("reference-batchnorm-local"), JOB, args)
    run = launch(tmp_path, JOB, args, extra=["--chaos", "kill_after_backward"])
    run.wait_step(0, 2)
    pids = run.active_pids()
    _check_success(run, ref, pids, {2}, "kill", max_steps_lost=0)


def test_a_drain_caught_inside_the_commit_hands_over_its_snapshot(tmp_path: Path, reference_zero: dict) -> None:
    """Rank 1 asks to leave inside step 5's optimizer step (ZeroRedundancyOptimizer broadcasts there).

    Every rank is dirty, so the job rolls back to the snapshots of step 4; the spare
    taking rank 1 over must read the draining process's snapshot over the network,
    not look for one of its own (it has the same rank number, and none).
    """
    run = launch(tmp_path, JOB, ZERO_ARGS, extra=["--chaos", "term_in_commit"])
    run.wait_step(0, 2)
    pids = run.active_pids()
    last = _check_success(run, reference_zero, pids, {1}, "planned", max_steps_lost=1)
    assert [s["copy"] for s in last["sources"]["1"]["from"]["optimizer"]] == ["snapshot"], last["sources"]


def test_a_rank_killed_at_start_up_before_publishing_its_address(tmp_path: Path, reference: dict) -> None:
    """Rank 1 dies right after attaching, before it publishes its buddy address.

    With buddy copies on, its peers resolve where their first copy goes, which
    needs that address; the wait must end with the generation (it used to last
    for good: the peers never reported, were fenced, and the job was lost).
    Plain DDP keeps replicas of everything, so the migration is qualifying; with
    sharded state the same fault is disqualifying (no copy of the shard exists
    before its first push), which the controller says at once.
    """
    run = launch(tmp_path, JOB, ARGS, extra=["--chaos", "kill_at_attach", "--set", "redundancy=buddy"])
    pids = run.wait_active_pids(4)
    last = _check_success(run, reference, pids, {1}, "kill")
    assert last["failed_ranks"] == [1] and last["target_step"] == 1, last  # step 1 runs after the migration
