"""The GPU health watch against the real NVML (runs where a GPU and its driver are; skipped elsewhere).

A healthy GPU must give no signal, every check must either read or be reported unsupported (never fail), and
the slots must map onto NVML's devices as CUDA numbers them.
"""

from __future__ import annotations

import pytest

from torchpass.core.config import CRITICAL_XIDS, parse_xids
from torchpass.core.gpu_health import GpuHealthSource, GpuThresholds, gpu_handles, probe_nvml

nvml, why_not = probe_nvml()
pytestmark = pytest.mark.skipif(nvml is None, reason=f"no NVML here: {why_not}")


def test_a_healthy_gpu_gives_no_signal_and_every_check_reads() -> None:
    assert nvml is not None
    handles = gpu_handles(nvml, nvml.nvmlDeviceGetCount())
    assert handles and all(nvml.nvmlDeviceGetIndex(h) == slot for slot, h in handles.items())
    source = GpuHealthSource(nvml, handles, GpuThresholds(1, 5.0, parse_xids(CRITICAL_XIDS)))
    assert source.poll() == []
    assert source.poll() == []
