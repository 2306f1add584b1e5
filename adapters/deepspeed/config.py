"""The ``"torchpass"`` block of a DeepSpeed config, and its mapping onto :class:`TorchPassConfig`.

A DeepSpeed job opts in with one top-level block in its JSON config (a file, a
dict, or the file named by ``--deepspeed_config``)::

    "torchpass": {"enabled": true, "buddy_interval_steps": 2}

DeepSpeed keeps top-level keys it does not know (it rejects only a fixed list of
removed ones), so the block travels inside DeepSpeed's own config object and is
read back from the engine (``engine._config._param_dict``, the dict every input
form is resolved to). Nothing in DeepSpeed is patched for parsing.

Every key is a field of :class:`~torchpass.core.config.TorchPassConfig`
(nested settings are nested objects: ``"chaos": {"kill_rank": 1}``). A key the
block leaves out keeps what ``torchpass launch`` was given (``--config``,
``--set``, ``--chaos``, else the defaults); a key it sets wins, because the
DeepSpeed config is the job's own statement of how it wants to be run (rank 0
reports the result and the controller adopts it). Values are validated by the
core, so a bad key or value fails when the engine is built, before training,
with the core's message naming the key. Settings ``torchpass launch`` consumes
before any worker reads the DeepSpeed config (:data:`LAUNCHER_SETTINGS`) are
rejected in the block with the flag to use instead.
"""

from __future__ import annotations

from typing import Any, Mapping

from torchpass.core.config import LAUNCHER_SETTINGS, ConfigError, TorchPassConfig, config_from_mapping, deep_merge

__all__ = ["BLOCK", "LAUNCHER_SETTINGS", "block_of", "resolve_block"]

BLOCK = "torchpass"
"""The top-level key of the block in the DeepSpeed config."""

SOURCE = 'DeepSpeed config block "torchpass"'
"""How errors name the block."""



def block_of(ds_config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``"torchpass"`` block of a resolved DeepSpeed config dict, or None when there is none."""
    block = ds_config.get(BLOCK)
    if block is not None and not isinstance(block, Mapping):
        raise ConfigError(
            f'{SOURCE}: got {block!r} ({type(block).__name__}); expected an object of torchpass settings, '
            'e.g. "torchpass": {"enabled": true}'
        )
    return block


def _dotted(settings: Mapping[str, Any], prefix: str = "") -> list[str]:
    keys: list[str] = []
    for key, value in settings.items():
        keys += _dotted(value, f"{prefix}{key}.") if isinstance(value, Mapping) else [f"{prefix}{key}"]
    return keys


def resolve_block(block: Mapping[str, Any], launched_with: TorchPassConfig) -> TorchPassConfig:
    """The job's torchpass config: ``launched_with`` overridden by what ``block`` sets.

    Raises :class:`~torchpass.core.config.ConfigError` naming the key for an
    unknown key, a bad value, or a key only the launcher can act on.
    """
    for key in _dotted(block):
        if key in LAUNCHER_SETTINGS:
            raise ConfigError(
                f"{SOURCE}: {key}: torchpass launch reads this before the DeepSpeed config exists; "
                f"set it on the launcher instead ({LAUNCHER_SETTINGS[key]})"
            )
    # Validated on its own first, so an error names the key as the block spells it.
    config_from_mapping(block, source=SOURCE)
    return config_from_mapping(deep_merge(launched_with.to_dict(), dict(block)), source=f"{SOURCE} over torchpass launch's config")
