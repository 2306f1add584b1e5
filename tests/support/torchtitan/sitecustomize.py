"""Test support for TorchTitan jobs launched by the tests: the CPU shim and the test probe.

The tests put this directory on the ``PYTHONPATH`` of the jobs they launch, so
Python imports this module at start-up in every process of the job (launcher,
workers, spares). It changes nothing unless the test asks for it:

* ``TORCHPASS_TEST_TORCHTITAN_CPU=1``: install the CPU shim (``cpu_shim.py``)
  while TorchTitan is first imported. It must act before anything imports
  torchtitan, and the product entry point stays untouched, hence an import
  hook rather than a call in the job's code. Processes that never import
  torchtitan (the launcher) pay nothing.
* ``TORCHPASS_TEST_TORCHTITAN_PROBE=1``: record progress, per-step losses and
  the final state digest (``probe.py``) for the harness.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, ContextManager

CPU_ENV = "TORCHPASS_TEST_TORCHTITAN_CPU"
PROBE_ENV = "TORCHPASS_TEST_TORCHTITAN_PROBE"


class _WrappedLoader(importlib.abc.Loader):
    """Executes a module inside ``around()``, then calls ``after(module)``."""

    def __init__(self, loader: importlib.abc.Loader, around: Callable[[], ContextManager[Any]], after: Callable[[ModuleType], None]):
        self._loader = loader
        self._around = around
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with self._around():
            self._loader.exec_module(module)
        self._after(module)


class _ImportHook(importlib.abc.MetaPathFinder):
    """Wraps the first import of one module; other imports go to the normal finders."""

    def __init__(
        self,
        name: str,
        around: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
        after: Callable[[ModuleType], None] = lambda module: None,
    ):
        self.name = name
        self._around = around
        self._after = after

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"test support: cannot find {fullname} to wrap its import")
        spec.loader = _WrappedLoader(spec.loader, self._around, self._after)
        return spec


def _install_cpu_shim() -> None:
    import cpu_shim

    sys.meta_path.insert(
        0,
        _ImportHook(
            "torchtitan.tools.utils",
            around=cpu_shim.device_override,
            after=lambda module: cpu_shim.sum_reduction_for_unit_divide_factor(),
        ),
    )


def _install_probe() -> None:
    import probe

    sys.meta_path.insert(0, _ImportHook("torchtitan.train", after=lambda module: probe.install(module.Trainer)))


if os.environ.get(CPU_ENV) == "1":
    _install_cpu_shim()
if os.environ.get(PROBE_ENV) == "1":
    _install_probe()
