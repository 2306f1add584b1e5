"""``--torchpass`` and ``--torchpass-*``: the Megatron command-line front end of :class:`TorchPassConfig`.

Megatron scripts build one argparse parser and extend it with an
``extra_args_provider(parser) -> parser``; :func:`add_torchpass_args` is such a
provider. ``--torchpass`` turns live migration on; every other flag is one
field of :class:`~torchpass.core.config.TorchPassConfig`, spelled
``--torchpass-`` + the field path with ``_`` and ``.`` as ``-``::

    --torchpass-buddy-interval-steps 2      buddy_interval_steps = 2
    --torchpass-redundancy buddy            redundancy = "buddy"
    --torchpass-verify-replicas false       verify_replicas = False
    --torchpass-chaos-kill-rank 1           chaos.kill_rank = 1

Fields that only ``torchpass launch`` can act on (``spares_per_node``,
``run_dir``, ``signals``, ``metrics``, ``controller_lease_s``) have no flag: the launcher reads them before the script starts.

Errors name the flag: a bad value fails while argparse parses it (the rule
the config schema attaches to the field), and a misspelled ``--torchpass-*`` flag fails with the closest valid spelling,
also when the script parses with ``parse_known_args`` (Megatron-LM's
``ignore_unknown_args``), which would otherwise drop it silently.

:func:`config_from_args` turns the parsed flags into the job's config: the
config ``torchpass launch`` handed the worker, with the flags on top. The
runtime reports rank 0's config to the controller when it attaches, so the
flags govern detection and recovery for the whole job.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, get_type_hints

from torchpass.core import runtime
from torchpass.core.config import ConfigError, TorchPassConfig, config_from_mapping, deep_merge

__all__ = ["ConfigFlag", "add_torchpass_args", "config_flags", "config_from_args", "warn_without_launcher"]

SWITCH = "--torchpass"
_LAUNCHER_ONLY = frozenset({"enabled", "spares_per_node", "run_dir", "signals", "metrics", "controller_lease_s"})
"""Fields with no flag: ``enabled`` is ``--torchpass`` itself; the others are read by the launcher."""

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


@dataclass(frozen=True)
class ConfigFlag:
    """One ``--torchpass-*`` flag and the config field it sets."""

    flag: str
    path: tuple[str, ...]
    """The field path in :class:`TorchPassConfig`, e.g. ``("chaos", "kill_rank")``."""
    kind: type
    default: Any
    schema: Mapping[str, Any] = field(compare=False)
    """The field's validation metadata in the config schema (``choices``, ``check``)."""

    @property
    def dest(self) -> str:
        """The attribute argparse stores the value under."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def field(self) -> str:
        return ".".join(self.path)


def config_flags() -> list[ConfigFlag]:
    """Every ``--torchpass-*`` flag, derived from the :class:`TorchPassConfig` schema."""
    return list(_flags_of(TorchPassConfig, TorchPassConfig(), ()))


def _flags_of(cls: type, defaults: Any, prefix: tuple[str, ...]) -> list[ConfigFlag]:
    hints = get_type_hints(cls)
    out: list[ConfigFlag] = []
    for spec in dataclasses.fields(cls):
        if not prefix and spec.name in _LAUNCHER_ONLY:
            continue
        path = (*prefix, spec.name)
        value = getattr(defaults, spec.name)
        if dataclasses.is_dataclass(hints[spec.name]):
            out += _flags_of(hints[spec.name], value, path)
        else:
            flag = SWITCH + "-" + "-".join(path).replace("_", "-")
            out.append(ConfigFlag(flag, path, hints[spec.name], value, spec.metadata))
    return out


def _nested(path: Sequence[str], value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {path[-1]: value}
    for key in reversed(path[:-1]):
        out = {key: out}
    return out


def _converter(flag: ConfigFlag) -> Callable[[str], Any]:
    """Text -> the field's type, validated by the config schema; errors become argparse errors naming the flag."""

    def convert(text: str) -> Any:
        value: Any
        if flag.kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise argparse.ArgumentTypeError(f"got {text!r}; expected true or false")
            value = text.lower() in _TRUE
        elif flag.kind is int:
            try:
                value = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"got {text!r}; expected an integer") from None
        elif flag.kind is float:
            try:
                value = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"got {text!r}; expected a number") from None
        else:
            value = text
        # The field's own rule from the schema; rules spanning several fields are
        # checked once all flags are parsed (config_from_args).
        choices = flag.schema.get("choices")
        if choices is not None and value not in choices:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected one of {', '.join(choices)}")
        check = flag.schema.get("check")
        if check is not None and not check[0](value):
            raise argparse.ArgumentTypeError(f"got {text!r}; expected {check[1]}")
        return value

    convert.__name__ = flag.kind.__name__
    return convert


