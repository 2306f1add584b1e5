"""The chaos trigger refuses to let a fault test pass with no fault injected."""

from __future__ import annotations

import threading

import pytest

from torchpass.core.chaos import chaos_trigger
from torchpass.core.config import ChaosConfig


def test_a_point_the_loop_never_reports_fails_the_step_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHPASS_STARTED_AS", "active")
    trigger = chaos_trigger(ChaosConfig(kill_rank=1, kill_step=3, kill_point="last_forward"), 1, "active", threading.Event())
    assert trigger is not None
    trigger.fire("step_start", 3)  # another point of the step: nothing happens
    trigger.check_fired(2)  # another step: nothing to say
    with pytest.raises(RuntimeError, match=r"chaos\.kill_point 'last_forward' never came in step 3 on rank 1, so no fault was injected"):
        trigger.check_fired(3)


def test_no_trigger_for_other_ranks_or_a_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHPASS_STARTED_AS", "active")
    config = ChaosConfig(kill_rank=1, kill_step=3, kill_point="commit")
    assert chaos_trigger(config, 0, "active", threading.Event()) is None
    monkeypatch.setenv("TORCHPASS_STARTED_AS", "spare")
    assert chaos_trigger(config, 1, "active", threading.Event()) is None
