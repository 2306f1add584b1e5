"""The ``[torchpass]`` section of a TorchTitan job config, and its mapping onto :class:`TorchPassConfig`.

A job opts in with two lines of TOML (plus any settings)::

    [job]
    custom_config_module = "torchpass.adapters.torchtitan.job_config"

    [torchpass]
    buddy_interval_steps = 2

``custom_config_module`` is TorchTitan's own extension point: its
``ConfigManager`` imports this module and merges :class:`JobConfig` into its
job config, so ``job_config.torchpass`` exists, ``--torchpass.<key>`` works
on the command line, and an unknown key in the section is rejected by
TorchTitan itself ("Invalid field names in <class 'TorchPass'> data: ...").

The section mirrors :class:`~torchpass.core.config.TorchPassConfig` field for
field (it is generated from it, so the two cannot drift); nested settings are
sub-tables (``[torchpass.chaos]``). Every key defaults to "not set": a key the
job leaves out keeps what ``torchpass launch`` was given (``--config``,
``--set``, ``--chaos``, else the defaults), and a key it sets wins, because the
job config is the job's own statement of how it wants to be run (rank 0
reports the result and the controller adopts it). Values are validated by the
core (:func:`~torchpass.core.config.config_from_mapping`), so a bad value
fails at start-up with the core's message naming the key.

Settings ``torchpass launch`` consumes before any worker reads the job config
(:data:`LAUNCHER_SETTINGS`) are rejected in the section with the flag to use.
"""

# No `from __future__ import annotations` here: TorchTitan's ConfigManager finds
# the section (and validates its keys) with `dataclasses.is_dataclass(field.type)`,
# which a string annotation defeats.

import dataclasses
from typing import Any, Optional, get_type_hints

from torchpass.core.config import ConfigError, TorchPassConfig, config_from_mapping, deep_merge

__all__ = ["JobConfig", "LAUNCHER_SETTINGS", "TorchPass", "resolve_config", "section_settings"]

LAUNCHER_SETTINGS = {
    "spares_per_node": "torchpass launch --spares-per-node N",
    "run_dir": "torchpass launch --run-dir DIR",
    "telemetry.console": "torchpass launch --set telemetry.console=false",
}
"""Section keys the launcher reads before the job config exists, and where to set them instead."""


def _section_class(schema: type, name: str) -> type:
    """A dataclass with ``schema``'s fields, each optional and unset (None) by default."""
    hints = get_type_hints(schema)
    fields: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
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
    """The keys a ``[torchpass]`` section sets (nested as in :class:`TorchPassConfig`), unset ones left out."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
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
    for key in _dotted(settings):
        if key in LAUNCHER_SETTINGS:
            raise ConfigError(
                f"{source}: {key}: torchpass launch reads this before the job config exists; "
                f"set it on the launcher instead ({LAUNCHER_SETTINGS[key]})"
            )
    # launched_with is valid already: an error names a key the section set (alone, or against another setting).
    return config_from_mapping(deep_merge(launched_with.to_dict(), settings), source=source)