def _reject_unknown_torchpass_flags(parser: argparse.ArgumentParser, known: Sequence[str]) -> None:
    """Make ``parser`` fail on a misspelled ``--torchpass-*`` flag, naming the closest valid one.

    argparse has no hook for unknown options, so this wraps the parser's
    ``parse_known_args`` (which ``parse_args`` calls too): without it a script
    parsing with ``parse_known_args`` would ignore a misspelled flag and run
    with the default.
    """
    parse_known_args = parser.parse_known_args

    def checked(args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None) -> Any:
        namespace, extras = parse_known_args(args, namespace)
        for token in extras:
            name = token.split("=", 1)[0]
            if name.startswith(SWITCH):
                # Compare what follows the common "--torchpass-", which would make every name look close.
                suffixes = {k.removeprefix(SWITCH + "-"): k for k in known if k != SWITCH}
                close = difflib.get_close_matches(name.removeprefix(SWITCH + "-"), list(suffixes), n=1, cutoff=0.6)
                valid = f"did you mean {suffixes[close[0]]}?" if close else f"valid torchpass flags: {', '.join(known)}"
                parser.error(f"unknown flag {name}: {valid}")
        return namespace, extras

    parser.parse_known_args = checked  # type: ignore[method-assign]


class _Switch(argparse._StoreTrueAction):
    """``--torchpass``: on, with a one-line warning when no ``torchpass launch`` started this process."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        if runtime.current() is None:
            warn_without_launcher()


def add_torchpass_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--torchpass`` and the ``--torchpass-*`` flags; an ``extra_args_provider`` for Megatron."""
    flags = config_flags()
    group = parser.add_argument_group(
        "torchpass", "live migration of failed ranks to hot spares (start the job with `torchpass launch`)"
    )
    group.add_argument(
        SWITCH, action=_Switch, help="make training migratable: a failed rank's work moves to a hot spare"
    )
    for flag in flags:
        if flag.kind is bool:
            metavar = "{true,false}"
        elif "choices" in flag.schema:
            metavar = "{" + ",".join(flag.schema["choices"]) + "}"
        else:
            metavar = flag.kind.__name__.upper()
        group.add_argument(
            flag.flag,
            dest=flag.dest,
            type=_converter(flag),
            default=None,
            metavar=metavar,
            help=f"TorchPassConfig.{flag.field} (default: the launcher's config; built-in {flag.default!r})",
        )
    _reject_unknown_torchpass_flags(parser, [SWITCH, *(f.flag for f in flags)])
    return parser


def config_from_args(args: argparse.Namespace) -> TorchPassConfig | None:
    """The job's torchpass config from parsed flags, or None without ``--torchpass``.

    The base is the config ``torchpass launch`` gave this worker (the built-in
    defaults outside it); each ``--torchpass-*`` flag given overrides its field.
    ``--torchpass-*`` flags without ``--torchpass`` are an error: they would
    silently do nothing.
    """
    given = {f: getattr(args, f.dest) for f in config_flags() if getattr(args, f.dest, None) is not None}
    if not getattr(args, "torchpass", False):
        if given:
            names = ", ".join(f.flag for f in given)
            raise ConfigError(f"{names} given without {SWITCH}: add {SWITCH} to enable live migration, or drop them")
        return None
    rt = runtime.current()
    base = (rt.config if rt is not None else TorchPassConfig()).to_dict()
    overrides: Mapping[str, Any] = {}
    for flag, value in given.items():
        overrides = deep_merge(dict(overrides), _nested(flag.path, value))
    names = " ".join(f"{f.flag} {v}" for f, v in given.items()) or "no --torchpass-* flags"
    return config_from_mapping(deep_merge(base, overrides), source=f"torchpass config (launcher's, then {names})")


_warned = False


def warn_without_launcher() -> None:
    """One line on stderr, once per process: ``--torchpass`` was given but the job was not started by ``torchpass launch``."""
    global _warned
    if not _warned:
        _warned = True
        print(
            "[torchpass] --torchpass: this process was not started by `torchpass launch`; training runs without live "
            "migration",
            file=sys.stderr,
            flush=True,
        )
