"""End to end: Hugging Face's Trainer running DeepSpeed, unchanged, survives real faults bitwise.

The job (``tests/support/hf_trainer_job.py``) is written as Hugging Face's
DeepSpeed guide writes one: ``TrainingArguments(deepspeed="ds_config.json")``
with ``"auto"`` values and the ``"torchpass"`` block, a tiny GPT-2 built from a
config, ``trainer.train()``; it imports nothing from torchpass. ZeRO-2, GA 2,
a loss logged every step, 3 epochs of 8 steps (the Trainer's DeepSpeed loader
hands every rank the whole dataset here). The oracle is the
fault-free run's: every rank's parameters, fp32 partition, Adam moments,
counters, scheduler and the Trainer's whole log history (losses, gradient
norms, learning rates, epochs, total flos, the final train loss), bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.harness import JOBS, RunOnce, assert_migrated, fault_free, fault_rng, launch

pytestmark = pytest.mark.e2e

JOB = JOBS / "hf_trainer_job.py"
ARGS = ["--workdir", ".", "--step-sleep", "0.2"]
STEPS = 24
"""3 epochs of 8 steps (64 samples, micro-batch 4, GA 2)."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> RunOnce[int, dict]:
    """The fault-free results at a ZeRO stage."""
    return RunOnce(
        lambda zero: fault_free(tmp_path_factory.mktemp(f"reference-zero{zero}"), JOB, [*ARGS, "--zero", str(zero)], nproc=2, spares=0)
    )


def _chaos(step: int, point: str) -> list[str]:
    return ["--set", "chaos.kill_rank=1", "--set", f"chaos.kill_step={step}", "--set", f"chaos.kill_point={point}"]


def test_trainer_survives_sigkill_of_a_rank_mid_run(tmp_path: Path, reference: RunOnce[int, dict]) -> None:
    rng = fault_rng("sigkill-hf-trainer")
    rank, step = rng.randrange(2), rng.randint(2, STEPS - 2)
    run = launch(tmp_path, JOB, [*ARGS, "--zero", "2"], nproc=2)
    run.wait_step(rank, step)
    pids = run.active_pids()
    run.inject("kill", rank=rank)
    # ZeRO-2's optimizer partitions come back from buddy copies, which may be one step behind.
    last = assert_migrated(run, reference[2], pids, {rank}, "kill", max_steps_lost=1)
    assert last["failed_ranks"] == [rank]


@pytest.mark.parametrize(
    "zero, step, point, survivor",
    [
        # Rank 1 dies right after its optimizer step of step 4, before its buddy copy of it left: the job
        # resumes at step 4, which rank 0 (in its log's loss gather) executes again without the Trainer.
        (2, 4, "after_commit", "step 4 was executed again (the lost rank's copy of it did not survive)"),
        # The same at ZeRO-0, where every rank holds the whole state: nothing is lost, the log's loss gather
        # is cut short on rank 0, and both ranks (the spare from the lost rank's running loss) run it again.
        (0, 4, "after_commit", None),
    ],
)
def test_trainer_survives_a_kill_between_steps(
    tmp_path: Path, reference: RunOnce[int, dict], zero: int, step: int, point: str, survivor: str | None
) -> None:
    """Step 4 is mid-epoch 0: the spare joins there (the sampler skips the batches before it without loading
    them). A kill inside a step (the step runs again in place) is the random SIGKILL above, which lands inside
    a step almost always."""
    run = launch(tmp_path, JOB, [*ARGS, "--zero", str(zero)], nproc=2, extra=_chaos(step, point))
    run.wait_step(0, 2)
    pids = run.active_pids()
    last = assert_migrated(run, reference[zero], pids, {1}, "kill", max_steps_lost=1 if zero else 0)
    assert last["failed_ranks"] == [1]
    if survivor is not None:
        assert f"rank 0: {survivor}" in run.output(), run.output()[-4000:]
