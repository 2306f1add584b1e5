"""STAND-IN (see ``__init__``): Megatron-LM's argument parsing, same signatures and call paths.

``parse_args`` calls ``add_megatron_arguments`` through the module global, then
the script's ``extra_args_provider``, then parses ``sys.argv`` (known args only
with ``ignore_unknown_args``), as arguments.py:87-122 of core_v0.16.1 does.
``parse_and_validate_args`` is core_v0.18.0's entry point (arguments.py:98).
"""

import argparse

from .global_vars import set_global_variables


def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A few of Megatron-LM's own flags, enough to show they still parse."""
    group = parser.add_argument_group(title="network size")
    group.add_argument("--num-layers", type=int, default=None)
    group.add_argument("--micro-batch-size", type=int, default=None)
    group.add_argument("--train-iters", type=int, default=None)
    group.add_argument("--distributed-backend", default="nccl", choices=["nccl", "gloo"])
    return parser


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args()
    else:
        args = parser.parse_args()
    return args


def validate_args(args, defaults={}):
    return args


def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, args_defaults={}):
    args = parse_args(extra_args_provider, ignore_unknown_args)
    validate_args(args, args_defaults)
    set_global_variables(args)
    return args
