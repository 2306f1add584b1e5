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

7. ``Tensor.type()`` (no argument) names a CPU tensor as its CUDA type
   (``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``): Megatron's distributed and
   mixed-precision optimizers and gradient clipping accept only CUDA tensor types
   (optimizer/distrib_optimizer.py:361,420,582, optimizer.py:690, clip_grads.py:174).
   ``Tensor.type(dtype)`` (a conversion) is unchanged.

Megatron-LM's training code (``megatron.training``, megatron-core 0.17.0's wheel;
file:line below in that wheel), when importable, also gets:

8. The ``torch`` proxy of piece 4 in ``megatron.training.{initialize, training, utils}``,
   ``megatron.core.rerun_state_machine`` and ``megatron.core.distributed.{distributed_data_parallel,
   param_and_grad_buffer}``, whose ``torch.cuda`` is
   :class:`_CudaOnCpu`: ``is_available`` answers True in ``initialize`` only
   (initialize.py:61 asserts "Megatron requires CUDA"), and ``device_count`` 1 there with
   ``set_device`` a no-op (initialize.py:277-289,361: with no device Megatron-LM neither
   builds ``parallel_state`` nor seeds the model-parallel RNG tracker, initialize.py:423),
   0 elsewhere; ``current_device`` "cpu"; ``synchronize``/``empty_cache`` no-ops; the memory
   statistics 0 (utils.py:285-290, ``report_memory``); ``get_rng_state``/``set_rng_state``
   the CPU generator's (rerun_state_machine.py:960,973, saved and restored beside
   it); ``get_device_properties`` a device of compute capability 10 (utils.py:454, read by
   arguments.py:1214 to ask for ``CUDA_DEVICE_MAX_CONNECTIONS=1`` on older GPUs);
   ``Stream``/``stream``/``current_stream`` a stream that orders nothing
   (training.py:1487-1505, DDP set-up on a side stream; distributed_data_parallel.py:230 and
   param_and_grad_buffer.py:581-694, the stream of the all-reduce between distributed-optimizer
   instances); tensor factories asked for
   ``"cuda"`` allocate on CPU (training.py:929-935,1996,2251,3652; utils.py:118-209;
   rerun_state_machine.py:264-268).
9. ``initialize._warmup_jit_function`` does nothing: it warms fused bias-GeLU and
   bias-dropout-add kernels up on CUDA tensors drawn from the CUDA generator
   (initialize.py:466-524); CPU has no such kernels, and drawing them from the CPU
   generator instead would move the stream the model's own draws use.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
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

_MEGATRON_LM_MODULES = (
    "megatron.training.initialize",
    "megatron.training.training",
    "megatron.training.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
)

_installed = False


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


class _NoStream:
    """A CUDA stream stand-in: on CPU everything runs in order already (piece 8)."""

    def wait_stream(self, stream: Any) -> None:
        del stream

    def synchronize(self) -> None:
        pass


class _CudaOnCpu(types.ModuleType):
    """``torch.cuda`` as one Megatron-LM module sees it (piece 8)."""

    def __init__(self, *, claims_a_device: bool) -> None:
        super().__init__("torch.cuda")
        self.is_available = lambda: claims_a_device
        self.device_count = lambda: int(claims_a_device)
        self.set_device = lambda device: None
        self.current_device = lambda: "cpu"
        self.synchronize = lambda *args, **kwargs: None
        self.empty_cache = lambda: None
        for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
            setattr(self, name, lambda *args, **kwargs: 0)
        self.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
        self.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
        self.Stream = lambda *args, **kwargs: _NoStream()
        self.current_stream = lambda *args, **kwargs: _NoStream()
        self.stream = lambda stream: contextlib.nullcontext()
        # No device limits what overlaps: the answer of an architecture without Hopper's limits.
        self.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(major=10, minor=0, name="cpu", total_memory=0)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """``torch`` as one megatron-core module sees it: tensor factories asked for ``"cuda"`` allocate on CPU."""

    def __init__(self, cuda: types.ModuleType | None = None) -> None:
        super().__init__("torch")
        for name in ("zeros", "ones", "empty", "full", "tensor"):
            setattr(self, name, _on_cpu(getattr(torch, name)))
        if cuda is not None:
            self.cuda = cuda

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
    """Apply pieces 1-7, and 8-9 where Megatron-LM's training code is importable (once; nothing with CUDA)."""
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
    tensor_type = torch.Tensor.type

    def cuda_type_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return tensor_type(self, *args, **kwargs)
        return tensor_type(self).replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else tensor_type(self)

    torch.Tensor.type = cuda_type_name  # type: ignore[method-assign,assignment]
    if importlib.util.find_spec("megatron.training") is not None:
        _install_megatron_lm()
    _installed = True


def _install_megatron_lm() -> None:
    """Pieces 8 and 9."""
    for name in _MEGATRON_LM_MODULES:
        cuda = _CudaOnCpu(claims_a_device=name.endswith(".initialize"))
        importlib.import_module(name).torch = _TorchOnCpu(cuda)  # type: ignore[attr-defined]
    importlib.import_module("megatron.training.initialize")._warmup_jit_function = lambda: None
