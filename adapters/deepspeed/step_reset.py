"""Undoing an interrupted DeepSpeed step, and aligning every rank before the step is executed again.

Two local operations (neither issues a collective):

:func:`clear_interrupted_step`
    drops what a step that did not complete left behind, so the rank's
    per-step machinery is exactly as at a step boundary: gradients and their
    accumulators, ZeRO's reduction buckets and bookkeeping, the backward-hook
    state, ZeRO-3 in-flight gathers and in-forward marks, started wall-clock
    timers, the pipeline's buffers. It mirrors what DeepSpeed itself does when it skips an overflowed
    step. The persistent state (parameters, partitions, moments, counters) is
    the caller's concern.

:func:`align_for_reexecution`
    puts the state that decides which collectives a rank issues into the state
    of a freshly built engine, on survivors and joining spares alike. A spare's
    engine has never stepped; survivors have. Left as they are, ZeRO-3's
    parameter-trace checks (broadcasts while the trace is not complete) and the
    pipeline's one-time p2p shape handshake would be issued by the spare only,
    and the collectives would no longer match. Every rank therefore drops its
    ZeRO-3 trace and gathered parameters (the next forward gathers them again,
    persistent ones included) and redoes the pipeline handshake. Neither changes
    any value: the gathered parameters are copies of the partitions, and the
    handshake only sends shapes.
"""

from __future__ import annotations

from deepspeed.runtime.base_optimizer import BackwardHookStateManager, ZeROOptimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.zero import parameter_offload
from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, free_param
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator, ZeRoTraceMode
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID, DeepSpeedZeroOptimizer

__all__ = ["align_for_reexecution", "clear_interrupted_step", "forward_stack_depth"]

# The coordinator keeps its trace in name-mangled attributes; these are their names.
_COORDINATOR = "_PartitionedParameterCoordinator__"


def forward_stack_depth() -> int:
    """Length of ZeRO-3's stack of modules inside a forward (taken at step start, restored on discard)."""
    return len(parameter_offload.FWD_MODULE_STACK)


def clear_interrupted_step(engine: DeepSpeedEngine, forward_stack: int) -> None:
    """Drop the per-step leftovers of an interrupted step (see the module docstring).

    ``forward_stack`` is :func:`forward_stack_depth` at the start of the step:
    a ZeRO-3 forward cut short never pops the modules it pushed.
    """
    engine._running_engine_step = False
    engine._unmanaged_backward_count = 0
    engine.losses = None
    # SynchronizedWallClockTimer.Timer.start() asserts the timer is stopped, and the
    # pipeline's train_batch timer always runs: a timer an aborted step left started
    # would fail the re-executed step.
    for timer in engine.timers.timers.values():
        if timer.started_:
            timer.reset()
    for param in engine.module.parameters():
        param.grad = None
    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        _clear_zero12(optimizer)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        _clear_zero3(optimizer)
        del parameter_offload.FWD_MODULE_STACK[forward_stack:]
        # What the engine's forward epilogue does: a forward cut short leaves every module
        # "in forward", and ZeRO-3 then gathers any partitioned parameter read between
        # steps, a collective only the survivors would issue.
        for module in engine.module.modules():
            if isinstance(module._parameters, ZeROOrderedDict):
                module._parameters._in_forward = False
    else:
        optimizer.zero_grad(set_to_none=True)
    if isinstance(engine, PipelineEngine):
        for key in engine.pipe_buffers:
            engine.pipe_buffers[key] = [None] * len(engine.pipe_buffers[key])
        engine.fwd_outputs = []
        engine.total_loss = None
        engine.total_additional_losses = None
        engine._force_grad_boundary = False


def align_for_reexecution(engine: DeepSpeedEngine) -> None:
    """Bring the collective-driving state to that of a fresh engine, on every rank (see the module docstring)."""
    if isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3):
        _release_gathered_parameters(engine.optimizer)
    if isinstance(engine, PipelineEngine):
        engine.reset_activation_shape()


def _fresh_hook_state(optimizer: ZeROOptimizer) -> None:
    """Forget backward depth, hook counts and queued callbacks; keep the registered post-backward hooks."""
    old = optimizer._backward_hook_state
    fresh = BackwardHookStateManager()
    fresh._grad_acc_post_hooks = old._grad_acc_post_hooks
    optimizer._backward_hook_state = fresh


def _clear_zero12(optimizer: DeepSpeedZeroOptimizer) -> None:
    # What DeepSpeedZeroOptimizer.step() clears when it skips an overflowed step ...
    optimizer.zero_grad(set_to_none=True)
    optimizer._release_preflattened_grad_buffers()
    for key in list(optimizer.averaged_gradients):
        optimizer.averaged_gradients[key] = None
    for key in list(optimizer.all_grad_tensors):
        optimizer.all_grad_tensors[key] = None
    if optimizer.cpu_offload:
        optimizer.reset_cpu_buffers()
    # ... and what a completed backward/step would have consumed: ZeRO-2's reduction
    # buckets and per-partition bookkeeping, filled gradient by gradient.
    for bucket in optimizer.ipg_buckets.values():
        bucket.clear()
        bucket.index = 0
    optimizer.extra_large_param_to_reduce.clear()
    for reduced in optimizer.previous_reduced_grads.values():
        reduced.clear()
    for i in range(len(optimizer.params_already_reduced)):
        optimizer.params_already_reduced[i] = False
    optimizer._release_ipg_buffers()
    optimizer.reset_partition_gradient_structures()
    optimizer.micro_step_id = INITIAL_MICRO_STEP_ID
    optimizer.overflow = False
    for master in optimizer.single_partition_of_fp32_groups:
        master.grad = None
    _fresh_hook_state(optimizer)


def _clear_zero3(optimizer: DeepSpeedZeroOptimizer_Stage3) -> None:
    # zero_grad also resets micro_step_id to 0, so the next micro-batch overwrites the
    # partitioned gradient accumulators instead of adding to them (as after every step).
    optimizer.zero_grad(set_to_none=True)
    optimizer.averaged_gradients = {}
    for bucket in optimizer.ipg_buckets.values():
        bucket.clear_params()  # keeps the reused buffer: clear() would drop it and the next backward fails
    for key in optimizer.params_already_reduced:
        optimizer.params_already_reduced[key] = False
    optimizer.overflow = False
    for master in optimizer.fp32_partitioned_groups_flat:
        master.grad = None
    _fresh_hook_state(optimizer)
    coordinator = optimizer.parameter_offload.get_param_coordinator()
    # In-flight gathers belong to the failed generation's transport: never wait on them.
    getattr(coordinator, _COORDINATOR + "inflight_param_registry").clear()
    setattr(coordinator, _COORDINATOR + "step_id", 0)
    setattr(coordinator, _COORDINATOR + "n_available_params", 0)
    getattr(coordinator, _COORDINATOR + "active_backward_submodules").clear()


def _release_gathered_parameters(optimizer: DeepSpeedZeroOptimizer_Stage3) -> None:
    """Free every gathered full parameter (persistent ones too) and drop the parameter trace; partitions stay."""
    for param in optimizer.module.parameters():
        param.ds_active_sub_modules.clear()
        if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            free_param(param)
    coordinator: PartitionedParameterCoordinator = optimizer.parameter_offload.get_param_coordinator()
    # _invalidate_trace() would wait on in-flight gathers and refuses an already invalid trace.
    setattr(coordinator, _COORDINATOR + "trace_mode", ZeRoTraceMode.INVALID)
    coordinator._clear_trace_structures()
