"""torchpass: keep large PyTorch training jobs running through failures by live migration.

The plain-PyTorch API lives in :mod:`torchpass.core.api` and is re-exported here;
framework integrations are in :mod:`torchpass.adapters`.
"""

from .core.api import Run, Step
from .core.config import ConfigError, TorchPassConfig

__all__ = ["ConfigError", "Run", "Step", "TorchPassConfig"]
__version__ = "0.1.0"
