"""What the end-to-end tests observe inside a TorchTitan job, written in the harness's layout.

Installed into ``torchtitan.train.Trainer`` when the test sets
``TORCHPASS_TEST_TORCHTITAN_PROBE=1`` (see ``sitecustomize.py``); files go
under the job's working directory:

* ``progress/rank<r>``: the step the rank is executing, at each ``train_step``
  call (re-executions included), for the harness to time faults;
* ``losses/rank<r>.jsonl``: the rank's loss of each step, appended as soon as
  the backward returns, before the optimizer step, so the curve of a process
  killed later in the step survives it, with the wall-clock time and the
  process's CPU time (all threads) then: the benchmark's step clocks. The test jobs run one microbatch per step (no
  gradient accumulation), so this is one line per step execution;
* ``out/rank<r>.json`` once training ends: a SHA-256 over the rank's model
  shards, optimizer state and LR scheduler state, and its PID.

Losses are recorded as Python floats, which JSON round-trips exactly, so
comparing them is a bitwise comparison of the float32 loss.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchpass.core.manifest import state_digest

__all__ = ["install", "final_state"]


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def final_state(trainer: Any) -> dict[str, Any]:
    """The rank's model shards, inner optimizers' state and LR scheduler state, as plain tensors."""
    model = {f"{i}/{k}": _local(v) for i, part in enumerate(trainer.model_parts) for k, v in part.state_dict().items()}
    optimizers = []
    for opt in trainer.optimizers.optimizers:
        sd = opt.state_dict()
        state = {i: {k: _local(v) for k, v in s.items()} for i, s in sd["state"].items()}
        optimizers.append({"state": state, "param_groups": sd["param_groups"]})
    return {"model": model, "optimizer": optimizers, "lr_scheduler": trainer.lr_schedulers.state_dict()}


def install(trainer_class: type) -> None:
    """Wrap ``train_step``, ``forward_backward_step`` and ``train`` of TorchTitan's ``Trainer``."""
    workdir = Path.cwd()
    for name in ("progress", "losses", "out"):
        (workdir / name).mkdir(exist_ok=True)
    train_step, forward_backward_step, train = (
        trainer_class.train_step,
        trainer_class.forward_backward_step,
        trainer_class.train,
    )

    def rank() -> int:
        return int(os.environ["RANK"])

    def probed_train_step(self: Any, data_iterator: Any) -> Any:
        (workdir / "progress" / f"rank{rank()}").write_text(str(self.step))
        return train_step(self, data_iterator)

    def probed_forward_backward_step(self: Any, **kwargs: Any) -> torch.Tensor:
        loss = forward_backward_step(self, **kwargs)
        # Under loss parallel (TP) the loss is a replicated DTensor: its local value is the loss.
        record = {
            "step": self.step,
            "loss": _local(loss.detach()).item(),
            "pid": os.getpid(),
            "t": time.time(),
            "cpu": time.process_time(),
        }
        with open(workdir / "losses" / f"rank{rank()}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        return loss

    def probed_train(self: Any) -> Any:
        result = train(self)
        out = {"digest": state_digest(final_state(self)), "pid": os.getpid(), "steps": self.step}
        (workdir / "out" / f"rank{rank()}.json").write_text(json.dumps(out))
        return result

    trainer_class.train_step = probed_train_step
    trainer_class.forward_backward_step = probed_forward_backward_step
    trainer_class.train = probed_train
