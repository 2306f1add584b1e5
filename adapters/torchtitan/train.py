"""Entry point: TorchTitan's ``main`` running :class:`~torchpass.adapters.torchtitan.trainer.TorchPassTrainer`.

::

    torchpass launch --nproc-per-node 4 --spares-per-node 1 \\
        -m torchpass.adapters.torchtitan.train --job.config_file job.toml

takes exactly TorchTitan's command line (``--job.config_file``, ``--section.key
value`` overrides). Started by ``torchrun`` instead, it behaves like
``python -m torchtitan.train``.
"""

import sys

from torchtitan.config import ConfigManager
from torchtitan.train import main

from torchpass.adapters.torchtitan.trainer import TorchPassTrainer

if __name__ == "__main__":
    # TorchTitan binds the default of `ConfigManager.parse_args(args=sys.argv[1:])` when
    # torchtitan.config is first imported. A torchpass hot spare imports this module while
    # it waits for a rank, before its command line is the job's: bind it again, now.
    ConfigManager.parse_args.__defaults__ = (sys.argv[1:],)
    main(TorchPassTrainer)
