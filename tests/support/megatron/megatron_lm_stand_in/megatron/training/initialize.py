"""STAND-IN (see ``__init__``): core_v0.16.1's ``initialize_megatron``.

Like initialize.py:31 of core_v0.16.1 it binds ``parse_args`` by name at import,
which is why the adapter hooks ``add_megatron_arguments`` instead.
"""

from megatron.training.arguments import parse_args, validate_args

from .global_vars import set_global_variables


def initialize_megatron(
    extra_args_provider=None,
    args_defaults={},
    ignore_unknown_args=False,
    allow_no_cuda=False,
    skip_mpu_initialization=False,
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    store=None,
):
    args = parse_args(extra_args_provider, ignore_unknown_args)
    validate_args(args, args_defaults)
    set_global_variables(args)
