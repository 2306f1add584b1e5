"""The TorchTitan entry point's spare warm-up: what a hot spare imports while it waits for a rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.torchtitan.assets import Assets

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
    assert "scipy" in _packages_the_dataset_build_imports("active", assets, tmp_path / "active-cache")
