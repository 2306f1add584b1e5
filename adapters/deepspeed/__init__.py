"""DeepSpeed adapter: a ``"torchpass"`` block in the DeepSpeed config makes the job migratable.

::

    "torchpass": {"enabled": true}

in the DeepSpeed JSON config, and ``torchpass launch train.py ...``: a failed
rank's work moves to a hot spare, survivors keep their processes, and the run
ends bitwise identical to a fault-free one. ``PipelineEngine.train_batch``
loops, forward/backward/step loops over the engine's training dataloader or
the script's own, and Hugging Face's ``Trainer`` need nothing else; other loops iterate :func:`steps`. See ``docs/adapters/deepspeed.md``.

Under ``torchpass launch`` the engine hook (:func:`install`) is installed as
soon as the script imports ``deepspeed`` (:mod:`.integration`), so every
engine is checked for the block and the script needs no change;
:func:`initialize` is a drop-in ``deepspeed.initialize`` for scripts that
prefer to say so. Names are imported lazily: importing this package does not
import DeepSpeed.

Modules: :mod:`.integration` (activation under ``torchpass launch``), :mod:`.install` (the engine hook), :mod:`.config` (the block),
:mod:`.support` (what can be migrated), :mod:`.layout` (topology and process
groups), :mod:`.state` (persistent state per ZeRO stage), :mod:`.step_reset`
(undoing an interrupted step), :mod:`.migration` (the engine's protocol hooks
and state provider), :mod:`.dataloader_loop` (an unchanged loop over the engine's dataloader), :mod:`.script_loader`
(the script's own DataLoader), :mod:`.hf_trainer` (Hugging Face's Trainer), :mod:`.loop` (``steps()``), :mod:`.pipeline`
(``train_batch``).
"""

from typing import Any

__all__ = ["DeepSpeedStep", "initialize", "install", "migration_of", "steps"]

_EXPORTS = {
    "DeepSpeedStep": "loop",
    "initialize": "install",
    "install": "install",
    "migration_of": "install",
    "steps": "loop",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
