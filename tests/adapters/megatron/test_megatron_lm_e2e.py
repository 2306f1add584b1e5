"""End to end: Megatron-LM's own ``pretrain()`` loop with ``--torchpass`` survives real faults, bitwise.

The job is :mod:`tests.support.megatron.pretrain_gpt_lm`, a ``pretrain_gpt.py``-style
script run by Megatron-LM's ``pretrain()`` -> ``train()`` -> ``train_step()`` of
megatron-core 0.17.0 (CPU, gloo, the test-only CPU shim): dropout,
``MockGPTDataset``, Megatron's DDP, optimizer and cosine scheduler, 4
micro-batches per iteration, in three layouts: TP 2 x DP 2; DP 4 with the
distributed optimizer (its shards covered by buddy copies); DP 2 x 2
distributed-optimizer instances (a shard's copy is the same position in the
other instance). The oracle is the same script under plain ``torchrun``,
without torchpass: each faulted run under ``torchpass launch ... --torchpass``
must end with every rank's model, optimizer (main params and moments of a
distributed optimizer's shard included), scheduler, counters (iteration,
consumed samples) and RNG tracker bit for bit equal to it, and the loss
Megatron-LM logs for every iteration equal too; survivors keep their PIDs; no
checkpoint is written (no ``--load`` / ``--save``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import JobRun, RunOnce, assert_migrated, fault_rng, free_port, launch
from tests.support.megatron.megatron_lm_args import ITERATIONS, LAYOUTS, MEGATRON_LM_ARGS

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[3] / "tests" / "support" / "megatron" / "pretrain_gpt_lm.py"


def _logged_losses(workdir: Path) -> dict[int, float]:
    """The job's loss curve: each iteration's ``lm loss`` as Megatron-LM's training_log got it, from any rank."""
    curve: dict[int, float] = {}
    for f in (workdir / "logged_losses").glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            record = json.loads(line)
            loss = record["losses"]["lm loss"]
            assert curve.setdefault(record["step"], loss) == loss, f"iteration {record['step']} logged two losses"
    return curve


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory, megatron_lm_env: dict[str, str]) -> RunOnce[str, dict[str, Any]]:
    """Per layout, the script under plain torchrun, without torchpass (computed on first use)."""

    def run(layout: str) -> dict[str, Any]:
        workdir = tmp_path_factory.mktemp(f"megatron-lm-torchrun-{layout}")
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(SCRIPT), *MEGATRON_LM_ARGS, *LAYOUTS[layout],
        ]  # fmt: skip
        env = {**os.environ, **megatron_lm_env}
        result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=400)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        ranks = {int(f.stem[4:]): json.loads(f.read_text()) for f in (workdir / "out").glob("rank*.json")}
        assert sorted(ranks) == [0, 1, 2, 3]
        losses = _logged_losses(workdir)
        assert sorted(losses) == list(range(1, ITERATIONS + 1))
        return {"ranks": ranks, "losses": losses}

    return RunOnce(run)


def _start(workdir: Path, layout: str, env: dict[str, str]) -> JobRun:
    return launch(workdir, SCRIPT, [*MEGATRON_LM_ARGS, *LAYOUTS[layout], "--test-step-sleep", "0.2", "--torchpass"], env=env)


def _fault(
    layout: str, fault: str, tmp_path: Path, reference: dict[str, Any], env: dict[str, str]
) -> tuple[int, dict[str, Any]]:
    """Inject ``fault`` at a random rank and iteration; the faulted run must match ``reference`` bitwise."""
    rng = fault_rng(f"megatron-lm-{layout}-{fault}")
    rank, iteration = rng.randrange(4), rng.randint(2, ITERATIONS - 2)
    run = _start(tmp_path, layout, env)
    run.wait_step(rank, iteration, timeout=300)
    pids = run.active_pids()
    run.inject(fault, rank=rank)
    last = assert_migrated(run, reference["ranks"], pids, {rank}, CAUSES[fault], max_steps_lost=1)
    assert _logged_losses(run.workdir) == reference["losses"]
    assert list(last["replaced"]) == [str(rank)]
    return rank, last


CAUSES = {"kill": "kill", "hang": "hang", "term": "planned"}


