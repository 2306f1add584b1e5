"""Unit tests of the error classification the worker and its agent share."""

from __future__ import annotations

import pytest

from torchpass.core import agent, failures, runtime


@pytest.mark.parametrize(
    "message",
    [
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4711",
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation to complete",
        "Socket Timeout",
        "NCCL communicator was aborted on rank 3",
    ],
)
def test_a_lost_peer_or_transport_is_a_comm_error(message: str) -> None:
    assert failures.is_comm_error(message)


@pytest.mark.parametrize("message", ["mat1 and mat2 shapes cannot be multiplied (8x16 and 32x1)", "KeyError: 'input_ids'"])
def test_a_script_bug_is_not(message: str) -> None:
    assert not failures.is_comm_error(message)


def test_the_worker_and_its_agent_classify_with_the_same_definition() -> None:
    # A worker dying of an uncaught gloo timeout was once a script bug to the agent and a comm failure to the runtime.
    assert agent.is_comm_error is runtime.is_comm_error is failures.is_comm_error


@pytest.mark.parametrize(
    "message",
    [
        "torch.AcceleratorError: CUDA error: uncorrectable ECC error encountered",
        "RuntimeError: CUDA error: GPU has fallen off the bus",
        "CUDA error: uncorrectable NVLink error detected during the execution",
    ],
)
def test_a_failing_gpu_is_a_device_failure_a_spare_does_not_repeat(message: str) -> None:
    assert failures.is_device_failure(message)


@pytest.mark.parametrize(
    "message",
    ["CUDA error: device-side assert triggered", "CUDA error: an illegal memory access was encountered", "CUDA out of memory."],
)
def test_the_scripts_own_cuda_errors_are_not(message: str) -> None:
    assert not failures.is_device_failure(message)
