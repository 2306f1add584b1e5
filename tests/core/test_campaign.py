"""``torchpass chaos``: campaign configs (Hydra), the summary table, and a short campaign of real faults."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torchpass.core.campaign import DISQUALIFIED, RESOLVED, VOID, WRONG, FaultRun, format_summary, load_campaign

from tests.support.harness import JOBS


def test_shipped_campaigns_compose_and_overrides_apply() -> None:
    quick = load_campaign("quick", [])
    assert quick.faults == 5 and quick.nodes == 1 and "node" not in quick.kinds
    full = load_campaign("full", ["faults=3", "seed=9"])
    assert (full.faults, full.seed, full.nodes) == (3, 9, 2) and "node" in full.kinds


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("nope", [], "campaign 'nope' not found; shipped campaigns: full, quick"),
        ("quick", ["kinds=[kill,segfault]"], "kinds: ['segfault'] are not fault kinds"),
        ("quick", ["kinds=[node]"], "'node' needs nodes >= 2"),
        ("quick", ["faults=-1"], "faults: got -1"),
    ],
)
def test_a_bad_campaign_is_refused_with_the_field_named(name: str, overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_campaign(name, overrides)


def test_an_unknown_field_is_refused_by_the_schema() -> None:
    with pytest.raises(Exception, match="faultz"):
        load_campaign("quick", ["faultz=3"])


def test_the_summary_counts_outcomes_per_kind_and_lists_what_was_not_resolved() -> None:
    runs = [
        FaultRun(0, "kill", 1, 5, RESOLVED, lost_s=0.5),
        FaultRun(1, "kill", 2, 7, RESOLVED, lost_s=1.5),
        FaultRun(2, "hang", 0, 4, DISQUALIFIED, "no spare left for rank(s) [0]"),
        FaultRun(3, "term", 3, 6, WRONG, "ranks [3]: final state differs from the fault-free run"),
    ]
    table = format_summary(runs)
    assert "| kill | 2 | 2 | 0 | 0 | 0 | 1.00 s, 1.50 s |" in table
    assert "| hang | 1 | 0 | 1 | 0 | 0 | - |" in table
    assert "| all | 4 | 2 | 1 | 0 | 1 | 1.00 s, 1.50 s |" in table
    assert "- run 3 (term, rank 3, step 6): wrong state: ranks [3]: final state differs" in table
    assert "run 0" not in table
    assert "void" not in table  # the column appears only when a run was void


def test_a_fault_that_never_landed_is_void_not_a_verdict_on_migration() -> None:
    runs = [
        FaultRun(0, "kill", 1, 5, RESOLVED, lost_s=0.5),
        FaultRun(1, "kill", 0, 11, VOID, "the fault never landed: the job ended while waiting for rank 0 to reach step 11"),
    ]
    table = format_summary(runs)
    assert "| kill | 2 | 1 | 0 | 0 | 0 | 1 | 0.50 s, 0.50 s |" in table, table
    assert "- run 1 (kill, rank 0, step 11): void: the fault never landed" in table


@pytest.mark.e2e
def test_a_short_campaign_resolves_every_fault(tmp_path: Path) -> None:
    """The CLI end to end over the DDP test job: a kill, a hang, a spare dying while it joins."""
    run_dir = tmp_path / "chaos"
    cmd = [
        sys.executable, "-m", "torchpass.core.cli", "chaos", "--set", "faults=3", "--set", "kinds=[kill,hang,spare]",
        "--set", f"run_dir={run_dir}", "--set", "seed=4",
        "--", "--nproc-per-node", "2", "--spares-per-node", "2", "--config", "fast_detect",
        # Steps longer than the heartbeat interval (0.5 s): the driver sees a rank's step in its heartbeat, and a
        # fault drawn two steps before the end must land before the job does.
        str(JOBS / "jobs_ddp.py"), "--steps", "12", "--workdir", str(tmp_path / "work"), "--step-sleep", "0.3",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "| all | 3 | 3 | 0 | 0 | 0 |" in done.stdout, done.stdout[-3000:]
    assert (run_dir / "summary.json").exists()


def test_launch_arguments_naming_relative_files_are_made_absolute(tmp_path: Path) -> None:
    from torchpass.core.campaign import absolute_paths

    (tmp_path / "train.py").write_text("")
    (tmp_path / "job.toml").write_text("")
    (tmp_path / "outputs").mkdir()
    args = ["--nproc-per-node", "4", "train.py", "--job.config_file", "job.toml", "--config=job.toml", "--steps", "10", "/abs/x", "--job.dump_folder", "outputs", "."]
    assert absolute_paths(args, tmp_path) == [
        "--nproc-per-node", "4", str(tmp_path / "train.py"), "--job.config_file", str(tmp_path / "job.toml"),
        f"--config={tmp_path / 'job.toml'}", "--steps", "10", "/abs/x", "--job.dump_folder", "outputs", ".",
    ]  # fmt: skip
