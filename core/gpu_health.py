"""NVML's early signs of a failing GPU, turned into a planned migration of the rank on it (cause ``pre-emptive``).

A GPU usually announces its end: uncorrectable ECC errors start to count,
pages wait to be retired or rows to be remapped (which needs a reset), the
driver logs a critical XID, the temperature climbs to the slowdown threshold,
or the GPU falls off the bus. Moving its rank away while the process still
runs is a planned migration (the rank hands its own state over) instead of a
failure after it. Each launcher's agent watches its own slots' GPUs through
``nvidia-ml-py`` (``pynvml``) on the node-signal thread (``core/node_signals.py``):

* slot ``i`` is the process with ``LOCAL_RANK`` ``i`` (actives first, then
  spares), on the GPU CUDA shows it as device ``i``: NVML's index ``i``, or
  the ``i``-th entry of ``CUDA_VISIBLE_DEVICES`` (an index or a UUID);
* at start each GPU's volatile uncorrected ECC count is the baseline and XID
  events are registered where the GPU supports them; a check a GPU does not
  support (``NVMLError_NotSupported``) is skipped for that GPU, once;
* every poll, each GPU not yet reported is checked in turn; the first sign
  past its threshold (``signals.*``) is the GPU's one signal.

On a machine without NVML (no driver, a CPU job) the probe says so once and
the watch stays off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Mapping

from .node_signals import NodeSignal

__all__ = ["GpuHealthSource", "GpuThresholds", "PRE_EMPTIVE", "gpu_handles", "probe_nvml"]

PRE_EMPTIVE = "pre-emptive"
"""The ledger's cause for a migration NVML's signs asked for."""


@dataclass(frozen=True)
class GpuThresholds:
    """When a sign is a signal (from ``signals.*``, see ``core/config.py``)."""

    ecc_uncorrected_increase: int
    thermal_margin_c: float
    xids: frozenset[int]


def probe_nvml() -> tuple[ModuleType | None, str]:
    """``(pynvml, "")`` initialized with at least one GPU, or ``(None, why not)``."""
    try:
        import pynvml
    except ImportError as exc:
        return None, f"nvidia-ml-py is not installed ({exc})"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        return None, f"NVML cannot start ({exc})"
    if count == 0:
        return None, "NVML sees no GPU"
    return pynvml, ""


def gpu_handles(nvml: ModuleType, slots: int, environ: Mapping[str, str] = os.environ) -> dict[int, Any]:
    """Slot -> NVML device handle, for the slots that have a GPU."""
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()] if "CUDA_VISIBLE_DEVICES" in environ else None
    count = nvml.nvmlDeviceGetCount()
    out = {}
    for slot in range(slots):
        if visible is None:
            if slot < count:
                out[slot] = nvml.nvmlDeviceGetHandleByIndex(slot)
        elif slot < len(visible):
            ref = visible[slot]
            out[slot] = nvml.nvmlDeviceGetHandleByIndex(int(ref)) if ref.isdigit() else nvml.nvmlDeviceGetHandleByUUID(ref)
    return out


class GpuHealthSource:
    """Polls NVML for each slot's GPU; a GPU signals once (see the module docstring)."""

    name = "nvml"

    def __init__(self, nvml: ModuleType, handles: Mapping[int, Any], thresholds: GpuThresholds):
        self._nvml = nvml
        self._handles = dict(handles)
        self._limits = thresholds
        self._reported: set[int] = set()
        self._unsupported: set[tuple[int, str]] = set()
        self._ecc_base = {slot: self._baseline(slot) for slot in self._handles}
        self._events = nvml.nvmlEventSetCreate() if thresholds.xids else None
        self._slot_of_index: dict[int, int] = {}
        for slot, handle in self._handles.items():
            self._slot_of_index[nvml.nvmlDeviceGetIndex(handle)] = slot
            if self._events is not None:
                self._read(slot, "xid", lambda h: nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, self._events))

    def _baseline(self, slot: int) -> int | None:
        try:
            return self._read(slot, "ecc", self._ecc)
        except self._nvml.NVMLError_GpuIsLost:
            return None  # the first poll reports it

    def poll(self) -> list[NodeSignal]:
        found = {s.detail["gpu"]: s for s in self._xid_signals()}
        for slot in self._handles:
            if slot not in self._reported and slot not in found:
                signal = self._check(slot)
                if signal is not None:
                    found[slot] = signal
        self._reported |= set(found)
        return [found[slot] for slot in sorted(found)]

    # ---- the checks --------------------------------------------------------------
    def _signal(self, slot: int, sign: str, value: Any, reason: str) -> NodeSignal:
        return NodeSignal(PRE_EMPTIVE, f"GPU {slot}: {reason}", {"signal": sign, "value": value, "gpu": slot}, gpu=slot)

    def _read(self, slot: int, check: str, read: Any) -> Any:
        """``read(handle)``, or None where the GPU does not support the check (then never asked again)."""
        if (slot, check) in self._unsupported:
            return None
        try:
            return read(self._handles[slot])
        except self._nvml.NVMLError_NotSupported:
            self._unsupported.add((slot, check))
            return None

    def _ecc(self, handle: Any) -> int:
        n = self._nvml
        return int(n.nvmlDeviceGetTotalEccErrors(handle, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC))

    def _check(self, slot: int) -> NodeSignal | None:
        n = self._nvml
        try:
            ecc = self._read(slot, "ecc", self._ecc)
            base = self._ecc_base.get(slot)
            if ecc is not None and base is not None and ecc - base >= self._limits.ecc_uncorrected_increase:
                return self._signal(slot, "ecc", ecc - base, f"{ecc - base} new uncorrectable ECC error(s)")
            if self._read(slot, "retired", n.nvmlDeviceGetRetiredPagesPendingStatus) == n.NVML_FEATURE_ENABLED:
                return self._signal(slot, "retired-pages-pending", 1, "memory pages are waiting to be retired (needs a reset)")
            remap = self._read(slot, "remap", n.nvmlDeviceGetRemappedRows)
            if remap is not None and (remap[2] or remap[3]):
                sign = "row-remap-failure" if remap[3] else "row-remap-pending"
                return self._signal(slot, sign, int(remap[1]), f"{sign.replace('-', ' ')} ({remap[1]} uncorrectable rows)")
            temp = self._read(slot, "thermal", lambda h: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))
            limit = self._read(slot, "thermal", lambda h: n.nvmlDeviceGetTemperatureThreshold(h, n.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
            if temp is not None and limit is not None and temp >= limit - self._limits.thermal_margin_c:
                return self._signal(slot, "thermal", int(temp), f"{temp} C, within {self._limits.thermal_margin_c:g} C of slowdown at {limit} C")
        except n.NVMLError_GpuIsLost:
            return self._signal(slot, "gpu-lost", 1, "the GPU is lost (fell off the bus)")
        return None

    def _xid_signals(self) -> list[NodeSignal]:
        """The critical XIDs NVML queued since the last poll, one signal per GPU."""
        if self._events is None:
            return []
        n = self._nvml
        out: dict[int, NodeSignal] = {}
        while True:
            try:
                event = n.nvmlEventSetWait_v2(self._events, 0)
            except n.NVMLError_Timeout:
                return list(out.values())
            xid = int(event.eventData)
            slot = self._slot_of_index.get(n.nvmlDeviceGetIndex(event.device))
            if slot is None or slot in self._reported or slot in out or xid not in self._limits.xids:
                continue
            out[slot] = self._signal(slot, "xid", xid, f"critical XID {xid}")
