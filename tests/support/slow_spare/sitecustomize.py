"""Test support: a hot spare that takes a while to start, as on a cold machine. Never product behaviour.

A test puts this directory on a job's ``PYTHONPATH`` and sets
``TORCHPASS_TEST_SPARE_START_DELAY_S``; Python imports this module at start-up
in every process, and a process started as a spare sleeps that long before
anything else (so it reports ready that much later), the way a spare importing
DeepSpeed or TorchTitan from a cold disk does. Other processes are untouched.
"""

import os
import time

DELAY_ENV = "TORCHPASS_TEST_SPARE_START_DELAY_S"

if os.environ.get("TORCHPASS_ROLE") == "spare" and os.environ.get(DELAY_ENV):
    time.sleep(float(os.environ[DELAY_ENV]))
