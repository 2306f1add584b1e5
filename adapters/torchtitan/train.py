"""Entry point: TorchTitan's ``main`` running :class:`~torchpass.adapters.torchtitan.trainer.TorchPassTrainer`.

::

    torchpass launch --nproc-per-node 4 --spares-per-node 1 \\
        -m torchpass.adapters.torchtitan.train --job.config_file job.toml

takes exactly TorchTitan's command line (``--job.config_file``, ``--section.key
value`` overrides). Started by ``torchrun`` instead, it behaves like
``python -m torchtitan.train``. A job that names no ``custom_config_module``
of its own gets torchpass's (:func:`with_torchpass_section`), so a TOML with
just a ``[torchpass]`` section is accepted, and that section's keys are
checked before TorchTitan parses them (an unknown key fails naming the closest
valid one).
"""

import sys
import tomllib
from pathlib import Path

from torchtitan.config import ConfigManager
from torchtitan.train import main

from torchpass.adapters.torchtitan import spare_warmup
from torchpass.adapters.torchtitan.job_config import check_table
from torchpass.adapters.torchtitan.trainer import TorchPassTrainer
from torchpass.core.integrations import is_waiting_spare

SECTION_MODULE = "torchpass.adapters.torchtitan.job_config"


def _option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def with_torchpass_section(argv: list[str]) -> list[str]:
    """``argv`` plus ``--job.custom_config_module`` naming torchpass's section, unless the job names its own.

    TorchTitan rejects a TOML section no config module declares; a job with
    its own ``custom_config_module`` declares the section there (see
    docs/adapters/torchtitan.md) and is left as it is. Otherwise the TOML's
    ``[torchpass]`` table is checked here, before TorchTitan parses it.
    """
    if _option(argv, "--job.custom_config_module") is not None:
        return argv
    config_file = _option(argv, "--job.config_file") or _option(argv, "--job.config-file")
    if config_file is not None:
        with Path(config_file).open("rb") as f:
            toml = tomllib.load(f)
        if "custom_config_module" in toml.get("job", {}):
            return argv
        if "torchpass" in toml:
            check_table(toml["torchpass"], f"[torchpass] section of {config_file}")
    return [*argv, "--job.custom_config_module", SECTION_MODULE]


if is_waiting_spare():
    # A TorchTitan spare preloads this module while it waits (torchpass.core.worker), with the job's command line.
    spare_warmup.warm(with_torchpass_section(sys.argv[1:]))

if __name__ == "__main__":
    argv = with_torchpass_section(sys.argv[1:])
    # TorchTitan binds the default of `ConfigManager.parse_args(args=sys.argv[1:])` when
    # torchtitan.config is first imported, which can be before sys.argv is this command line: bind it again, now.
    ConfigManager.parse_args.__defaults__ = (argv,)
    spare_warmup.use_parsed_config(argv)
    main(TorchPassTrainer)
