"""Finding the script's own training DataLoader, so DeepSpeed's Getting Started loop is migratable unchanged.

DeepSpeed's Getting Started page trains over a loader the script built::

    for step, batch in enumerate(data_loader):
        loss = model_engine(batch)
        model_engine.backward(loss)
        model_engine.step()

When the migratable engine has no training dataloader of its own, the
adapter hooks ``__iter__`` of torch's ``DataLoader`` (and of torchdata's
``StatefulDataLoader``, which has its own) for the process, and routes each
new pass:

* the **training loader** is the first loader whose pass starts while the
  engine trains (its module in training mode, autograd on). The loop
  (:class:`~.dataloader_loop.EngineLoaderLoop`) adopts it and, from then on,
  every pass over it is a :class:`~.dataloader_loop.GuardedPass`: the loop
  owns the step boundaries through it exactly as through the engine's own
  loader, replays an interrupted step's micro-batches, and positions a
  spare's first pass where the job stands without loading the batches before
  it (``core/dataloader_position.py``);
* a pass over **another loader started while the engine trains** is refused
  with an error: two loaders feeding the steps (``zip(a, b)``) cannot be
  replayed from one, and an evaluation belongs under ``engine.eval()`` or
  ``torch.no_grad()``, where any loader passes through untouched;
* a loader whose class overrides ``__iter__`` and reaches ``DataLoader``'s
  through ``super()`` (accelerate's ``DataLoaderShard``, which reads a batch
  ahead of the one it hands out) is never adopted: its draws do not mark the
  step boundaries. The engine then refuses its first optimizer step with the
  ways out (``OUTSIDE_STEP``).

Until a migratable engine without a loader is built, and once a ``steps()``
loop drives the engine, every pass is the class's own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from torchpass.core.dataloader_position import open_at
from torchpass.core.integrations import when_imported

from .dataloader_loop import EngineLoaderLoop, GuardedPass

__all__ = ["watch_script_loaders"]

_Iter = Callable[[Any], Iterator[Any]]
_loop: EngineLoaderLoop | None = None
_HOOKED = "_torchpass_pass_hook"


class _ScriptPasses:
    """Passes of the script's loader through its class's own ``__iter__``; a pass can open at any batch."""

    def __init__(self, loader: Any, start: _Iter):
        self._loader = loader
        self._start = start

    def __iter__(self) -> Iterator[Any]:
        return self._start(self._loader)

    def open_at(self, skip: int) -> Iterator[Any]:
        return open_at(self._loader, skip, self._start)


def _route(loader: Any, cls: type, original: _Iter) -> Iterator[Any]:
    loop = _loop
    if loop is None or loop.delegating:
        return original(loader)
    if loop.loader is loader:
        loop.passes_started += 1
        return GuardedPass(loop)
    if not loop.trains:
        return original(loader)
    if loop.loader is None and type(loader).__iter__ is cls.__iter__:
        loop.adopt(loader, _ScriptPasses(loader, original))
        print(
            f"[torchpass] rank {loop.runtime.rank}: the training loop's data loader is a {type(loader).__name__} "
            f"of {len(loader)} batches: its passes mark the steps",
            file=sys.stderr,
            flush=True,
        )
        loop.passes_started += 1
        return GuardedPass(loop)
    if loop.loader is not None:
        raise RuntimeError(
            f"torchpass: a second data loader ({type(loader).__name__}) started a pass while the engine trains "
            f"(module in training mode, autograd on); the steps are drawn from the first one "
            f"({type(loop.loader).__name__}), and a step executed again replays that one only. Evaluate under "
            "engine.eval() or torch.no_grad(), or drive a loop over several sources with "
            "torchpass.adapters.deepspeed.steps(engine, num_steps, data=...)"
        )
    return original(loader)


def _hook(cls: type) -> None:
    """Route every new pass of ``cls`` (and of subclasses that inherit its ``__iter__``) through :func:`_route`."""
    original = cls.__dict__["__iter__"]
    if getattr(original, _HOOKED, False):
        return

    def __iter__(self: Any) -> Iterator[Any]:
        return _route(self, cls, original)

    setattr(__iter__, _HOOKED, True)
    __iter__.__doc__ = original.__doc__
    cls.__iter__ = __iter__  # type: ignore[method-assign]


def watch_script_loaders(loop: EngineLoaderLoop) -> None:
    """Let ``loop`` adopt the first DataLoader whose pass starts while its engine trains (see the module docstring)."""
    global _loop
    _loop = loop
    _hook(DataLoader)
    when_imported("torchdata.stateful_dataloader", lambda module: _hook(module.StatefulDataLoader))
