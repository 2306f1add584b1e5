"""NVML's signs of a failing GPU, read through the NVML-shaped stand-in (tests/support/nvml_shaped/pynvml.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from torchpass.core.config import CRITICAL_XIDS, parse_xids
from torchpass.core.gpu_health import PRE_EMPTIVE, GpuHealthSource, GpuThresholds, gpu_handles

SHAPED = Path(__file__).resolve().parents[1] / "support" / "nvml_shaped" / "pynvml.py"
LIMITS = GpuThresholds(ecc_uncorrected_increase=1, thermal_margin_c=5.0, xids=parse_xids(CRITICAL_XIDS))


def _healthy() -> dict:
    return {"ecc": 3, "retired_pending": False, "remap": [0, 0, False, False], "temp": 40, "slowdown": 90, "lost": False, "xids": []}


class Gpus:
    """The stand-in's state file, as a test edits it."""

    def __init__(self, path: Path, n: int) -> None:
        self.path = path
        self.gpus = [_healthy() for _ in range(n)]
        self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps({"gpus": self.gpus}))

    def set(self, index: int, **changes) -> None:
        self.gpus[index].update(changes)
        self.write()


@pytest.fixture
def nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, Gpus]:
    gpus = Gpus(tmp_path / "nvml.json", 4)
    monkeypatch.setenv("TORCHPASS_TEST_NVML_STATE", str(gpus.path))
    spec = importlib.util.spec_from_file_location("nvml_shaped", SHAPED)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "nvml_shaped", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    module.nvmlInit()
    return module, gpus


def _source(module: ModuleType, slots: int = 4, limits: GpuThresholds = LIMITS) -> GpuHealthSource:
    return GpuHealthSource(module, gpu_handles(module, slots, environ={}), limits)


@pytest.mark.parametrize(
    ("change", "sign", "value"),
    [
        ({"ecc": 4}, "ecc", 1),
        ({"retired_pending": True}, "retired-pages-pending", 1),
        ({"remap": [0, 2, True, False]}, "row-remap-pending", 2),
        ({"remap": [0, 5, False, True]}, "row-remap-failure", 5),
        ({"temp": 86}, "thermal", 86),
        ({"lost": True}, "gpu-lost", 1),
        ({"xids": [79]}, "xid", 79),
    ],
)
def test_each_sign_past_its_threshold_is_one_signal_for_that_gpu(nvml, change, sign, value) -> None:
    module, gpus = nvml
    source = _source(module)
    assert source.poll() == []
    gpus.set(2, **change)
    (found,) = source.poll()
    assert (found.cause, found.gpu, found.detail) == (PRE_EMPTIVE, 2, {"signal": sign, "value": value, "gpu": 2})
    assert found.reason.startswith("GPU 2: ")
    assert source.poll() == []  # reported once; the other GPUs are still watched
    gpus.set(0, ecc=9)
    assert [s.gpu for s in source.poll()] == [0]


def test_below_the_thresholds_nothing_is_signalled(nvml) -> None:
    module, gpus = nvml
    source = _source(module, limits=GpuThresholds(ecc_uncorrected_increase=3, thermal_margin_c=5.0, xids=frozenset({79})))
    gpus.set(1, ecc=5, temp=84, xids=[13, 43])  # +2 errors; 6 C from slowdown; application XIDs
    assert source.poll() == []


def test_a_check_a_gpu_lacks_is_skipped_and_the_others_still_run(nvml) -> None:
    module, gpus = nvml
    gpus.set(3, unsupported=["ecc", "remap", "xid"])
    source = _source(module)
    gpus.set(3, ecc=100, remap=[0, 1, True, False])
    assert source.poll() == []
    gpus.set(3, temp=89)
    assert [s.detail["signal"] for s in source.poll()] == ["thermal"]


def test_slots_follow_cuda_visible_devices(nvml) -> None:
    module, gpus = nvml
    handles = gpu_handles(module, 3, environ={"CUDA_VISIBLE_DEVICES": "3,GPU-shaped-1"})
    assert {slot: module.nvmlDeviceGetIndex(h) for slot, h in handles.items()} == {0: 3, 1: 1}
    source = GpuHealthSource(module, handles, LIMITS)
    gpus.set(3, ecc=4)
    assert [s.gpu for s in source.poll()] == [0]  # NVML's GPU 3 is slot 0's
