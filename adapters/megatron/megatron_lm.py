"""Hooks into Megatron-LM (``megatron.training``) for an unmodified ``pretrain_gpt.py``.

:func:`install_megatron_lm_hooks`, when ``megatron.training`` is importable:

1. chains :func:`~.flags.add_torchpass_args` into Megatron-LM's argument
   parsing by wrapping ``megatron.training.arguments.add_megatron_arguments``.
   Every parse path calls that function through its module global
   (``parse_args`` in core_v0.16/0.17, reached from ``pretrain(...,
   extra_args_provider=...)`` and from ``inprocess_restart``;
   ``parse_and_validate_args(extra_args_provider=...)`` from core_v0.18 on),
   before the script's own ``extra_args_provider``, so the script's flags keep
   working and ``--torchpass`` is accepted everywhere. Patching ``parse_args``
   instead would miss ``megatron.training.initialize``, which bound the name at import;
2. makes Megatron-LM's own loop migratable (:mod:`.megatron_lm_loop`) by
   wrapping the functions ``pretrain()`` and ``train()`` call through the globals
   of ``megatron.training.training``: ``setup_model_and_optimizer``, ``train``,
   ``train_step``, and the ones ``train()`` runs between iterations;
3. refuses ``--inprocess-restart`` together with ``--torchpass`` where
   ``inprocess_restart.maybe_wrap_for_inprocess_restart`` would wrap
   ``pretrain`` (before anything is set up).

Nothing changes for a run without ``--torchpass``: every wrapper then calls
through. ``torchpass launch`` calls this when the script was given
``--torchpass`` and imports ``megatron.training`` (:mod:`.integration`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType
from typing import Any, Callable

from .flags import add_torchpass_args

__all__ = ["install_megatron_lm_hooks"]

_HOOKED = "__torchpass_hooked__"

_BETWEEN_ITERATIONS: dict[str, tuple[Callable[[tuple[Any, ...]], Any], bool]] = {
    # name: (what it returns when cut short or skipped, whether a cut-short iteration skips it)
    "training_log": (lambda args: args[5], False),  # report_memory_flag, as given
    "post_training_step_callbacks": (lambda args: args[5], False),  # FLOPs since the last log, as given
    "checkpoint_and_decide_exit": (lambda args: False, False),  # keep training
    "evaluate_and_print_results": (lambda args: None, True),
    "save_checkpoint_and_time": (lambda args: None, True),  # never a checkpoint without the lost rank's part
}
"""Functions Megatron-LM's ``train()`` calls between iterations that may run collectives."""


def _hook(module: ModuleType, name: str, make: Callable[[Any], Any]) -> None:
    original = getattr(module, name)
    if getattr(original, _HOOKED, False):
        return
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _HOOKED, True)
    setattr(module, name, wrapper)


def install_megatron_lm_hooks() -> bool:
    """Hook Megatron-LM's argument parsing and training loop; False when ``megatron.training`` is absent.

    Idempotent; call it before the script parses its arguments.
    """
    if importlib.util.find_spec("megatron.training") is None:
        return False  # megatron-core alone: nothing to hook
    arguments = importlib.import_module("megatron.training.arguments")

    def with_torchpass_args(add_megatron_arguments: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def add_arguments(parser: Any) -> Any:
            return add_torchpass_args(add_megatron_arguments(parser))

        return add_arguments

    _hook(arguments, "add_megatron_arguments", with_torchpass_args)
    _hook_inprocess_restart()
    _hook_training_loop()
    return True


def _hook_inprocess_restart() -> None:
    if importlib.util.find_spec("megatron.training.inprocess_restart") is None:
        return
    inprocess = importlib.import_module("megatron.training.inprocess_restart")

    def refusing(inprocess_restart: Callable[..., Any]) -> Callable[..., Any]:
        def wrap_pretrain(pretrain: Any, args: Any) -> Any:
            if getattr(args, "torchpass", False):
                from .megatron_lm_loop import refuse_unsupported

                refuse_unsupported(args)
            return inprocess_restart(pretrain, args)

        return wrap_pretrain

    _hook(inprocess, "inprocess_restart", refusing)


def _hook_training_loop() -> None:
    training = importlib.import_module("megatron.training.training")
    from .megatron_lm_loop import MegatronLMLoop

    loop = MegatronLMLoop()

    def through(method: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return method(original, *args, **kwargs)

            return wrapper

        return make

    _hook(training, "setup_model_and_optimizer", through(loop.setup))
    _hook(training, "train", through(loop.train))
    _hook(training, "train_step", through(loop.train_step))
    for name, (returns, skip_when_held) in _BETWEEN_ITERATIONS.items():
        if hasattr(training, name):
            _hook(training, name, lambda original, name=name, returns=returns, skip=skip_when_held: loop.between_iterations(
                name, original, returns, skip_when_held=skip
            ))
