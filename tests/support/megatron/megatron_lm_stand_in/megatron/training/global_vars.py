"""STAND-IN (see ``__init__``): Megatron-LM's global ``args`` (``get_args``, ``set_global_variables``)."""

import argparse

_GLOBAL_ARGS: argparse.Namespace | None = None


def get_args() -> argparse.Namespace:
    assert _GLOBAL_ARGS is not None, "args are not initialized"
    return _GLOBAL_ARGS


def set_global_variables(args: argparse.Namespace, build_tokenizer: bool = True) -> None:
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args
