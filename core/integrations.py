"""Framework integrations a worker activates before it runs the training script.

``torchpass launch`` runs an unmodified script: nothing in it imports
torchpass. A framework adapter that must hook the framework (wrap an engine
constructor, chain an argument parser) registers an *integration*, an entry
point in the group ``torchpass.integrations`` naming a callable
``activate(argv: list[str]) -> None``. The worker calls every integration with
the script's arguments after the runtime starts and before the script runs.

An integration runs in every worker, whatever the job trains with, so it must
be cheap and must not import its framework: it calls :func:`when_imported` to
hook the framework at the moment the script imports it. A hot spare's warm-up
(what the framework would compute or import on first use, done while the spare
waits) registers through :func:`when_imported_by_waiting_spare`: a module the
script imports only after the assignment must not run the warm-up then, where
it would be on the migration's critical path (measured: a Megatron-LM spare
imported ``transformers`` for its tokenizer after its assignment, and the
DeepSpeed integration's Trainer warm-up then imported ``transformers.trainer``
and DeepSpeed, 2.4 s of a 3.4 s set-up). Entry points keep the
dependency pointing from adapters to the core: the core never names an adapter.

:func:`when_imported` is a post-import hook. A finder placed first on
``sys.meta_path`` answers only for the hooked names; it takes the spec the
other finders would have returned and wraps its loader so the callbacks run
right after the module's code does, then puts the original loader back on the
module, so nothing downstream sees the wrapper.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any, Callable, Sequence

__all__ = ["GROUP", "activate_all", "is_waiting_spare", "when_imported", "when_imported_by_waiting_spare"]

GROUP = "torchpass.integrations"
"""Entry-point group of integrations: ``name = "package.module:activate"``."""

_callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once module ``name`` has been imported: now if it already is, else right after."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _callbacks.setdefault(name, []).append(callback)
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


def is_waiting_spare() -> bool:
    """Whether this process is a hot spare without a rank yet (:mod:`torchpass.core.worker` makes it active at
    its assignment)."""
    return os.environ.get("TORCHPASS_ROLE") == "spare"


def when_imported_by_waiting_spare(name: str, callback: Callable[[ModuleType], None]) -> None:
    """:func:`when_imported` for a spare's warm-up: ``callback(module)`` runs only if ``name`` is imported while
    this process is still a waiting spare (its preload), never after its assignment."""
    if not is_waiting_spare():
        return

    def warm(module: ModuleType) -> None:
        if is_waiting_spare():
            callback(module)

    when_imported(name, warm)


def activate_all(argv: Sequence[str]) -> list[str]:
    """Activate every installed integration for a script started with ``argv``; returns their names.

    An integration that fails to load or activate stops the worker with the
    integration's name: a job asking for live migration must not silently run
    without it.
    """
    names = []
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        try:
            ep.load()(list(argv))
        except Exception as exc:
            raise RuntimeError(f"torchpass integration {ep.name!r} ({ep.value}) failed to activate: {exc}") from exc
        names.append(ep.name)
    return names


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _CallbackLoader(spec.loader)
        return spec


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        for callback in _callbacks.pop(module.__name__, []):
            callback(module)
