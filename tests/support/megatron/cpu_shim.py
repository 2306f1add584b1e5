"""Test support only: run megatron-core 0.16.1 on a CPU-only torch build (gloo), bitwise reproducibly.

megatron-core assumes CUDA in a few helpers. This shim replaces exactly those,
for the Megatron adapter's tests; it is not product behaviour and torchpass
never installs it. ``install()`` must run after ``import megatron.core`` and
before any model is built or ``model_parallel_cuda_manual_seed`` is called.
Each piece and what it replaces (file:line in megatron-core 0.16.1):

1. ``torch.cuda.current_device`` returns ``"cpu"``: buffers are allocated with
   ``device=torch.cuda.current_device()`` (tensor_parallel/mappings.py:91,141,181,
   tensor_parallel/layers.py:552, pipeline_parallel/p2p_communication.py:189-203,311-322,
   optimizer/optimizer.py:1141, distributed/param_and_grad_buffer.py:783-806).
2. ``torch.cuda.synchronize`` is a no-op: p2p_communication.py:398 synchronizes after
   batched p2p (``batch_p2p_sync``, default True); a CPU build raises "Torch not compiled
   with CUDA enabled".
3. ``Tensor.cuda()`` returns the tensor itself: models/common/language_module/
   language_module.py:244 (``weight.data.cuda()`` before the all-reduce of tied
   embeddings when PP > 1).
4. A ``torch`` module proxy, installed as the ``torch`` global of the modules below,
   whose ``zeros/ones/empty/full/tensor`` allocate on CPU when asked for ``"cuda"``:
   pipeline_parallel/schedules.py:596,983,2138 (``total_num_tokens`` in every
   forward-backward function); optimizer/optimizer.py:473-485,907 (found-inf, loss
   scale), optimizer/grad_scaler.py:15,88-94, optimizer/clip_grads.py:90-207 (gradient
   norm), utils.py:1207 (local l2 norm) for Megatron's optimizer and DDP.
5. The model-parallel RNG tracker: ``CudaRNGStatesTracker.add`` reads the CUDA
   generator and ``fork`` swaps it (tensor_parallel/random.py:217-283); on CPU dropout
   draws from the CPU default generator, so :class:`CpuRNGStatesTracker` keeps CPU
   generator states and swaps the CPU generator. It is stored in the module global
   ``random._CUDA_RNG_STATE_TRACKER`` (with ``_CUDA_RNG_STATE_TRACKER_INITIALIZED``),
   so every ``get_cuda_rng_tracker()`` returns it, including the name
   tensor_parallel/layers.py:41 bound at import, and ``model_parallel_cuda_manual_seed``
   runs unchanged (``torch.cuda.manual_seed`` is a lazy no-op on a CPU build).
6. ``random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` use the CPU generator:
   ``_fork_rng`` (activation recompute) reads and writes "the CUDA state" directly.

What still needs CUDA: Megatron's distributed optimizer and fp16/bf16 optimizers
(optimizer/distrib_optimizer.py:420-437, optimizer.py:690 check CUDA tensor types)
and gradient clipping (clip_grads.py:167); the tests use neither.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from typing import Any, Callable, Iterator

import torch

__all__ = ["install"]

_PROXIED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
)

_installed = False


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


class _TorchOnCpu(types.ModuleType):
    """``torch`` as one megatron-core module sees it: tensor factories asked for ``"cuda"`` allocate on CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in ("zeros", "ones", "empty", "full", "tensor"):
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron-core's tracker over CPU generator states (piece 5)."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            generator = torch.Generator()
            generator.manual_seed(seed)
            self.states_[name] = generator.get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            outer_name = self._current_state_name
            if outer_name != "default-rng":
                self.states_[outer_name] = outer
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer = self.states_[outer_name]
                torch.set_rng_state(outer)
                self._current_state_name = outer_name

    return CpuRNGStatesTracker


def install() -> None:
    """Apply pieces 1-6 (once; nothing on a machine with CUDA)."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    proxy = _TorchOnCpu()
    for name in _PROXIED_MODULES:
        importlib.import_module(name).torch = proxy  # type: ignore[attr-defined]
    mrandom._CUDA_RNG_STATE_TRACKER = _tracker_class()()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    _installed = True
