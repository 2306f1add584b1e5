"""The DeepSpeed integration ``torchpass launch`` activates in every worker.

It imports nothing from DeepSpeed: when (and only when) the script imports
``deepspeed``, the adapter is imported and :func:`~.install.install` hooks
``DeepSpeedEngine``, so an unmodified script's engines are checked for the
``"torchpass"`` block. A hot spare also imports, while it waits, the modules
``deepspeed.initialize`` would import on first use (:data:`INITIALIZE_IMPORTS`),
so building its engine after an assignment does not wait for them. When the
script imports ``transformers.trainer``, the Trainer's loop is hooked too
(:mod:`.hf_trainer`): a Trainer whose DeepSpeed engine is migratable owns its
steps through it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from types import ModuleType

from torchpass.core.integrations import when_imported, when_imported_by_waiting_spare

__all__ = ["activate", "INITIALIZE_IMPORTS", "TRAINER_IMPORTS"]

INITIALIZE_IMPORTS = (
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "deepspeed.module_inject.auto_ep_layer",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.superoffload",
)
"""Modules DeepSpeed 0.19.8's ``initialize`` imports lazily. Measured on a fresh process with
``deepspeed`` imported: ``initialize`` of a ZeRO-1 engine took 3.1 s on a loaded 2-core machine
(9.6 s cold), almost all of it importing these (the Muon optimizer's module, imported by the ZeRO
optimizer check, compiles at import and pulls in ``torch._inductor``); with them imported, 0.14 s.
A module a DeepSpeed version lacks is skipped."""


def _install(_: ModuleType) -> None:
    from .install import install

    install()


def _warm(_: ModuleType) -> None:
    for name in INITIALIZE_IMPORTS:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:  # a parent package this DeepSpeed version does not have: nothing to warm
            spec = None
        if spec is not None:
            importlib.import_module(name)
    _probe_ops()


def _probe_ops() -> None:
    """Run now what ``deepspeed.init_distributed`` computes on its first call in a process.

    Its backend probes which DeepSpeed ops this machine can build (``deepspeed.ops.__compatible_ops__``,
    computed on first access and kept in the module: compiler test programs among them) and loads the
    shared-memory communication op of the CPU accelerator (kept in DeepSpeed's op cache). Measured on the
    2-core machine: 55 ms and 11 ms, a third of a ZeRO-3 spare's set-up after its assignment otherwise.
    """
    ops = importlib.import_module("deepspeed.ops")
    getattr(ops, "__compatible_ops__")  # the lazy probe: computed and cached by this access
    backend = importlib.import_module("deepspeed.comm.torch")
    if hasattr(backend, "build_shm_op"):
        backend.build_shm_op()


TRAINER_IMPORTS = ("transformers.trainer", "deepspeed")
"""What a hot spare of a script importing ``transformers`` imports while it waits: ``transformers`` imports its
Trainer lazily, and the Trainer imports DeepSpeed only once its arguments name a DeepSpeed config. Measured on
the 2-core machine: a Trainer spare's set-up after its assignment took 4.7 s without them."""


def _warm_trainer(_: ModuleType) -> None:
    for name in TRAINER_IMPORTS:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)


def _hook_trainer(module: ModuleType) -> None:
    from .hf_trainer import hook_trainer

    hook_trainer(module)


def activate(argv: Sequence[str]) -> None:
    """Hook DeepSpeed's engine as soon as the script imports ``deepspeed`` (in a hot spare, warm it too), and
    Hugging Face's Trainer as soon as it imports ``transformers.trainer``."""
    when_imported("deepspeed", _install)
    when_imported("transformers.trainer", _hook_trainer)
    when_imported_by_waiting_spare("deepspeed", _warm)
    when_imported_by_waiting_spare("transformers", _warm_trainer)
