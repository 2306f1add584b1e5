"""Turning the adapter on: every DeepSpeed engine built in the process is checked for a ``"torchpass"`` block.

:func:`install` wraps ``DeepSpeedEngine.__init__`` (once per process), which
every engine class runs, whether the script calls ``deepspeed.initialize`` or
builds an engine itself. When an engine's constructor returns, its config
decides:

* the block is validated whenever it exists, with or without ``torchpass
  launch``, so a misspelled key fails before training;
* without ``torchpass launch``, or without the block, or with ``"enabled":
  false``, the engine is left exactly as DeepSpeed built it;
* otherwise the engine is checked (:mod:`.support`), the block becomes the
  runtime's config, and the engine instance is hooked
  (:class:`~.migration.EngineMigration`, plus :class:`~.pipeline.TrainBatchGuard`
  for a ``PipelineEngine``, else :class:`~.dataloader_loop.EngineLoaderLoop`,
  which owns an unchanged loop's steps through the engine's training
  dataloader or, without one, the script's own (:mod:`.script_loader`)). Hooks read subclass state only when they run, so
  firing at the end of ``DeepSpeedEngine.__init__`` (inside a subclass's
  constructor) is early enough and late enough.

One engine per process can be migratable: the runtime migrates one state provider.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import deepspeed
from deepspeed.runtime.dataloader import DeepSpeedDataLoader
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

from torchpass.core import runtime
from torchpass.core.config import TorchPassConfig

from .config import block_of, resolve_block
from .dataloader_loop import EngineLoaderLoop
from .migration import EngineMigration
from .pipeline import TrainBatchGuard
from .script_loader import watch_script_loaders
from .support import check_supported

__all__ = ["initialize", "install", "migration_of"]

_MIGRATION_ATTRIBUTE = "_torchpass_migration"
_HOOK_MARK = "_torchpass_hook"
_migrating: DeepSpeedEngine | None = None
"""The engine this process migrates, once built."""


def install() -> None:
    """Check every DeepSpeed engine built from now on for a ``"torchpass"`` block (idempotent)."""
    constructor = DeepSpeedEngine.__init__
    if getattr(constructor, _HOOK_MARK, False):
        return

    @functools.wraps(constructor)
    def __init__(self: DeepSpeedEngine, *args: Any, **kwargs: Any) -> None:
        constructor(self, *args, **kwargs)
        _engine_built(self)

    setattr(__init__, _HOOK_MARK, True)
    DeepSpeedEngine.__init__ = __init__  # type: ignore[method-assign]


def initialize(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """Drop-in ``deepspeed.initialize`` (same arguments, same result) with the adapter installed first."""
    install()
    return deepspeed.initialize(*args, **kwargs)


def migration_of(engine: DeepSpeedEngine) -> EngineMigration | None:
    """The engine's migration hooks, or None when it trains without live migration."""
    return getattr(engine, _MIGRATION_ATTRIBUTE, None)


def _engine_built(engine: DeepSpeedEngine) -> None:
    """Validate the engine's block; under ``torchpass launch`` with the block enabled, hook the engine."""
    global _migrating
    rt = runtime.current()
    block = block_of(engine._config._param_dict)
    config = resolve_block(block, rt.config if rt is not None else TorchPassConfig()) if block is not None else None
    if rt is None:
        return
    if config is None or not config.enabled:
        why = 'has no "torchpass" block' if config is None else 'sets "torchpass": {"enabled": false}'
        print(
            f"[torchpass] rank {rt.rank}: the DeepSpeed config {why}: this engine trains without live migration "
            'and a failed rank stops the job (add "torchpass": {"enabled": true} to make it migratable)',
            file=sys.stderr,
            flush=True,
        )
        return
    check_supported(engine)
    if _migrating is not None:
        raise ValueError(
            "torchpass: a second DeepSpeed engine with the \"torchpass\" block enabled was built in this process; "
            'one engine per process can be migrated: set "torchpass": {"enabled": false} in the other engine\'s config'
        )
    rt.config = config
    migration = EngineMigration(engine, rt)
    if isinstance(engine, PipelineEngine):
        TrainBatchGuard(engine, migration).install()
    else:
        migration.loader_loop = EngineLoaderLoop(engine, migration)
        migration.loader_loop.install()
        if not isinstance(engine.training_dataloader, DeepSpeedDataLoader):
            watch_script_loaders(migration.loader_loop)
    setattr(engine, _MIGRATION_ATTRIBUTE, migration)
    _migrating = engine
