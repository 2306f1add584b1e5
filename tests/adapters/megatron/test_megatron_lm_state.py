"""Which of Megatron-LM's ``args`` counters a loaded state sets: a joining spare's, never a survivor's.

Megatron-LM's ``train()`` counts each iteration in ``args`` as its ``train_step`` returns. A survivor
rolled back to an earlier step runs the iteration ``train()`` counted already again beneath it, so
its ``args`` must keep what ``train()`` counted; a spare's ``train()`` starts from what it loaded.
"""

from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch
from megatron.core import num_microbatches_calculator as microbatches

from torchpass.adapters.megatron.layout import DEFAULT_ORDER
from torchpass.adapters.megatron.megatron_lm_loop import MegatronLMState
from torchpass.adapters.megatron.state import Progress

GLOBAL_BATCH = 8


@pytest.fixture
def calculator() -> Iterator[None]:
    microbatches.init_num_microbatches_calculator(0, None, GLOBAL_BATCH, 1, GLOBAL_BATCH)
    yield
    microbatches.destroy_num_microbatches_calculator()


def _counted_by_train(iterations: int) -> SimpleNamespace:
    """``args`` as Megatron-LM's train() leaves them after ``iterations`` iterations."""
    return SimpleNamespace(
        iteration=iterations,
        consumed_train_samples=iterations * GLOBAL_BATCH,
        skipped_train_samples=0,
        consumed_valid_samples=0,
        num_floating_point_operations_so_far=float(iterations),
    )


def _state(args: SimpleNamespace) -> MegatronLMState:
    model = torch.nn.Linear(2, 2)
    return MegatronLMState(
        args=args,
        model=[model],
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        scheduler=None,
        progress=Progress(args.iteration, args.consumed_train_samples),
        order=DEFAULT_ORDER,
    )


def _saved_at(iteration: int) -> dict:
    return {"progress": asdict(Progress(iteration, iteration * GLOBAL_BATCH, floating_point_operations=float(iteration)))}


def test_a_survivor_rolled_back_keeps_the_counters_its_train_counted(calculator: None) -> None:
    """Failed in iteration 6 with the lost rank's copy of 5 gone: the rank goes back to the end of 4 and runs
    5 again beneath train(), which counted 5 already; 6 is then counted by train() as it returns."""
    args = _counted_by_train(5)
    state = _state(args)
    state.load_components(_saved_at(4), joining=False)
    assert state.progress.iteration == 4
    assert vars(args) == vars(_counted_by_train(5))


def test_a_joining_spare_starts_its_train_at_the_loaded_counters(calculator: None) -> None:
    args = _counted_by_train(0)
    state = _state(args)
    state.load_components(_saved_at(4), joining=True)
    assert vars(args) == vars(_counted_by_train(4))
