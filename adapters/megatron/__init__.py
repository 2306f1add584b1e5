"""The Megatron adapter: ``--torchpass`` makes megatron-core training migratable (TP, PP, CP, EP and DP).

* :func:`add_torchpass_args` / :func:`config_from_args` (:mod:`.flags`): the
  ``--torchpass`` and ``--torchpass-*`` flags, an argparse ``extra_args_provider``;
* :class:`MegatronRun` (:mod:`.run`): a megatron-core loop's guarded ``train_step``;
* :func:`layout_from_parallel_state` (:mod:`.layout`): replica sets from ``parallel_state``;
* :func:`install_megatron_lm_hooks` (:mod:`.megatron_lm`): chains the flags into
  Megatron-LM's own argument parsing.

See docs/adapters/megatron.md. Names are imported lazily: the flags work
without importing megatron-core.
"""

from typing import Any

__all__ = [
    "MegatronRun",
    "add_torchpass_args",
    "config_from_args",
    "install_megatron_lm_hooks",
    "layout_from_parallel_state",
]

_EXPORTS = {
    "MegatronRun": "run",
    "add_torchpass_args": "flags",
    "config_from_args": "flags",
    "install_megatron_lm_hooks": "megatron_lm",
    "layout_from_parallel_state": "layout",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
