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
* ``grad_norms/rank<r>.jsonl``: the rank's gradient norm of each step, as
  TorchTitan's ``clip_grad_norm_`` returns it (the value TorchTitan logs);
* ``out/rank<r>.json`` once training ends: a SHA-256 over the rank's model
  shards, optimizer state and LR scheduler state, its PID, and what torchpass
  hooked into the trainer (``hooks``: whether it migrates, the optimizer step
  hooks, the instance overrides of the checkpointer and the dataloader), so a
  test can check that a run without migration has none of it.

With ``TORCHPASS_TEST_TORCHTITAN_KILL_IN_SAVE=<rank>:<step>`` the process of
that rank SIGKILLs itself inside TorchTitan's checkpoint save of that step,
after its own shards are written and before the save's closing collective:
a real fault in a window a signal sent from outside cannot hit reliably. Only
the process the rank started in does; a spare that takes the rank over does not.

Losses are recorded as Python floats, which JSON round-trips exactly, so
comparing them is a bitwise comparison of the float32 loss.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchpass.core.manifest import state_digest

__all__ = ["KILL_IN_SAVE_ENV", "install", "final_state"]

KILL_IN_SAVE_ENV = "TORCHPASS_TEST_TORCHTITAN_KILL_IN_SAVE"


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


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


_EXECUTING: dict[str, Any] = {}
"""The trainer whose ``train_step`` is running (one per process)."""


def _probe_grad_norm(dist_utils: Any, workdir: Path, rank: Any) -> None:
    """Record what ``dist_utils.clip_grad_norm_`` returns (``train_step`` looks it up at call time)."""
    clip = getattr(dist_utils.clip_grad_norm_, "__wrapped__", dist_utils.clip_grad_norm_)

    def probed_clip(*args: Any, **kwargs: Any) -> torch.Tensor:
        norm = clip(*args, **kwargs)
        step = _EXECUTING["trainer"].step
        _append(workdir / "grad_norms" / f"rank{rank()}.jsonl", {"step": step, "grad_norm": _local(norm).item()})
        return norm

    probed_clip.__wrapped__ = clip  # type: ignore[attr-defined]
    dist_utils.clip_grad_norm_ = probed_clip


def _kill_in_save(rank: Any) -> None:
    """SIGKILL this process inside the DCP save of the step ``KILL_IN_SAVE_ENV`` names, after its shards are written."""
    from torch.distributed.checkpoint import FileSystemWriter  # what dcp.save writes a folder with

    target_rank, target_step = map(int, os.environ[KILL_IN_SAVE_ENV].split(":"))
    write_data = FileSystemWriter.write_data

    def killing_write_data(self: Any, plan: Any, planner: Any) -> Any:
        result = write_data(self, plan, planner)
        # Read at save time: a hot spare installs the probe before it has a rank.
        started_active = os.environ.get("TORCHPASS_STARTED_AS", "active") == "active"
        if started_active and rank() == target_rank and Path(str(self.path)).name == f"step-{target_step}":
            print(f"[probe] SIGKILL rank {target_rank} inside the checkpoint save of step {target_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    FileSystemWriter.write_data = killing_write_data  # type: ignore[method-assign]


def _hooks(trainer: Any) -> dict[str, Any]:
    opt = trainer.optimizers
    return {
        "migration": getattr(trainer, "_migration", None) is not None,
        "optimizer_step_hooks": len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks),
        "overrides": sorted(
            f"{name}.{attr}"
            for name, obj in (("checkpointer", trainer.checkpointer), ("dataloader", trainer.dataloader))
            for attr in ("save", "load", "state_dict")
            if attr in vars(obj)
        ),
    }


def install(trainer_class: type) -> None:
    """Wrap ``train_step``, ``forward_backward_step`` and ``train`` of TorchTitan's ``Trainer``."""
    import sys

    workdir = Path.cwd()
    for name in ("progress", "losses", "grad_norms", "out"):
        (workdir / name).mkdir(exist_ok=True)

    train_step, forward_backward_step, train = (
        trainer_class.train_step,
        trainer_class.forward_backward_step,
        trainer_class.train,
    )

    def rank() -> int:
        return int(os.environ["RANK"])

    _probe_grad_norm(sys.modules[trainer_class.__module__].dist_utils, workdir, rank)
    if os.environ.get(KILL_IN_SAVE_ENV):
        _kill_in_save(rank)

    def probed_train_step(self: Any, data_iterator: Any) -> Any:
        _EXECUTING["trainer"] = self
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
        _append(workdir / "losses" / f"rank{rank()}.jsonl", record)
        return loss

    def probed_train(self: Any) -> Any:
        result = train(self)
        out = {"digest": state_digest(final_state(self)), "pid": os.getpid(), "steps": self.step, "hooks": _hooks(self)}
        (workdir / "out" / f"rank{rank()}.json").write_text(json.dumps(out))
        return result

    trainer_class.train_step = probed_train_step
    trainer_class.forward_backward_step = probed_forward_backward_step
    trainer_class.train = probed_train
