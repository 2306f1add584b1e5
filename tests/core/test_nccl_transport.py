"""NCCL settings a worker gets, and the warning for a watchdog setting that would kill survivors."""

from __future__ import annotations

from torchpass.core import nccl_transport


def test_workers_get_error_handling_off_unless_the_user_chose():
    assert nccl_transport.worker_environment({}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    assert nccl_transport.worker_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}) == {}


def test_a_watchdog_that_terminates_survivors_is_named():
    assert nccl_transport.check_environment({}) is None
    assert nccl_transport.check_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}) is None
    assert nccl_transport.check_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}) is None
    for value in ("1", "3"):
        warning = nccl_transport.check_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": value})
        assert warning is not None
        assert f"TORCH_NCCL_ASYNC_ERROR_HANDLING={value}" in warning and "set 0 or 2" in warning


def test_aborting_nothing_is_a_no_op():
    nccl_transport.abort_together([])
