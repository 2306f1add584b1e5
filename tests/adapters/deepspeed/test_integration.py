"""The integration ``torchpass launch`` activates: a hot spare warms what ``deepspeed.initialize`` imports lazily,
and what ``deepspeed.init_distributed`` probes and loads on its first call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from typing import Any

from torchpass.adapters.deepspeed.integration import INITIALIZE_IMPORTS

PROBE = """
import json, sys
from torchpass.adapters.deepspeed.integration import activate, INITIALIZE_IMPORTS
activate([])
import deepspeed
from deepspeed.ops.op_builder.builder import OpBuilder
probed = "__compatible_ops__" in vars(deepspeed.ops)
loaded = sorted(OpBuilder._loaded_ops)
from deepspeed.comm.torch import build_shm_op
build_shm_op()  # what init_distributed's backend does first
print(json.dumps({
    "imported": [name for name in INITIALIZE_IMPORTS if name in sys.modules],
    "probed": probed,
    "loaded": loaded,
    "loaded_by_init_distributed": sorted(set(OpBuilder._loaded_ops) - set(loaded)),
}))
"""


@cache
def _after_activation(role: str) -> dict[str, Any]:
    """What a fresh process of ``role`` has imported, probed and loaded once the script imported ``deepspeed``."""
    env = {**os.environ, "TORCHPASS_ROLE": role, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_spare_imports_what_initialize_would_and_an_active_worker_does_not() -> None:
    spare, active = _after_activation("spare"), _after_activation("active")
    assert spare["imported"] == list(INITIALIZE_IMPORTS)
    assert "deepspeed.runtime.zero.muon.muon_optimizer" not in active["imported"]


def test_a_spare_has_probed_and_loaded_what_init_distributed_would_and_an_active_worker_has_not() -> None:
    spare, active = _after_activation("spare"), _after_activation("active")
    assert spare["probed"] and spare["loaded_by_init_distributed"] == []
    assert not active["probed"] and active["loaded"] == []
