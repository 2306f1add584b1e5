"""The adapter's state capture, restore and step discard on real one-rank DeepSpeed engines (ZeRO 0-3).

Runs ``tests/support/deepspeed_probe.py`` in a plain subprocess (its own
world of one gloo rank): a bitwise oracle for what the end-to-end tests
exercise through the launcher, minus the processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.harness import REPO, free_port


@pytest.fixture(scope="module")
def probe() -> dict:
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-m", "tests.support.deepspeed_probe"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_loaded_into_a_fresh_engine_continues_bitwise(probe: dict, stage: int) -> None:
    assert probe[f"zero{stage}"]["restore"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_only_what_a_migration_moves_loaded_and_resumed_continues_bitwise(probe: dict, stage: int) -> None:
    """ZeRO 1/2 move no parameters: resume() re-gathers them from the fp32 master partitions, bit for bit."""
    moved = ["engine", "optimizer"] if stage in (1, 2) else ["engine", "optimizer", "params"]
    assert probe[f"zero{stage}"]["moved"] == sorted({"engine": "global", "optimizer": "optimizer", "params": "params"}[c] for c in moved)
    assert probe[f"zero{stage}"]["rederived"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_interrupted_step_discarded_and_executed_again_is_bitwise_equal(probe: dict, stage: int) -> None:
    assert probe[f"zero{stage}"]["discard"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_protocol_points_of_a_step(probe: dict, stage: int) -> None:
    """Backward started once (boundary micro-batch), then the commit opens and closes."""
    calls = probe[f"zero{stage}"]["calls"]
    assert calls[0] == "backward" and calls.count("backward") == 1, calls
    assert calls[-1] == "commit_finished" and calls.count("commit_finished") == 1, calls
    assert set(calls[1:-1]) == {"commit_started"}, calls


def test_the_block_is_read_back_from_every_config_form(probe: dict) -> None:
    assert probe["forms"] == {"file": True, "args": True}


def test_an_unsupported_engine_is_refused_naming_the_setting(probe: dict) -> None:
    assert "zero_optimization.stage = 0 with optimizer wrapper" in probe["unsupported"], probe["unsupported"]
    assert 'drop "bf16"/"fp16"' in probe["unsupported"]


@pytest.mark.parametrize(
    "name, setting",
    [
        ("offload", "zero_optimization.offload_optimizer.device = 'cpu'"),
        ("moe", "mixture-of-experts layers"),
        ("bf16_optimizer", "BF16_Optimizer"),
    ],
)
def test_each_refused_configuration_names_its_setting(probe: dict, name: str, setting: str) -> None:
    message = probe["refused"][name]
    assert message.startswith("torchpass cannot migrate this DeepSpeed engine: ") and setting in message, message
    assert '"torchpass": {"enabled": false}' in message


def test_the_block_is_validated_without_the_launcher(probe: dict) -> None:
    assert probe["misspelled"].startswith('DeepSpeed config block "torchpass": unknown key enabeld'), probe["misspelled"]
