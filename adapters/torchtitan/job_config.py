"""The ``[torchpass]`` section of a TorchTitan job config, and its mapping onto :class:`TorchPassConfig`.

A job turns migration on the way every optional TorchTitan feature is turned
on, with a section and its ``enable`` switch::

    [torchpass]
    enable = true
    buddy_interval_steps = 2     # any other TorchPassConfig key, all optional

``--torchpass.enable`` / ``--torchpass.no-enable`` work on TorchTitan's command
line like ``--checkpoint.enable``. The section is declared through TorchTitan's
own extension point, ``[job] custom_config_module``: its ``ConfigManager``
imports this module and merges :class:`JobConfig` into its job config, so
``job_config.torchpass`` exists and ``--torchpass.<key>`` parses. The adapter's
entry point names this module itself when the job names none.

``enable`` is the one key spelled differently from :class:`TorchPassConfig`
(whose switch is ``enabled``, DeepSpeed's spelling): TorchTitan spells every
switch ``enable``. Its default is true, unlike TorchTitan's own feature
switches: the section only configures torchpass, and starting the job with
``torchpass launch`` is already the opt-in, so a section without ``enable``
(or no section) migrates and ``enable = false`` is the off switch. Migration is
off when either the launcher (``--set enabled=false``) or the job says so.

Every other key mirrors a :class:`TorchPassConfig` field (the section is
generated from it, so the two cannot drift); nested settings are sub-tables
(``[torchpass.chaos]``). Those keys default to "not set": a key the job leaves
out keeps what ``torchpass launch`` was given (``--config``, ``--set``,
``--chaos``, else the defaults), and a key it sets wins, because the job config
is the job's own statement of how it wants to be run (rank 0 reports the result
and the controller adopts it). Values are validated by the core
(:func:`~torchpass.core.config.config_from_mapping`), so a bad value fails at
start-up with the core's message naming the key; an unknown key in the TOML is
rejected before TorchTitan parses it (:func:`check_table`), naming the closest
valid key.

Settings ``torchpass launch`` consumes before any worker reads the job config
(:data:`LAUNCHER_SETTINGS`) are rejected in the section with the flag to use.
"""

# No `from __future__ import annotations` here: TorchTitan's ConfigManager finds
# the section (and validates its keys) with `dataclasses.is_dataclass(field.type)`,
# which a string annotation defeats.

import dataclasses
from typing import Any, Optional, get_type_hints

from torchpass.core.config import LAUNCHER_SETTINGS, ConfigError, TorchPassConfig, config_from_mapping, deep_merge, unknown_key_error

__all__ = ["ENABLE", "JobConfig", "LAUNCHER_SETTINGS", "TorchPass", "check_table", "resolve_config", "section_settings"]

ENABLE = "enable"
"""The section's on/off switch, in TorchTitan's spelling; it maps onto ``TorchPassConfig.enabled``."""

_CORE_SWITCH = "enabled"



def _section_class(schema: type, name: str) -> type:
    """A dataclass with ``schema``'s fields, each optional and unset (None) by default."""
    hints = get_type_hints(schema)
    fields: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        if schema is TorchPassConfig and f.name == _CORE_SWITCH:
            # A plain bool (not Optional) so TorchTitan's parser makes it a flag pair,
            # `--torchpass.enable` / `--torchpass.no-enable`, like `--checkpoint.enable`.
            fields.insert(0, (ENABLE, bool, dataclasses.field(default=True)))
        elif dataclasses.is_dataclass(hint):
            nested = _section_class(hint, f"{name}{hint.__name__.removesuffix('Config')}")
            fields.append((f.name, nested, dataclasses.field(default_factory=nested)))
        else:
            fields.append((f.name, Optional[hint], dataclasses.field(default=None)))
    doc = f"The ``[torchpass]`` settings of :class:`{schema.__module__}.{schema.__name__}`; None: as ``torchpass launch`` was given."
    return dataclasses.make_dataclass(name, fields, namespace={"__doc__": doc, "__module__": __name__})


TorchPass = _section_class(TorchPassConfig, "TorchPass")
"""The ``[torchpass]`` table. Reuse it in your own ``custom_config_module`` if the job already has one."""

JobConfig = dataclasses.make_dataclass(
    "JobConfig",
    [("torchpass", TorchPass, dataclasses.field(default_factory=TorchPass))],
    namespace={"__doc__": "What TorchTitan merges into its job config (``[job] custom_config_module``).", "__module__": __name__},
)


def section_settings(section: Any) -> dict[str, Any]:
    """The keys a ``[torchpass]`` section sets (nested as in :class:`TorchPassConfig`), unset ones left out.

    ``enable`` is left out (it is not a setting but the switch, see :func:`resolve_config`).
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if f.name == ENABLE and type(section) is TorchPass:
            continue
        if dataclasses.is_dataclass(value):
            nested = section_settings(value)
            if nested:
                out[f.name] = nested
        elif value is not None:
            out[f.name] = value
    return out


def _dotted(settings: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in settings.items():
        keys += _dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return keys


def resolve_config(section: Any, launched_with: TorchPassConfig, source: str) -> TorchPassConfig:
    """The job's torchpass config: ``launched_with`` overridden by what ``section`` sets.

    ``source`` names the section in errors (e.g. ``[torchpass] of job.toml``).
    Raises :class:`ConfigError` naming the key for a bad value or a launcher-only key.
    """
    settings = section_settings(section)
    if not section.enable:
        settings[_CORE_SWITCH] = False
    for key in _dotted(settings):
        if key in LAUNCHER_SETTINGS:
            raise ConfigError(
                f"{source}: {key}: torchpass launch reads this before the job config exists; "
                f"set it on the launcher instead ({LAUNCHER_SETTINGS[key]})"
            )
    # launched_with is valid already: an error names a key the section set (alone, or against another setting).
    return config_from_mapping(deep_merge(launched_with.to_dict(), settings), source=source)


def check_table(table: Any, source: str, schema: type = TorchPass, prefix: str = "") -> None:
    """Reject a key of a ``[torchpass]`` TOML table that the section does not have, naming the closest one.

    TorchTitan rejects one too, but only as ``Invalid field names in <class ...> data``;
    this runs first (in the entry point) so the message names the key, suggests the
    closest valid one and lists the valid keys, as every torchpass front end does.
    """
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'torchpass'}: expected a table of settings, got {table!r}")
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in table.items():
        if key not in fields:
            raise unknown_key_error(source, prefix, str(key), list(fields))
        nested = get_type_hints(schema)[key]
        if dataclasses.is_dataclass(nested):
            check_table(value, source, nested, f"{prefix}{key}.")
