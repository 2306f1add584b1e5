"""STAND-IN for Megatron-LM's ``megatron.training`` (core_v0.16.1 / core_v0.18.0), for tests only.

Megatron-LM's ``megatron/training`` is not on PyPI and cannot be installed in
the test environment (nor copied into this repository). The Megatron
adapter's hooks depend only on a few of its functions: their names, their
signatures, and the fact that each calls the next *through its module
global*. This stand-in has exactly those functions, with those signatures and
those call paths, and trivial bodies. It is not a model of Megatron-LM's
behaviour and tests nothing but the hooks' wiring; the framework under test in
every end-to-end test is megatron-core, which is real.

``megatron`` is a namespace package (megatron-core installs ``megatron/core``
without ``megatron/__init__.py``), so putting this directory's parent on
``sys.path`` adds ``megatron.training`` next to the real ``megatron.core``.
"""

from .global_vars import get_args
from .initialize import initialize_megatron
from .training import pretrain

__all__ = ["get_args", "initialize_megatron", "pretrain"]
