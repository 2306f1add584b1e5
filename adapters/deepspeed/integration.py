"""The DeepSpeed integration ``torchpass launch`` activates in every worker.

It imports nothing from DeepSpeed: when (and only when) the script imports
``deepspeed``, the adapter is imported and :func:`~.install.install` hooks
``DeepSpeedEngine``, so an unmodified script's engines are checked for the
``"torchpass"`` block.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from torchpass.core.integrations import when_imported

__all__ = ["activate"]


def _install(_: ModuleType) -> None:
    from .install import install

    install()


def activate(argv: Sequence[str]) -> None:
    """Hook DeepSpeed's engine as soon as the script imports ``deepspeed``."""
    when_imported("deepspeed", _install)
