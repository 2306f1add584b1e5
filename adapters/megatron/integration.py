"""The Megatron-LM integration ``torchpass launch`` activates in every worker.

When the script's arguments carry ``--torchpass`` and the script imports
Megatron-LM's ``megatron.training``, :func:`~.megatron_lm.install_megatron_lm_hooks`
chains the torchpass flags into Megatron-LM's own argument parsing, so an
unmodified ``pretrain_gpt.py`` accepts them. It imports nothing from Megatron
itself; megatron-core loops parse the flags through :mod:`.flags` directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from torchpass.core.integrations import when_imported

__all__ = ["activate"]


def _install(_: ModuleType) -> None:
    from .megatron_lm import install_megatron_lm_hooks

    install_megatron_lm_hooks()


def activate(argv: Sequence[str]) -> None:
    """Hook ``megatron.training`` when it is imported, if the script was given ``--torchpass``."""
    if any(arg == "--torchpass" or arg.startswith("--torchpass-") for arg in argv):
        when_imported("megatron.training", _install)
