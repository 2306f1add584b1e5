"""The TorchTitan entry point's spare warm-up (:mod:`torchpass.adapters.torchtitan.spare_warmup`): what a hot spare
imports and parses while it waits for a rank."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.torchtitan.assets import Assets
from tests.support.torchtitan.jobs import JOB_TOML

PROBE = """
import json, sys
import torchpass.adapters.torchtitan.train  # what a TorchTitan spare preloads (torchpass.core.worker)
before = set(sys.modules)
from torchtitan.hf_datasets.text_datasets import DATASETS
DATASETS["c4_test"].loader(sys.argv[1])  # as the trainer's set-up does, after the assignment
print(json.dumps(sorted({name.split(".")[0] for name in set(sys.modules) - before})))
"""


def _packages_the_dataset_build_imports(role: str, assets: Assets, cache: Path) -> list[str]:
    env = {**os.environ, "TORCHPASS_ROLE": role, "HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(assets.dataset_path)], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_spare_builds_the_dataset_without_importing_a_package_and_an_active_rank_imports_them_then(
    assets: Assets, tmp_path: Path
) -> None:
    """Hugging Face ``datasets`` imports the modules it patches for streaming when TorchTitan's loader builds the
    dataset: in a spare that is after its assignment, so the entry point imports them while the spare waits."""
    assert _packages_the_dataset_build_imports("spare", assets, tmp_path / "spare-cache") == []
    if importlib.util.find_spec("scipy") is not None:
        # Nothing depends on scipy: where it is not installed, datasets patches nothing in it and no rank imports it.
        assert "scipy" in _packages_the_dataset_build_imports("active", assets, tmp_path / "active-cache")


CONFIG_PROBE = """
import dataclasses, json, sys
sys.argv = ["train", "--job.config_file", sys.argv[1], "--training.steps", "7"]  # as torchpass.core.worker sets it
import torchpass.adapters.torchtitan.train as entry  # what a TorchTitan spare preloads
from torchpass.adapters.torchtitan import spare_warmup
from torchtitan.config import ConfigManager
argv = entry.with_torchpass_section(sys.argv[1:])
ahead = spare_warmup._parsed.get(tuple(argv))
# What the entry point's __main__ does once the spare has its rank:
ConfigManager.parse_args.__defaults__ = (argv,)
spare_warmup.use_parsed_config(argv)
first, again = ConfigManager().parse_args(), ConfigManager().parse_args()
print(json.dumps({
    "parsed_ahead": ahead is not None,
    "main_got_it": first is ahead,
    "then_parsed_anew": again is not first and dataclasses.asdict(again) == dataclasses.asdict(first),  # each parse makes its own merged class
    "steps": first.training.steps,
}))
"""


def test_a_spare_s_main_gets_the_config_parsed_while_it_waited_once(tmp_path: Path) -> None:
    env = {**os.environ, "TORCHPASS_ROLE": "spare", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CONFIG_PROBE, str(JOB_TOML)], env=env, capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"parsed_ahead": True, "main_got_it": True, "then_parsed_anew": True, "steps": 7}
