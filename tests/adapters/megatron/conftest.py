"""Fixtures of the Megatron adapter's tests: Megatron-LM's training code (megatron-core 0.17.0's wheel)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.megatron import megatron_lm_wheel

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def megatron_lm_env() -> dict[str, str]:
    """Environment for a process that runs Megatron-LM's ``megatron.training`` (0.17.0) beside this repository.

    Provisioned on first use (see :mod:`tests.support.megatron.megatron_lm_wheel`);
    the test process itself keeps the installed megatron-core 0.16.1.
    """
    site = megatron_lm_wheel.ensure()
    path = os.pathsep.join(filter(None, [str(site), str(REPO), os.environ.get("PYTHONPATH", "")]))
    return {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
