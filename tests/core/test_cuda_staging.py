"""Staging of device state, on what a CPU machine can check: refusals and capture of host tensors unchanged."""

from __future__ import annotations

import pytest
import torch

from torchpass.core.cuda_staging import stage_to_host
from torchpass.core.manifest import capture


def test_staging_refuses_a_host_tensor():
    with pytest.raises(TypeError, match="tensor 0 is on cpu, not a CUDA device"):
        stage_to_host([torch.ones(2)])


def test_capture_refuses_devices_it_cannot_stage():
    with pytest.raises(TypeError, match=r"state entry 'model/w' is on meta; torchpass captures CPU and CUDA state"):
        capture({"model": {"w": torch.empty(2, device="meta")}}, {}, version=0)


def test_host_tensors_are_captured_by_reference():
    w = torch.arange(6.0)
    captured = capture({"model": {"w": w, "t": w.reshape(2, 3).t()}}, {}, version=0)
    assert captured.tensors[0].data_ptr() == w.data_ptr()
    assert captured.private == frozenset({1})  # only the non-contiguous one is a copy
