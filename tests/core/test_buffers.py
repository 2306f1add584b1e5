"""ModuleBuffers: which buffers are per-rank state, and copies that do not alias the live ones."""

from __future__ import annotations

import pytest
import torch

from torchpass.core.buffers import ModuleBuffers


def _net() -> torch.nn.Module:
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    net.register_buffer("mask", torch.ones(3), persistent=False)
    return net


def test_persistent_buffers_by_state_dict_key() -> None:
    net = _net()
    buffers = ModuleBuffers(net)
    assert buffers.names() == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert buffers.names() <= set(net.state_dict())


def test_a_copy_does_not_follow_the_next_forward() -> None:
    net = _net().train()
    buffers = ModuleBuffers(net)
    before = buffers.copy()
    net(torch.randn(5, 4))
    assert not torch.equal(before["1.running_mean"], net[1].running_mean)
    buffers.load(before)
    assert torch.equal(before["1.running_mean"], net[1].running_mean)
    assert int(net[1].num_batches_tracked) == 0


def test_a_load_missing_a_buffer_changes_nothing() -> None:
    net = _net()
    buffers = ModuleBuffers(net)
    state = buffers.copy()
    state["1.running_mean"] = torch.full((8,), 7.0)
    del state["1.running_var"]
    with pytest.raises(KeyError, match="running_var"):
        buffers.load(state)
    assert torch.equal(net[1].running_mean, torch.zeros(8))
