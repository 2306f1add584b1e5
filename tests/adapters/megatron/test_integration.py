"""The Megatron-LM integration ``torchpass launch`` activates: a hot spare imports, while it waits, what
``pretrain()``'s set-up imports lazily; an active rank does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from torchpass.adapters.megatron.integration import MEGATRON_LM_IMPORTS

PROBE = """
import json, sys
from torchpass.adapters.megatron.integration import activate, MEGATRON_LM_IMPORTS
activate(["--torchpass"])
import megatron.training
print(json.dumps([name for name in MEGATRON_LM_IMPORTS if name in sys.modules]))
"""


def _imported(role: str, megatron_lm_env: dict[str, str]) -> list[str]:
    env = {**os.environ, **megatron_lm_env, "TORCHPASS_ROLE": role}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_spare_imports_the_tokenizer_models_with_megatron_training_and_an_active_rank_does_not(
    megatron_lm_env: dict[str, str],
) -> None:
    assert _imported("spare", megatron_lm_env) == list(MEGATRON_LM_IMPORTS)
    assert _imported("active", megatron_lm_env) == []