@pytest.mark.parametrize("fault", ["kill", "hang", "term"])
def test_tensor_and_data_parallel(
    fault: str, tmp_path: Path, references: RunOnce[str, dict[str, Any]], megatron_lm_env: dict[str, str]
) -> None:
    rank, last = _fault("tp2dp2", fault, tmp_path, references["tp2dp2"], megatron_lm_env)
    # Model and optimizer state is replicated along data parallelism: nothing is rolled back.
    assert last["steps_lost"] == 0
    if fault == "term":
        # A drained rank hands over its own state.
        assert [s["rank"] for s in last["sources"][str(rank)]["from"]["params"]] == [rank]


def test_distributed_optimizer_shard_from_its_buddy_copy(
    tmp_path: Path, references: RunOnce[str, dict[str, Any]], megatron_lm_env: dict[str, str]
) -> None:
    """DP 4, one optimizer instance: no replica holds a rank's shard, its buddy copy does."""
    rank, last = _fault("dp4-distopt", "kill", tmp_path, references["dp4-distopt"], megatron_lm_env)
    (source,) = last["sources"][str(rank)]["from"]["optimizer"]
    assert source["copy"].startswith("held:") and source["rank"] != rank, source


def test_distributed_optimizer_shard_from_the_other_instance(
    tmp_path: Path, references: RunOnce[str, dict[str, Any]], megatron_lm_env: dict[str, str]
) -> None:
    """DP 2 x 2 instances: the same position in the other instance holds the shard; no buddy copy is kept."""
    layout = "dp2x2-distopt-instances"
    rank, last = _fault(layout, "kill", tmp_path, references[layout], megatron_lm_env)
    (source,) = last["sources"][str(rank)]["from"]["optimizer"]
    at = dict(part.split("=") for part in last["sources"][str(rank)]["at"].split())
    source_at = dict(part.split("=") for part in source["at"].split())
    assert source["copy"] == "live" and source_at["dp_in_instance"] == at["dp_in_instance"], source
    assert source_at["dp_instance"] != at["dp_instance"] and last["steps_lost"] == 0


@pytest.mark.parametrize("layout,steps_lost", [("dp4-distopt", 1), ("dp2x2-distopt-instances", 0)])
def test_rank_lost_right_after_its_optimizer_step(
    layout: str, steps_lost: int, tmp_path: Path, references: RunOnce[str, dict[str, Any]], megatron_lm_env: dict[str, str]
) -> None:
    """The chaos flags kill rank 1 right after its optimizer step of iteration 4. With buddy copies its copy
    of iteration 4 never left: every rank goes back to iteration 3 and runs 4 again (one step lost); the
    other instance holds iteration 4 of the same shard (none lost). Bitwise either way."""
    chaos = ["--torchpass-chaos-kill-rank", "1", "--torchpass-chaos-kill-step", "4", "--torchpass-chaos-kill-point", "after_commit"]
    run = launch(tmp_path, SCRIPT, [*MEGATRON_LM_ARGS, *LAYOUTS[layout], "--test-step-sleep", "0.2", "--torchpass", *chaos], env=megatron_lm_env)
    pids = run.wait_active_pids(4)
    last = assert_migrated(run, references[layout]["ranks"], pids, {1}, "kill", max_steps_lost=1)
    assert _logged_losses(run.workdir) == references[layout]["losses"]
    assert last["steps_lost"] == steps_lost, last


def test_rank_lost_between_iterations_before_its_buddy_copy_left(
    tmp_path: Path, references: RunOnce[str, dict[str, Any]], megatron_lm_env: dict[str, str]
) -> None:
    """Rank 1 dies once iteration 4 returned to train(), before its buddy copy of 4 left: the others have
    counted iteration 4 and fail in training_log's barrier (--log-interval 1), between iterations. Every rank
    goes back to iteration 3; the survivors run 4 again below train(), which counted it already, then 5."""
    layout = "dp4-distopt"
    chaos = ["--torchpass-chaos-kill-rank", "1", "--torchpass-chaos-kill-step", "4", "--torchpass-chaos-kill-point", "step_end"]
    run = launch(tmp_path, SCRIPT, [*MEGATRON_LM_ARGS, *LAYOUTS[layout], "--test-step-sleep", "0.2", "--torchpass", *chaos], env=megatron_lm_env)
    pids = run.wait_active_pids(4)
    last = assert_migrated(run, references[layout]["ranks"], pids, {1}, "kill", max_steps_lost=1)
    assert _logged_losses(run.workdir) == references[layout]["losses"]
    assert last["steps_lost"] == 1, last
    survivor_logs = "".join(f.read_text() for f in (run.run_dir / "logs").glob("*.err"))
    assert "training_log was cut short by a migration" in survivor_logs
