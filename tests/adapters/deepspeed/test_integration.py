"""The integration ``torchpass launch`` activates: a hot spare warms what ``deepspeed.initialize`` imports lazily."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from torchpass.adapters.deepspeed.integration import INITIALIZE_IMPORTS

PROBE = """
import json, sys
from torchpass.adapters.deepspeed.integration import activate, INITIALIZE_IMPORTS
activate([])
import deepspeed
print(json.dumps([name for name in INITIALIZE_IMPORTS if name in sys.modules]))
"""


def _imported_after_activation(role: str) -> list[str]:
    env = {**os.environ, "TORCHPASS_ROLE": role, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_spare_imports_what_initialize_would_and_an_active_worker_does_not() -> None:
    assert _imported_after_activation("spare") == list(INITIALIZE_IMPORTS)
    assert "deepspeed.runtime.zero.muon.muon_optimizer" not in _imported_after_activation("active")
