"""TorchTitan's own checkpointer under live migration: spares never load, every due save happens once on every rank.

TorchTitan's ``train()`` calls ``checkpointer.load()`` once before its loop and
``checkpointer.save(step)`` after every ``train_step``; a save is a DCP
collective (plans gathered, shards written by every rank, ``.metadata``
written by the coordinator once every shard is, result broadcast). A migration
can land in it, and a spare joins with no history of the saves before it, so
:class:`Checkpoints` makes three promises:

1. *No storage read to recover.* A hot spare's ``load()`` is skipped (it
   receives its state over the network), so it never reads the job's
   checkpoint folder even when one exists.
2. *A save interrupted by a fault is executed again by every rank, the spare
   included, before the next step.* After a migration to version T every
   member (after the rebuild, :meth:`agree`, one all-reduce) decides whether
   the save of step T is still owed: it is if TorchTitan's own rule says step T
   saves (``_should_save``) and some survivor has not completed it. The rank
   that replaces a lost one says nothing: the survivors know.
3. *A completed save is never written again*, e.g. when a rollback to a buddy
   copy re-executes the steps around it, or when the trainer's ``train()``
   calls ``save(T)`` after the migration already wrote it.

Requires: synchronous saves (``checkpoint.async_mode = "disabled"``; an
asynchronous save spans steps and is refused by the trainer), and for multi-node
jobs a checkpoint folder every node sees, which DCP needs anyway.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

__all__ = ["Checkpoints"]


class Checkpoints:
    """The save/load side of TorchTitan's ``CheckpointManager`` for one rank (see the module docstring)."""

    def __init__(self, checkpointer: Any, *, last_step: int, device: torch.device, joining: bool):
        self._checkpointer = checkpointer
        self._save = checkpointer.save
        self._last_step = last_step
        self._device = device
        self._saved: set[int] = set()
        self.pending: int | None = None
        """The step whose save every rank executes before its next step, after a migration; else None."""
        if joining:
            checkpointer.load = self._spare_load

    @property
    def enabled(self) -> bool:
        return bool(self._checkpointer.enable)

    def due(self, step: int) -> bool:
        """Whether TorchTitan's checkpointer saves after ``step`` (its own interval and last-step rule)."""
        return step >= 1 and self._checkpointer._should_save(step, last_step=step == self._last_step)

    def write(self, step: int) -> None:
        """Save after ``step`` if it is due and this rank has not saved it yet (a collective when it saves)."""
        if step in self._saved or not self.due(step):
            return
        self._save(step, last_step=step == self._last_step)
        self._saved.add(step)
        if self.pending == step:
            self.pending = None

    def agree(self, target: int, *, joining: bool) -> None:
        """After a migration to version ``target``: every member learns whether the save of ``target`` is owed.

        Runs on every member of the new generation (a collective over the world).
        """
        if not self.enabled:
            return
        owed = torch.tensor([0 if joining else int(self.due(target) and target not in self._saved)], device=self._device)
        dist.all_reduce(owed, op=dist.ReduceOp.MAX)
        if owed.item():
            self.pending = target
            self._saved.discard(target)
            logger.info(f"torchpass: the checkpoint of step {target} was interrupted by the migration; every rank saves it again")
        else:
            self.pending = None
            self._saved.add(target)

    @staticmethod
    def _spare_load(step: int = -1) -> bool:
        del step
        logger.info("torchpass: hot spare: not loading a checkpoint (this rank's state arrives from a live replica)")
        return False
