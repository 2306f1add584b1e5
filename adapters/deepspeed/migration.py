"""One DeepSpeed engine's side of the migration protocol: step bracketing, commit point, state provider.

:class:`EngineMigration` is the :class:`~torchpass.core.adapter.StateProvider`
of a migratable engine. It is created when the engine is built (see
:mod:`.install`) and hooks the engine instance, never DeepSpeed's classes:

Per step (the loop wrappers, :mod:`.loop` and :mod:`.pipeline`, call
:meth:`step_begins` / :meth:`step_ends` around the runtime's
``step_begin`` / ``step_end``):

1. step start: remember the step counters, the LR scheduler's state and
   ZeRO-3's forward-module stack depth (a few integers; the scheduler state is
   a small dict);
2. backward started: at the boundary micro-batch's backward prologue
   (``engine._backward_prologue`` while ``is_gradient_accumulation_boundary()``),
   the step's forwards, hence its RNG draws and batches, are final, and no
   gradient has left the rank for the optimizer step yet
   (``runtime.backward_started``). Earlier micro-batches' reductions (ZeRO 2/3)
   cannot complete a step. The pipeline reports it itself (:mod:`.pipeline`);
3. commit started: the inner torch optimizer's first ``step()`` of the step (a
   step pre-hook). ZeRO calls it once per parameter group or sub-group, after
   the overflow and gradient-norm all-reduces, which therefore stay on the
   clean side;
4. commit finished: ``engine._take_model_step`` returned. That includes ZeRO's
   post-step all-gather of the updated partitions (ZeRO 1/2) or of persistent
   parameters (ZeRO 3), the scheduler step and the counter updates, so a
   failure inside that all-gather leaves the rank *dirty*: the core restores
   it from its snapshot or a replica (buddy redundancy keeps a snapshot on
   every rank whenever ZeRO shards state). Overflow-skipped steps never call
   the inner optimizer and are marked committed here too.

On recovery, :meth:`discard_step` restores the counters and the scheduler to
the step start unless the model step completed, then clears the step's
leftovers; :meth:`load_components` installs received state. Both end with
:func:`.step_reset.align_for_reexecution`, so survivors and spares issue the
same collectives when the step is executed again.

Invariants: the engine's persistent state changes only between commit started
and commit finished; the counters and the scheduler at the step start are the
state of version ``step - 1``; no method here issues a collective but
:meth:`EngineMigration.resume`, which the core runs on every member once the
new generation's groups are live (ZeRO 1/2 re-gather their derived
low-precision parameters there).

Requires of the training loop: every optimizer step runs inside a torchpass
step (``steps()`` for a user-owned loop, ``train_batch`` for the pipeline),
which is enforced: the model step raises outside one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from torchpass.core.buffers import ModuleBuffers
from torchpass.core.runtime import Runtime
from torchpass.core.topology import Layout

from .layout import check_groups, engine_layout
from .state import COUNTERS, engine_state, zero_partition_padding
from .step_reset import align_for_reexecution, clear_interrupted_step, forward_stack_depth

__all__ = ["EngineMigration", "LoopState", "OUTSIDE_STEP"]

OUTSIDE_STEP = (
    "torchpass: the DeepSpeed engine took an optimizer step outside a torchpass step. With the \"torchpass\" "
    "block enabled, a forward/backward/step loop must draw its micro-batches from the engine's training "
    "dataloader (training_data= of deepspeed.initialize) or, without one, from a torch DataLoader whose pass "
    "starts while the engine trains (a subclass with its own __iter__ does not count), or iterate "
    "torchpass.adapters.deepspeed.steps(engine, num_steps, data=...) (see docs/adapters/deepspeed.md), or set "
    "\"torchpass\": {\"enabled\": false} to train without live migration"
)


class LoopState(Protocol):
    """State a loop owner keeps beside the engine (the Hugging Face Trainer's counters and running loss).

    The replicated part travels in the engine's ``"global"`` component (every
    rank holds the same); the local part travels with the rank's small state
    (mirrored at each step start and when the step's last backward begins), so
    a spare taking a lost rank receives the lost rank's own.
    """

    def replicated(self) -> dict[str, Any]:
        ...

    def load_replicated(self, state: Mapping[str, Any]) -> None:
        ...

    def local(self) -> dict[str, Any]:
        ...

    def load_local(self, state: Mapping[str, Any]) -> None:
        ...

    def resume(self) -> None:
        """After a migration's rebuild, on every member (see :class:`~torchpass.core.adapter.ResumingProvider`)."""
        ...


_LOOP = "loop"
"""The key of a :class:`LoopState`'s parts in the ``"engine"`` component and in the small state."""
_BUFFERS = "buffers"


@dataclass
class _StepStart:
    """What the engine held when the current step began (version ``step - 1``)."""

    counters: dict[str, Any]
    lr_scheduler: Any
    forward_stack: int


class EngineMigration:
    """The migratable state and the step hooks of one DeepSpeed engine (see the module docstring)."""

    def __init__(self, engine: DeepSpeedEngine, rt: Runtime):
        self.engine = engine
        self.runtime = rt
        self.state = engine_state(engine)
        if isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3):
            zero_partition_padding(engine.optimizer)
        self._start: _StepStart | None = None
        self._model_step_done = False
        self.loader_loop: Any = None
        """The :class:`~.dataloader_loop.EngineLoaderLoop` owning an unchanged loop's steps, if installed."""
        self.loop_state: LoopState | None = None
        """State of the loop owner beside the engine's, if it keeps any (see :class:`LoopState`)."""
        self._buffers = ModuleBuffers(engine.module)
        self.state.inner.register_step_pre_hook(self._on_inner_step)
        self._take_model_step = engine._take_model_step
        engine._take_model_step = self._guarded_model_step
        if not isinstance(engine, PipelineEngine):
            self._backward_prologue = engine._backward_prologue
            engine._backward_prologue = self._on_backward_prologue

    # ---- step bracketing (called by the loop wrappers) -----------------------
    @property
    def in_step(self) -> bool:
        return self._start is not None

    def step_begins(self) -> None:
        engine = self.engine
        scheduler = engine.lr_scheduler
        self._start = _StepStart(
            counters={name: getattr(engine, name) for name in COUNTERS},
            lr_scheduler=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
            forward_stack=forward_stack_depth(),
        )
        self._model_step_done = False

    def step_ends(self) -> None:
        self._start = None

    # ---- hooks on the engine instance -----------------------------------------
    def _on_backward_prologue(self) -> None:
        if self.in_step and self.engine.is_gradient_accumulation_boundary():
            self.runtime.backward_started()
        self._backward_prologue()

    def _on_inner_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        del optimizer, args, kwargs
        if self.in_step:
            self.runtime.commit_started()

    def _guarded_model_step(self, lr_kwargs: Any = None) -> None:
        if not self.in_step:
            raise RuntimeError(OUTSIDE_STEP)
        self._take_model_step(lr_kwargs)
        # A step skipped for overflow never called the inner optimizer but changed the
        # loss scale and the counters: it commits all the same.
        self.runtime.commit_started()
        self.runtime.commit_finished()
        self._model_step_done = True

    # ---- StateProvider ----------------------------------------------------------
    def layout(self) -> Layout:
        check_groups(self.engine)
        return engine_layout(self.engine)

    def state_components(self) -> tuple[dict[str, Any], dict[str, str]]:
        components, classes = self.state.components()
        if self.loop_state is not None:
            components["engine"][_LOOP] = self.loop_state.replicated()
        return components, classes

    def load_components(self, components: Mapping[str, Any], *, joining: bool) -> None:
        del joining  # a spare's engine is freshly built: nothing to replay beyond the alignment below
        self.state.load(components)
        if self.loop_state is not None and "engine" in components:
            self.loop_state.load_replicated(components["engine"][_LOOP])
        align_for_reexecution(self.engine)

    def resume(self) -> None:
        """Recompute the derived parameters, then let the loop owner settle work the interrupted generation
        left half done (collectives allowed, on every member alike)."""
        self.state.rederive()
        if self.loop_state is not None:
            self.loop_state.resume()

    def discard_step(self) -> None:
        engine, start = self.engine, self._start
        if start is not None and not self._model_step_done:
            for name, value in start.counters.items():
                setattr(engine, name, value)
            if engine.lr_scheduler is not None:
                engine.lr_scheduler.load_state_dict(copy.deepcopy(start.lr_scheduler))
        clear_interrupted_step(engine, start.forward_stack if start is not None else forward_stack_depth())
        self._start = None
        self._model_step_done = False
        align_for_reexecution(self.engine)

    # ---- SmallStateProvider: persistent buffers -----------------------------------
    def small_state(self) -> dict[str, Any] | None:
        """This rank's persistent module buffers (BatchNorm statistics, say: DeepSpeed never syncs them across
        ranks) and the loop owner's local state."""
        small: dict[str, Any] = {}
        if self._buffers:
            small[_BUFFERS] = self._buffers.copy()
        if self.loop_state is not None:
            small[_LOOP] = self.loop_state.local()
        return small or None

    def load_small_state(self, state: Mapping[str, Any]) -> None:
        if _BUFFERS in state:
            self._buffers.load(state[_BUFFERS])
        if self.loop_state is not None and _LOOP in state:
            self.loop_state.load_local(state[_LOOP])

