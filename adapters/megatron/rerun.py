"""Megatron-LM's rerun state machine, as a step executed again and a spare need it.

Megatron-LM's ``train_step`` runs its forward-backward inside
``while rerun_state_machine.should_run_forward_backward(data_iterator)``: the
first call of an iteration saves the RNG streams, empties the
``RerunDataIterator``'s cache and moves the machine to its initial run; the
call after the forward-backward decides whether to run it again. A failure in
between leaves the machine mid-iteration, and ``train_step`` called again would
skip the forward-backward and step the optimizer on zero gradients. So:

* :func:`snapshot` at each step start and :func:`restore` when the step is
  executed again put the machine back where the iteration began;
* :func:`completed` moves a restored machine past the iteration when the step
  completed without this rank (its state came from a replica);
* :func:`persistent` / :func:`load_persistent` carry what the machine keeps
  across iterations per rank (whether the first iteration completed, the spiky-
  loss statistics, the fault injector's counters) to a spare; its iteration
  counter is set by ``train()`` itself from ``args.iteration``.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from megatron.core.rerun_state_machine import RerunDiagnostic, RerunState, get_rerun_state_machine

__all__ = ["completed", "load_persistent", "persistent", "restore", "snapshot"]

_CALLBACKS = ("state_save_func", "state_restore_func")
"""Attributes that are code, not state (set once, at initialization)."""

_PERSISTENT = ("first_iteration_complete", "large_value_counts", "max_values")
"""Per-rank state the machine carries from one iteration to the next."""


def snapshot() -> dict[str, Any]:
    """A copy of the machine's state (a few KB: flags, counters and the RNG streams of its last save)."""
    machine = get_rerun_state_machine()
    return {name: copy.deepcopy(value) for name, value in vars(machine).items() if name not in _CALLBACKS}


def restore(saved: Mapping[str, Any]) -> None:
    """Put the machine back as :func:`snapshot` saw it."""
    machine = get_rerun_state_machine()
    for name, value in saved.items():
        setattr(machine, name, copy.deepcopy(value))


def completed() -> None:
    """Move a machine restored to an iteration's start past that iteration, as running it would have."""
    machine = get_rerun_state_machine()
    machine.state = RerunState.NOT_RUNNING_YET
    machine.current_iteration += 1
    machine.first_iteration_complete = True


def persistent() -> dict[str, Any]:
    """The machine's per-rank state that lasts across iterations, in plain values (it travels between processes)."""
    machine = get_rerun_state_machine()
    injector = {
        name: value.value if isinstance(value, RerunDiagnostic) else value
        for name, value in machine.error_injector.state_dict().items()
    }
    return {name: copy.deepcopy(getattr(machine, name)) for name in _PERSISTENT} | {"error_injector": injector}


def load_persistent(state: Mapping[str, Any]) -> None:
    machine = get_rerun_state_machine()
    for name in _PERSISTENT:
        setattr(machine, name, copy.deepcopy(state[name]))
    injector = {name: _diagnostic(name, value) for name, value in state["error_injector"].items()}
    machine.error_injector.load_state_dict(injector)


def _diagnostic(name: str, value: Any) -> Any:
    return RerunDiagnostic(value) if name.endswith("_type") and value is not None else value
