"""Hooks into Megatron-LM (``megatron.training``, not on PyPI) for an unmodified ``pretrain_gpt.py``.

:func:`install_megatron_lm_hooks` does two things when ``megatron.training`` is importable:

1. Chains :func:`~.flags.add_torchpass_args` into Megatron-LM's argument
   parsing by wrapping ``megatron.training.arguments.add_megatron_arguments``.
   Every parse path calls that function through its module global
   (``parse_args`` in core_v0.16/0.17, reached from ``pretrain(...,
   extra_args_provider=...)``; ``parse_and_validate_args(extra_args_provider=...)``
   from core_v0.18 on), before the script's own ``extra_args_provider``, so the
   script's flags keep working and ``--torchpass`` is accepted everywhere.
   Patching ``parse_args`` instead would miss core_v0.16's
   ``megatron.training.initialize``, which bound the name at import.
2. Guards against an unprotected run: Megatron-LM's own ``train()`` loop is
   not made migratable by this release (it runs on CUDA with NCCL; torchpass
   rebuilds gloo groups and moves CPU state), so ``train_step`` (called by
   ``train()`` through its module global) raises a clear error when
   ``--torchpass`` was given instead of training without live migration.

``torchpass launch`` calls this when the script imports ``megatron.training``
and was given ``--torchpass`` (:mod:`.integration`). A script can also pass the provider itself: ``pretrain(...,
extra_args_provider=add_torchpass_args)``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType
from typing import Any, Callable

from .flags import add_torchpass_args

__all__ = ["MEGATRON_LM_UNSUPPORTED", "install_megatron_lm_hooks"]

MEGATRON_LM_UNSUPPORTED = (
    "torchpass: --torchpass cannot protect Megatron-LM's own training loop (megatron.training.train) in this "
    "release: it trains on CUDA with NCCL, and torchpass rebuilds gloo process groups and moves CPU state only. "
    "Drop --torchpass, or train through a megatron-core loop with torchpass.adapters.megatron.MegatronRun "
    "(docs/adapters/megatron.md)."
)

_HOOKED = "__torchpass_hooked__"


def _hook(module: ModuleType, name: str, make: Callable[[Any], Any]) -> None:
    original = getattr(module, name)
    if getattr(original, _HOOKED, False):
        return
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _HOOKED, True)
    setattr(module, name, wrapper)


def install_megatron_lm_hooks() -> bool:
    """Hook Megatron-LM's argument parsing and training step; False when ``megatron.training`` is absent.

    Idempotent; call it before the script parses its arguments.
    """
    if importlib.util.find_spec("megatron.training") is None:
        return False  # megatron-core alone: nothing to hook
    arguments = importlib.import_module("megatron.training.arguments")
    training = importlib.import_module("megatron.training.training")
    state = importlib.import_module("megatron.training")

    def with_torchpass_args(add_megatron_arguments: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def add_arguments(parser: Any) -> Any:
            return add_torchpass_args(add_megatron_arguments(parser))

        return add_arguments

    def refusing_torchpass(train_step: Callable[..., Any]) -> Callable[..., Any]:
        def guarded_train_step(*args: Any, **kwargs: Any) -> Any:
            if getattr(state.get_args(), "torchpass", False):
                raise RuntimeError(MEGATRON_LM_UNSUPPORTED)
            return train_step(*args, **kwargs)

        return guarded_train_step

    _hook(arguments, "add_megatron_arguments", with_torchpass_args)
    _hook(training, "train_step", refusing_torchpass)
    return True
