"""The Megatron-LM integration ``torchpass launch`` activates in every worker.

When the script's arguments carry ``--torchpass`` and the script imports
Megatron-LM's ``megatron.training``, :func:`~.megatron_lm.install_megatron_lm_hooks`
chains the torchpass flags into Megatron-LM's own argument parsing, so an
unmodified ``pretrain_gpt.py`` accepts them. It imports nothing from Megatron
itself; megatron-core loops parse the flags through :mod:`.flags` directly. A hot
spare also imports, while it waits, what ``pretrain()``'s set-up imports lazily
(:data:`MEGATRON_LM_IMPORTS`).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from types import ModuleType

from torchpass.core.integrations import when_imported, when_imported_by_waiting_spare

__all__ = ["activate", "MEGATRON_LM_IMPORTS"]

MEGATRON_LM_IMPORTS = ("megatron.core.tokenizers.text.models",)
"""Modules megatron-core 0.17's ``initialize_megatron`` imports lazily: building the tokenizer imports the text
tokenizer models, and with them every tokenizer library, Hugging Face ``transformers`` included. Measured on
the 2-core machine: a Megatron-LM spare's set-up after its assignment took 2.3 s (TP 2 x DP 2 job), most of it
this import. A module a megatron-core version lacks is skipped."""


def _install(_: ModuleType) -> None:
    from .megatron_lm import install_megatron_lm_hooks

    install_megatron_lm_hooks()


def _warm(_: ModuleType) -> None:
    for name in MEGATRON_LM_IMPORTS:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:  # a parent package this megatron-core version does not have: nothing to warm
            spec = None
        if spec is not None:
            importlib.import_module(name)


def activate(argv: Sequence[str]) -> None:
    """Hook ``megatron.training`` when it is imported, if the script was given ``--torchpass`` (in a hot spare,
    warm it too)."""
    if any(arg == "--torchpass" or arg.startswith("--torchpass-") for arg in argv):
        when_imported("megatron.training", _install)
        when_imported_by_waiting_spare("megatron.training", _warm)
