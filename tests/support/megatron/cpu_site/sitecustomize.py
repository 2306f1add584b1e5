"""Test support only: install the megatron-core CPU shim in every worker of a CPU-only test run.

Put this directory on ``PYTHONPATH`` and set ``TORCHPASS_TEST_MEGATRON_CPU_SHIM=1``
to run an unmodified megatron-core script (examples/megatron/pretrain_gpt.py)
on a CPU-only machine under ``torchpass launch``: Python imports
``sitecustomize`` at start-up, and in processes the launcher started as
workers (``TORCHPASS_WID`` is set) this installs
:mod:`tests.support.megatron.cpu_shim` before the script runs. Without the
variable it does nothing; torchpass itself never installs the shim.
"""

import os

if os.environ.get("TORCHPASS_TEST_MEGATRON_CPU_SHIM") == "1" and "TORCHPASS_WID" in os.environ:
    import megatron.core  # noqa: F401  (the shim patches megatron-core modules)

    from tests.support.megatron import cpu_shim

    cpu_shim.install()
