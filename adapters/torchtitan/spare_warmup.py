"""What a TorchTitan hot spare does while it waits for a rank, so that its set-up after the assignment is short.

A spare preloads the entry point (:mod:`~torchpass.adapters.torchtitan.train`, see
:mod:`torchpass.core.worker`), which calls :func:`warm` there; once the spare has
a rank it runs the entry point as ``__main__``, which calls :func:`use_parsed_config`
before TorchTitan's ``main``. Two costs move out of the migration, measured on the
2-core machine against a TorchTitan spare's 0.41 s set-up:

* imports TorchTitan's set-up makes lazily (:data:`SPARE_IMPORTS`): 0.13 s;
* parsing the job config: TorchTitan's ``ConfigManager`` builds its command-line
  parser from the config dataclasses (tyro) on every parse, 0.13 s the first time
  in a process. The command line is the job's from the spare's start, and
  :func:`use_parsed_config` hands the config parsed from it to ``main`` only if
  ``main`` parses that same command line.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

from torchtitan.config import ConfigManager, JobConfig

__all__ = ["SPARE_IMPORTS", "use_parsed_config", "warm"]

SPARE_IMPORTS = ("scipy.io",)
"""What a spare imports beyond the entry point's own imports. Hugging Face ``datasets`` imports the modules
whose readers it patches for streaming (``datasets.streaming``) whenever a dataset builder is made, which
TorchTitan's text loader does during the trainer's set-up. ``scipy.io`` was the one not imported already;
one that is not installed is skipped, as ``datasets`` skips it."""

_parsed: dict[tuple[str, ...], JobConfig] = {}
"""The job config :func:`warm` parsed, by the command line it parsed."""


def warm(argv: list[str]) -> None:
    """Import :data:`SPARE_IMPORTS` and parse the job config from ``argv`` (the entry point's arguments)."""
    for name in SPARE_IMPORTS:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)
    try:
        _parsed[tuple(argv)] = ConfigManager().parse_args(argv)
    except (Exception, SystemExit) as exc:  # tyro exits on a bad command line
        # Parsed again once the spare has its rank, where the same error stops it as it stops the active ranks.
        print(f"[torchpass] spare: job config not parsed ahead ({type(exc).__name__}: {exc}); parsing it after the assignment",
              file=sys.stderr, flush=True)  # fmt: skip


def use_parsed_config(argv: list[str]) -> None:
    """Make the next ``ConfigManager.parse_args(argv)`` return the config :func:`warm` parsed from ``argv``, if any.

    Once: the patch removes itself at that call, so every later parse is TorchTitan's own.
    """
    parsed = _parsed.pop(tuple(argv), None)
    if parsed is None:
        return
    own = ConfigManager.parse_args

    def parse_args(self: ConfigManager, args: list[str] = argv) -> Any:
        ConfigManager.parse_args = own  # type: ignore[method-assign]
        if list(args) != list(argv):
            return own(self, args)
        self.config = parsed
        return parsed

    ConfigManager.parse_args = parse_args  # type: ignore[method-assign]
