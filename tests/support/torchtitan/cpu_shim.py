"""Run TorchTitan 0.2.2 on a CPU-only machine with gloo. Test support only, never product behaviour.

TorchTitan assumes an accelerator. Each piece below replaces exactly one
assumption (file:line refer to the installed torchtitan 0.2.2):

1. Device type. ``torchtitan/tools/utils.py:36-42`` computes at import time
   ``device_type = _get_available_device_type() or "cuda"`` and
   ``device_module = _get_device_module(device_type)``, which is ("cuda",
   torch.cuda) on a CPU-only torch. Other modules copy the pair by ``from ...
   import`` and ``import torchtitan`` itself already imports them, so patching
   the values afterwards is too late. :func:`device_override` swaps the two
   torch functions only while ``torchtitan.tools.utils`` executes (it imports
   them by name and keeps the replacements); torch gets its own back at once.
   Result: device ``cpu:<LOCAL_RANK>``, backend gloo, DeviceMesh on "cpu".

2. Device module. TorchTitan calls helpers that ``torch.cpu`` lacks
   (``components/metrics.py:45-65,95``: device name, properties, memory stats,
   peak-memory reset, ``empty_cache``). :class:`CpuDeviceModule` forwards to
   ``torch.cpu`` and adds them, without modifying ``torch.cpu``. Its
   ``current_device()`` returns 0 because ``distributed/utils.py:386`` passes it
   to ``barrier(device_ids=[...])``, which rejects torch.cpu's ``"cpu"``.

3. FSDP2's reduce op. TorchTitan sets a gradient divide factor of 1.0 on every
   FSDP module (``models/llama3/infra/parallelize.py:272-284``), for which FSDP2
   reduce-scatters with ``ReduceOp.PREMUL_SUM(1.0)``
   (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:846-850``);
   gloo rejects PREMUL_SUM. :func:`sum_reduction_for_unit_divide_factor` makes
   that same call also force SUM reductions, which with a factor of 1.0 is the
   same arithmetic (no pre- or post-division, ``:866-874``).

Everything else TorchTitan needs on CPU is configuration: ``[compile] enable =
false``, ``[model] converters = []``, ``training.mixed_precision_param =
"float32"``.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CpuDeviceModule", "device_override", "sum_reduction_for_unit_divide_factor"]


class CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the accelerator helpers TorchTitan calls on its device module."""

    def __init__(self) -> None:
        super().__init__("torchtitan_cpu_device_module")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "CPU"

    @staticmethod
    def get_device_properties(device: Any = None) -> types.SimpleNamespace:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name="CPU", total_memory=total)

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


_DEVICE_MODULE = CpuDeviceModule()


@contextlib.contextmanager
def device_override() -> Iterator[None]:
    """Around the first execution of ``torchtitan.tools.utils``: make it pick "cpu" (piece 1 and 2)."""
    import torch._utils as torch_utils

    original_type, original_module = torch_utils._get_available_device_type, torch_utils._get_device_module

    def cpu_device_type() -> str:
        return "cpu"

    def device_module(device_type: str = "cuda") -> Any:
        return _DEVICE_MODULE if device_type == "cpu" else original_module(device_type)

    torch_utils._get_available_device_type, torch_utils._get_device_module = cpu_device_type, device_module
    try:
        yield
    finally:
        torch_utils._get_available_device_type, torch_utils._get_device_module = original_type, original_module


def sum_reduction_for_unit_divide_factor() -> None:
    """Piece 3: a divide factor of 1.0 also forces SUM reductions, which gloo supports."""
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self: FSDPModule, factor: float) -> None:
        original(self, factor)
        if factor == 1.0:
            self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor  # type: ignore[method-assign]
