"""End to end: a real megatron-core GPT job with ``--torchpass`` survives real faults, bitwise.

Every case runs ``torchpass launch`` with 4 active ranks and a hot spare on
CPU/gloo (megatron-core through the test-only CPU shim), trains the job of
:mod:`tests.support.megatron.gpt_job` in a TP 2 x DP 2, PP 2 x DP 2 or DP 4
(distributed optimizer) layout,
injects a real fault at a randomly chosen rank and step (seed printed), and
checks: every step's loss and every rank's final model, optimizer, scheduler,
counters and RNG tracker equal the fault-free run's bit for bit; survivors
keep their PIDs; no checkpoint is written; the ledger shows the failed rank's
state copied from a rank with its model-parallel coordinates; and every
process group the model and the data-parallel wrapper cache is one of
``parallel_state``'s objects, rebuilt for the new generation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import JobRun, assert_bitwise, assert_migrated, fault_rng, launch

pytestmark = pytest.mark.e2e

SUPPORT = Path(__file__).resolve().parents[3] / "tests" / "support" / "megatron"
JOB = SUPPORT / "gpt_job.py"
STEPS = 10
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
REPLICA_DIMS = {"dp", "cp"}
"""Ranks that differ only along these dimensions hold identical model and optimizer state."""


def _start(workdir: Path, layout: str, env: dict[str, str] | None = None, **kwargs: Any) -> JobRun:
    args = ["--layout", layout, "--steps", str(STEPS), "--workdir", ".", "--step-sleep", "0.2", "--torchpass"]
    return launch(workdir, JOB, args, env={**ENV, **(env or {})}, **kwargs)


def _reference(tmp_path_factory: pytest.TempPathFactory, layout: str, env: dict[str, str] | None = None) -> dict[int, dict[str, Any]]:
    run = _start(tmp_path_factory.mktemp(f"reference-{layout}"), layout, env)
    assert run.wait(timeout=400) == 0, run.explain()
    assert not run.migrations()
    return run.results()


@pytest.fixture(scope="module")
def reference_tp2dp2(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return _reference(tmp_path_factory, "tp2dp2")


@pytest.fixture(scope="module")
def reference_dp4distopt(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return _reference(tmp_path_factory, "dp4distopt")


@pytest.fixture(scope="module")
def reference_pp2dp2(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return _reference(tmp_path_factory, "pp2dp2")


def _coordinates(at: str) -> dict[str, int]:
    """``"pp=0 dp=1 tp=1"`` (the ledger's ``Layout.locate`` form) as a mapping."""
    return {name: int(value) for name, value in (part.split("=") for part in at.split())}


def _model_parallel(at: str) -> dict[str, int]:
    return {name: value for name, value in _coordinates(at).items() if name not in REPLICA_DIMS}


def _check_success(
    run: JobRun, reference: dict[int, dict[str, Any]], pids_before: dict[int, int], replaced: int, cause: str
) -> dict[str, Any]:
    assert run.wait(timeout=400) == 0, run.explain()
    results = run.results()
    assert_bitwise(results, reference)
    for rank, pid in pids_before.items():
        if rank == replaced:
            assert results[rank]["pid"] != pid, f"rank {rank} should run in the spare now"
        else:
            assert results[rank]["pid"] == pid, f"survivor rank {rank} changed PID {pid} -> {results[rank]['pid']}"
    assert run.stray_files() == [], "the job wrote files besides its outputs (a checkpoint?)"
    migrations = run.migrations()
    assert [m["outcome"] for m in migrations] == ["success"], migrations
    last = migrations[0]
    assert last["cause"] == cause and last["classification"] == "qualifying", last
    assert list(map(int, last["replaced"])) == [replaced], last
    # Model and optimizer state is replicated along data parallelism: nothing is rolled back.
    assert last["steps_lost"] == 0 and last["bytes_moved"] > 0, last
    receiver = last["sources"][str(replaced)]
    for cls in ("params", "optimizer"):
        for source in receiver["from"][cls]:
            assert _model_parallel(source["at"]) == _model_parallel(receiver["at"]), (cls, receiver)
            if cause != "planned":
                assert source["rank"] != replaced, (cls, receiver)
    for rank, result in results.items():
        groups = result["groups"]
        assert groups, f"rank {rank} reported no cached process groups"
        for path, group in groups.items():
            assert group["rebuildable"] and group["parallel_state_object"], (rank, path, group)
            assert group["generation"] == 1, f"rank {rank}: {path} was not rebuilt for generation 1: {group}"
    return last


@pytest.mark.parametrize("layout", ["tp2dp2", "pp2dp2"])
def test_sigkill_random_rank_random_step(layout: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    reference = request.getfixturevalue(f"reference_{layout}")
    rng = fault_rng(f"megatron-{layout}-sigkill")
    rank, step = rng.randrange(4), rng.randint(3, STEPS - 3)
    run = _start(tmp_path, layout)
    run.wait_step(rank, step, timeout=300)
    pids = run.active_pids()
    run.inject("kill", rank=rank)
    last = _check_success(run, reference, pids, rank, "kill")
    assert last["failed_ranks"] == [rank]


def test_sigstop_hang_is_replaced(tmp_path: Path, reference_tp2dp2: dict[int, dict[str, Any]]) -> None:
    rng = fault_rng("megatron-sigstop")
    rank, step = rng.randrange(4), rng.randint(3, STEPS - 3)
    run = _start(tmp_path, "tp2dp2")
    run.wait_step(rank, step, timeout=300)
    pids = run.active_pids()
    run.inject("hang", rank=rank)
    last = _check_success(run, reference_tp2dp2, pids, rank, "hang")
    # fast_detect: a heartbeat older than 3 s fences the rank.
    assert last["timings"]["detect"] < 3.0 + 2.0, last["timings"]


def test_sigterm_is_a_planned_migration(tmp_path: Path, reference_tp2dp2: dict[int, dict[str, Any]]) -> None:
    rng = fault_rng("megatron-sigterm")
    rank, step = rng.randrange(4), rng.randint(3, STEPS - 3)
    run = _start(tmp_path, "tp2dp2")
    run.wait_step(rank, step, timeout=300)
    pids = run.active_pids()
    run.inject("term", rank=rank)
    last = _check_success(run, reference_tp2dp2, pids, rank, "planned")
    # A drained rank hands over its own state.
    assert [s["rank"] for s in last["sources"][str(rank)]["from"]["params"]] == [rank]


def test_misspelled_flag_fails_before_training(tmp_path: Path) -> None:
    args = ["--layout", "tp2dp2", "--workdir", ".", "--torchpass", "--torchpass-buddy-intervl-steps", "2"]
    run = launch(tmp_path, JOB, args, nproc=1, spares=0, env=ENV)
    assert run.wait(timeout=300) != 0
    output = run.output()
    assert "unknown flag --torchpass-buddy-intervl-steps: did you mean --torchpass-buddy-interval-steps?" in output
    assert not list((tmp_path / "progress").glob("rank*")), "training started despite the bad flag"


def test_distributed_optimizer_in_a_megatron_core_loop(tmp_path: Path, reference_dp4distopt: dict[int, dict[str, Any]]) -> None:
    """MegatronRun with Megatron's distributed optimizer (DP 4): the lost rank's shard comes from its buddy copy."""
    rng = fault_rng("megatron-dp4distopt-sigkill")
    rank, step = rng.randrange(4), rng.randint(3, STEPS - 3)
    run = _start(tmp_path, "dp4distopt")
    run.wait_step(rank, step, timeout=300)
    pids = run.active_pids()
    run.inject("kill", rank=rank)
    # A rank lost between its optimizer step and its buddy copy of it costs one step.
    last = assert_migrated(run, reference_dp4distopt, pids, {rank}, "kill", max_steps_lost=1)
    (source,) = last["sources"][str(rank)]["from"]["optimizer"]
    assert source["copy"].startswith("held:") and source["rank"] != rank, source


def test_megatron_core_0_17(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, megatron_lm_env: dict[str, str]) -> None:
    """The same megatron-core loop on megatron-core 0.17.0 (the wheel that carries Megatron-LM's training code)."""
    reference = _reference(tmp_path_factory, "tp2dp2", megatron_lm_env)
    rng = fault_rng("megatron-core-0.17-sigkill")
    rank, step = rng.randrange(4), rng.randint(3, STEPS - 3)
    run = _start(tmp_path, "tp2dp2", megatron_lm_env)
    run.wait_step(rank, step, timeout=300)
    pids = run.active_pids()
    run.inject("kill", rank=rank)
    _check_success(run, reference, pids, rank, "kill")
