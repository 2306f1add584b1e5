"""An NVML-shaped stand-in for nvidia-ml-py's ``pynvml``, for machines without a GPU.

Replaces: ``libnvidia-ml.so`` behind ``pynvml`` (this machine has no NVIDIA
driver). It has the names, constants and error classes ``core/gpu_health.py``
calls, with NVML's semantics: per-device calls raise ``NVMLError_GpuIsLost``
once a GPU is lost, ``NVMLError_NotSupported`` for a check a GPU lacks, and an
event set hands out each critical XID once. Each GPU's state is read, on every
call, from the JSON file named by ``TORCHPASS_TEST_NVML_STATE``, which a test
rewrites to inject a sign::

    {"gpus": [{"ecc": 0, "retired_pending": false, "remap": [0, 0, false, false],
               "temp": 40, "slowdown": 90, "lost": false, "xids": [], "unsupported": []}, ...]}

A test puts this directory first on the launcher's ``PYTHONPATH``; the
launcher then imports it as ``pynvml``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_ENV = "TORCHPASS_TEST_NVML_STATE"

NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
nvmlEventTypeXidCriticalError = 0x0000000000000008


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_GpuIsLost(NVMLError):
    pass


class NVMLError_Timeout(NVMLError):
    pass


class NVMLError_Uninitialized(NVMLError):
    pass


_initialized = False


def _gpus() -> list[dict[str, Any]]:
    return json.loads(Path(os.environ[STATE_ENV]).read_text())["gpus"]


@dataclass(frozen=True)
class _Handle:
    index: int


def _gpu(handle: _Handle, check: str) -> dict[str, Any]:
    if not _initialized:
        raise NVMLError_Uninitialized("nvmlInit was not called")
    gpu = _gpus()[handle.index]
    if gpu.get("lost"):
        raise NVMLError_GpuIsLost(f"GPU {handle.index} is lost")
    if check in gpu.get("unsupported", []):
        raise NVMLError_NotSupported(f"GPU {handle.index}: {check} not supported")
    return gpu


def nvmlInit() -> None:
    global _initialized
    _initialized = True


def nvmlShutdown() -> None:
    global _initialized
    _initialized = False


def nvmlDeviceGetCount() -> int:
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    if not 0 <= index < len(_gpus()):
        raise NVMLError(f"invalid GPU index {index}")
    return _Handle(index)


def nvmlDeviceGetHandleByUUID(uuid: str) -> _Handle:
    return _Handle(int(uuid.rsplit("-", 1)[1]))  # the stand-in's UUIDs: GPU-shaped-<index>


def nvmlDeviceGetIndex(handle: _Handle) -> int:
    return handle.index


def nvmlDeviceGetTotalEccErrors(handle: _Handle, error_type: int, counter_type: int) -> int:
    assert (error_type, counter_type) == (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)
    return int(_gpu(handle, "ecc")["ecc"])


def nvmlDeviceGetRetiredPagesPendingStatus(handle: _Handle) -> int:
    return NVML_FEATURE_ENABLED if _gpu(handle, "retired")["retired_pending"] else NVML_FEATURE_DISABLED


def nvmlDeviceGetRemappedRows(handle: _Handle) -> tuple[int, int, int, int]:
    corrected, uncorrected, pending, failed = _gpu(handle, "remap")["remap"]
    return int(corrected), int(uncorrected), int(pending), int(failed)


def nvmlDeviceGetTemperature(handle: _Handle, sensor: int) -> int:
    assert sensor == NVML_TEMPERATURE_GPU
    return int(_gpu(handle, "thermal")["temp"])


def nvmlDeviceGetTemperatureThreshold(handle: _Handle, threshold: int) -> int:
    assert threshold == NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    return int(_gpu(handle, "thermal")["slowdown"])


class _EventSet:
    def __init__(self) -> None:
        self.devices: set[int] = set()
        self.delivered: dict[int, int] = {}


@dataclass
class _EventData:
    device: _Handle
    eventType: int
    eventData: int


def nvmlEventSetCreate() -> _EventSet:
    return _EventSet()


def nvmlDeviceRegisterEvents(handle: _Handle, event_types: int, event_set: _EventSet) -> None:
    assert event_types == nvmlEventTypeXidCriticalError
    _gpu(handle, "xid")
    event_set.devices.add(handle.index)
    event_set.delivered[handle.index] = len(_gpus()[handle.index].get("xids", []))  # only XIDs after registration


def nvmlEventSetWait_v2(event_set: _EventSet, timeout_ms: int) -> _EventData:
    for index, gpu in enumerate(_gpus()):
        xids = gpu.get("xids", [])
        if index in event_set.devices and event_set.delivered[index] < len(xids):
            event_set.delivered[index] += 1
            return _EventData(_Handle(index), nvmlEventTypeXidCriticalError, int(xids[event_set.delivered[index] - 1]))
    raise NVMLError_Timeout("no event")
