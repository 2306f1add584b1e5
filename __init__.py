"""torchpass: keep large PyTorch training jobs running through failures by live migration.

The plain-PyTorch API lives in :mod:`torchpass.core.api` and is re-exported here
(lazily, so ``torchpass status``/``inject``/``report`` start without importing
torch); framework integrations are in :mod:`torchpass.adapters`.
"""

from typing import Any

__all__ = ["ConfigError", "Run", "Step", "TorchPassConfig"]
__version__ = "0.1.0"

_EXPORTS = {"Run": "core.api", "Step": "core.api", "ConfigError": "core.config", "TorchPassConfig": "core.config"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'torchpass' has no attribute {name!r}")
