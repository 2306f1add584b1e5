"""Megatron-LM's own ``pretrain()`` -> ``train()`` -> ``train_step()`` made migratable, unchanged.

Megatron-LM's ``train()`` calls the functions below through the globals of
``megatron.training.training``, looked up at each call, so wrapping those
globals (:mod:`.megatron_lm`) puts the protocol around Megatron-LM's own code:

* ``setup_model_and_optimizer`` (in ``pretrain()``): the model chunks, the
  Megatron optimizer and the ``OptimizerParamScheduler`` become the state
  (:class:`MegatronLMState`); the optimizer's torch optimizers get the commit's
  start marker, the scheduler's ``step`` its end. A **spare** fetches its state
  right here (``Runtime.prefetch``, its groups still local) and sets
  ``args.iteration``, the consumed-samples counters and the FLOP count, exactly
  what ``load_checkpoint`` would set there: the rest of ``pretrain()`` builds
  the spare's data iterators at the right sample with Megatron-LM's own sampler,
  and ``train()`` starts at the job's iteration. No ``--load``, no checkpoint.
* ``train_step`` (once per iteration): the guarded step. Step k = ``iteration``
  + 1 begins (runtime ``step_begin``; the rerun state machine and the data
  replay are marked), Megatron-LM's ``train_step`` runs, and it ends at its
  return (``step_end``). A collective failing inside runs the survivor side of
  the migration; the iteration is then executed again through Megatron-LM's
  ``train_step`` with the same micro-batches (replayed beneath its
  ``RerunDataIterator``), RNG streams (torch, Python, NumPy, the model-parallel
  tracker) and rerun state machine (put back to the iteration's start, see
  :mod:`.rerun`), or, when the replica the rank was restored from had completed
  it, counted as done. ``train()`` sees one call per iteration either way, so
  ``iteration``, ``consumed_train_samples``, the scheduler and the
  microbatch calculator count it once. A spare goes live at its first call.
* The commit: from the first torch optimizer ``step`` (after the found-inf and
  gradient-norm collectives) to the end of the scheduler's ``step``, which also
  counts the iteration's samples and FLOPs in the state's :class:`~.state.Progress`.
  Megatron-LM runs model-parallel all-reduces between the two: a rank failing
  there is dirty and takes its state from a replica. An iteration whose update
  was skipped (fp16 overflow) commits its counters at ``train_step``'s return.
* Between iterations, ``training_log``, ``evaluate_and_print_results``,
  ``post_training_step_callbacks``, ``checkpoint_and_decide_exit`` and
  ``save_checkpoint_and_time`` run collectives of their own (``training_log``
  barriers every ``--log-interval``). A failure there runs the survivor side of
  the migration too; the new generation resumes at the next iteration, which
  the spare starts with, so until then this rank's collectives are answered
  locally (``comms.hold``): the interrupted function returns what it was given,
  an evaluation is skipped, and a checkpoint save is skipped rather than
  written without the lost rank's shard (the next save interval writes one).
* ``train`` itself: at its return the hold ends, and a spare that had no
  iteration left to join at joins there.

Invariants: the rank's ``Progress`` equals Megatron-LM's ``args`` counters at
every iteration's start (checked; a divergence is an error, never a silent
skip); a step is marked complete only when Megatron-LM's ``train_step``
returned or a replica's state for it was loaded.

Requirements on the job: ``--torchpass`` under ``torchpass launch``; no
``--inprocess-restart`` (refused), no ``--iterations-to-skip``, no RL mode
(refused); the distributed optimizer, CUDA and NCCL are refused as for
megatron-core loops (see docs/adapters/megatron.md).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core import num_microbatches_calculator as microbatches
from megatron.core import parallel_state as ps
from megatron.core.rerun_state_machine import RerunDataIterator

from torchpass.core import comms, runtime
from torchpass.core.api import watch_backward

from . import rerun
from .data import StepReplay
from .flags import config_from_args, warn_without_launcher
from .layout import DEFAULT_ORDER
from .losses import reduce_losses
from .optimizers import check_supported, torch_optimizers
from .state import MegatronState, Progress, StepPhase

__all__ = ["MegatronLMLoop", "MegatronLMState", "refuse_unsupported"]

_DATA_FLAGS = "data_flags"
"""The component with Megatron-LM's ``args.do_train``, ``do_valid`` and ``do_test``."""
_DATA_FLAG_ARGS = ("do_train", "do_valid", "do_test")

TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"
"""The order string Megatron-LM gives ``initialize_model_parallel`` with ``--use-tp-pp-dp-mapping``."""


class MegatronLMState(MegatronState):
    """:class:`~.state.MegatronState` plus what Megatron-LM's loop keeps: ``args`` counters, rerun machine, replay."""

    def __init__(self, *, args: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self.args = args
        self.replays: list[StepReplay] = []
        self._rerun_at_start: dict[int, dict[str, Any]] = {}
        """Step -> the rerun machine as the step began (the last two steps: one may be rolled back)."""

    def begin(self, step: int) -> None:
        """Step ``step`` starts: remember the rerun machine's state and where each data iterator stands."""
        self.step_started()
        self._rerun_at_start = {s: v for s, v in self._rerun_at_start.items() if step - 1 <= s < step}
        self._rerun_at_start[step] = rerun.snapshot()
        for replay in self.replays:
            replay.mark_step(step)

    def rewind(self, step: int) -> None:
        """``step`` is executed again: the rerun machine and the data as the step began."""
        rerun.restore(self._rerun_at_start[step])
        for replay in self.replays:
            replay.rewind(step)

    def completed_elsewhere(self, step: int, phase: StepPhase) -> None:
        """``step`` completed on the replica this rank's state came from: move the loop's own state past it."""
        if phase is not StepPhase.IDLE:
            rerun.restore(self._rerun_at_start[step])
            rerun.completed()
        for replay in self.replays:
            replay.rewind(step)
            # A rank that reads data reads one batch per micro-batch in each step.
            for _ in range(microbatches.get_num_microbatches()):
                next(replay)

    def count_step(self) -> None:
        """Count the step's samples and FLOPs as Megatron-LM's ``train()`` will after ``train_step``."""
        from megatron.training.training import num_floating_point_operations

        args = self.args
        batch = ps.get_data_parallel_world_size() * args.micro_batch_size * microbatches.get_num_microbatches()
        self.advance(batch, update_calculator=False)
        self.progress.skipped_train_samples += (
            microbatches.get_current_global_batch_size() - microbatches.get_current_running_global_batch_size()
        )
        self.progress.floating_point_operations += num_floating_point_operations(args, batch)

    def progress_from_args(self) -> None:
        args = self.args
        self.progress = Progress(
            iteration=args.iteration,
            consumed_train_samples=args.consumed_train_samples,
            skipped_train_samples=args.skipped_train_samples,
            consumed_valid_samples=args.consumed_valid_samples,
            floating_point_operations=float(args.num_floating_point_operations_so_far),
        )

    def check_counters(self, iteration: int) -> None:
        """At an iteration's start: Megatron-LM's counters are the state's (the validation position is taken over)."""
        args, progress = self.args, self.progress
        if (iteration, args.consumed_train_samples) != (progress.iteration, progress.consumed_train_samples):
            raise RuntimeError(
                f"torchpass: Megatron-LM's train() is at iteration {iteration} with {args.consumed_train_samples} "
                f"consumed samples, the migratable state at {progress.iteration} with "
                f"{progress.consumed_train_samples}: the counters diverged (--iterations-to-skip or a modified loop?)"
            )
        progress.consumed_valid_samples = args.consumed_valid_samples

    # ---- StateProvider / SmallStateProvider ------------------------------------
    def state_components(self) -> tuple[dict[str, Any], dict[str, str]]:
        components, classes = super().state_components()
        components[_DATA_FLAGS] = {name: bool(getattr(self.args, name, False)) for name in _DATA_FLAG_ARGS}
        classes[_DATA_FLAGS] = "global"
        return components, classes

    def load_components(self, components: Any, *, joining: bool) -> None:
        super().load_components(components, joining=joining)
        if _DATA_FLAGS in components:
            # pretrain() broadcasts these from rank 0 while it builds the data loaders; a spare's
            # set-up broadcasts are answered locally, and its own flags are False off data ranks.
            for name, value in components[_DATA_FLAGS].items():
                setattr(self.args, name, value)
        if "progress" in components and joining:
            # What load_checkpoint sets in setup_model_and_optimizer, for the spare's train() to start from.
            # A survivor's args stay as its train() counted them: it sees each iteration once, and an
            # iteration the migration runs again below it (a rollback) is one train() counted already.
            args, progress = self.args, self.progress
            args.iteration = progress.iteration
            args.consumed_train_samples = progress.consumed_train_samples
            args.skipped_train_samples = progress.skipped_train_samples
            args.consumed_valid_samples = progress.consumed_valid_samples
            args.num_floating_point_operations_so_far = progress.floating_point_operations

    def small_state(self) -> dict[str, Any]:
        machine = rerun.persistent()
        # Within a step the record stands for the step's end: its first iteration is then complete.
        machine["first_iteration_complete"] = machine["first_iteration_complete"] or self.phase is not StepPhase.IDLE
        return {**super().small_state(), "rerun": machine}

    def load_small_state(self, state: Any) -> None:
        super().load_small_state(state)
        rerun.load_persistent(state["rerun"])


class MegatronLMLoop:
    """The wrapped Megatron-LM functions' shared state, one per process (see the module docstring)."""

    def __init__(self) -> None:
        self.runtime = runtime.current()
        self.state: MegatronLMState | None = None
        self._attached = False
        self._held = False
        self._backward_starts = 0
        self._backwards_per_step = 0
        self._redo: int | None = None
        """An iteration train() completed that a migration between iterations rolled back: run again first."""
        self._train_at = 0
        """The last iteration whose ``train_step`` returned to train() (the code after it then runs)."""
        self._hold_epilogue_of: int | None = None
        """An iteration whose following code the others ran before the migration: held here when it runs."""
        self._losses: dict[str, torch.Tensor] | None = None
        """The executing iteration's losses, reduced as Megatron-LM does, once its forward-backward finished."""

    # ---- setup_model_and_optimizer -------------------------------------------------
    def setup(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        model, optimizer, scheduler = built = original(*args, **kwargs)
        from megatron.training import get_args

        margs = get_args()
        config = config_from_args(margs)
        if config is None:
            return built
        if self.runtime is None:
            warn_without_launcher()
            return built
        refuse_unsupported(margs)
        check_supported(model, optimizer)
        self.runtime.config = config  # reported to the controller at attach: the flags govern the job
        state = MegatronLMState(
            args=margs,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            progress=Progress(),
            order=TP_PP_DP_ORDER if margs.use_tp_pp_dp_mapping else DEFAULT_ORDER,
        )
        self.state = state
        for chunk in state.model:
            watch_backward(chunk, self._on_backward_start)
        for opt in torch_optimizers(optimizer):
            opt.register_step_pre_hook(lambda *_: self._commit_started())
        scheduler_step = scheduler.step

        def step_and_commit(*a: Any, **kw: Any) -> Any:
            result = scheduler_step(*a, **kw)
            self._commit_finished()
            return result

        scheduler.step = step_and_commit
        if self.runtime.role == "spare":
            self.runtime.prefetch(state)  # sets args' counters, as load_checkpoint would here
        return built

    # ---- train_step --------------------------------------------------------------------
    def train_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        state, rt = self.state, self.runtime
        if state is None or rt is None:
            return original(*args, **kwargs)
        if "iteration" not in kwargs:
            raise TypeError("torchpass: Megatron-LM's train() calls train_step(..., iteration=...); got no iteration")
        number = kwargs["iteration"] + 1
        self._train_at = number - 1
        self._enter_step(number, kwargs["data_iterator"] if "data_iterator" in kwargs else args[1])
        args, kwargs = _with_forward_backward(args, kwargs, self._reducing_losses)
        if self._redo is not None:
            # A migration between iterations rolled the job back to the iteration train() completed last.
            redo, self._redo = self._redo, None
            state.rewind(redo)
            self._run_step(redo, original, args, kwargs)
        state.check_counters(number - 1)
        result = self._run_step(number, original, args, kwargs)
        self._train_at = number
        if self._hold_epilogue_of == number:
            # The others ran this iteration's between-iterations code before the migration.
            self._hold_epilogue_of = None
            self._hold(f"the other ranks ran the code after iteration {number} before the migration")
        return result

    def _run_step(self, number: int, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Execute iteration ``number`` through Megatron-LM's ``train_step`` until it completed (here or elsewhere)."""
        state, rt = self.state, self.runtime
        assert state is not None and rt is not None
        kwargs = {**kwargs, "iteration": number - 1}
        while True:
            state.begin(number)
            self._losses = None
            rt.step_begin(number)
            self._backward_starts = 0
            self._backwards_per_step = microbatches.get_num_microbatches() * len(state.model)
            try:
                result = original(*args, **kwargs)
            except Exception as exc:  # re-raised unless a migration interrupted the iteration
                if not rt.is_comm_failure(exc):
                    raise
                phase = state.phase
                first = self._recover(f"iteration {number}: {type(exc).__name__}: {str(exc)[:300]}")
                if first == number + 1:
                    state.completed_elsewhere(number, phase)
                    result = _completed_elsewhere_result(self._losses)
                    # The job resumes at the next iteration: what train() runs before it is this rank's alone.
                    self._hold(f"iteration {number} completed on the replica this rank's state came from")
                    break
                if first == number - 1:
                    # The lost rank's copy of the iteration before did not survive (buddy copies):
                    # train() counted it already, so it runs again here, unseen by train().
                    state.rewind(number - 1)
                    self._run_step(number - 1, original, args, kwargs)
                    print(f"[torchpass] rank {rt.rank}: iteration {number - 1} ran again (rolled back); now {number}", file=sys.stderr, flush=True)
                    continue
                if first != number:
                    raise RuntimeError(
                        f"torchpass: the migration resumes the job at step {first} while Megatron-LM's train() is in "
                        f"iteration {number}; only the last completed iteration and the interrupted one can run again"
                    ) from exc
                state.rewind(number)
                print(f"[torchpass] rank {rt.rank}: iteration {number} runs again", file=sys.stderr, flush=True)
                continue
            if state.phase is StepPhase.COMPUTING:
                # A skipped update (fp16 overflow) changes no weights, but train() counts the iteration.
                self._commit_started()
                self._commit_finished()
            break
        rt.step_end(number)
        state.step_finished()
        return result

    def _reducing_losses(self, forward_backward_func: Callable[..., Any]) -> Callable[..., Any]:
        """``forward_backward_func``, followed by Megatron-LM's loss reduction (before the commit, kept).

        Megatron-LM's ``train_step`` reduces the losses over the data-parallel ranks after
        its optimizer step; an iteration whose commit completed on the replica this rank
        takes its state from would otherwise have no loss anywhere (every member's
        reduction was cut short). One more small all-reduce per iteration, on the last
        pipeline stage, with Megatron-LM's arithmetic: the values are the ones it logs.
        """

        def forward_backward(*args: Any, **kwargs: Any) -> Any:
            outputs = forward_backward_func(*args, **kwargs)
            if ps.is_pipeline_last_stage(ignore_virtual=True) and not kwargs.get("forward_only", False):
                self._losses = reduce_losses(outputs)
            return outputs

        return forward_backward

    def _enter_step(self, number: int, data_iterator: Any) -> None:
        state, rt = self.state, self.runtime
        assert state is not None and rt is not None
        if not self._attached:
            self._replay_beneath(data_iterator, keep_steps=rt.config.buddy_interval_steps + 1)
            self._attach(number)
        self._release_hold()
        while rt.ending.is_set():
            self._resume_between(self._recover(f"generation ended before iteration {number}: {rt.ending_reason}"))

    def _attach(self, number: int) -> None:
        state, rt = self.state, self.runtime
        assert state is not None and rt is not None
        if rt.role != "spare":
            state.progress_from_args()
        first = rt.attach(state, None, number, [])
        self._attached = True
        if rt.role == "spare":
            try:
                self._agree_on_epilogue(first)
            except Exception as exc:  # re-raised unless a migration interrupted the agreement
                if not rt.is_comm_failure(exc):
                    raise
                first = self._recover(f"agreeing after joining: {type(exc).__name__}: {str(exc)[:300]}")
        if first != number:
            raise RuntimeError(
                f"torchpass: this process joined the job at step {first}, but Megatron-LM's train() was set up for "
                f"iteration {number} (the plan changed while the spare set up); the controller assigns another spare"
            )

    def _replay_beneath(self, data_iterator: Any, keep_steps: int) -> None:
        """Put a :class:`StepReplay` under each of the iteration's ``RerunDataIterator`` s (None: this rank reads none)."""
        assert self.state is not None
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        for it in iterators:
            if it is None:
                continue
            if not isinstance(it, RerunDataIterator):
                raise TypeError(
                    f"torchpass: Megatron-LM's train_step got a {type(it).__name__} as data iterator; expected the "
                    "RerunDataIterator that build_train_valid_test_data_iterators makes"
                )
            it.iterable = replay = StepReplay(it.iterable, keep_steps)
            self.state.replays.append(replay)

    # ---- commit markers ----------------------------------------------------------------
    def _on_backward_start(self) -> None:
        self._backward_starts += 1
        if self._backward_starts == self._backwards_per_step and self.runtime is not None:
            self.runtime.backward_started()

    def _commit_started(self) -> None:
        assert self.state is not None and self.runtime is not None
        if self.state.phase is StepPhase.COMPUTING:
            self.state.commit_started()
            self.runtime.commit_started()

    def _commit_finished(self) -> None:
        state, rt = self.state, self.runtime
        assert state is not None and rt is not None
        if state.phase is StepPhase.COMMITTING:
            state.count_step()
            rt.commit_finished()
            state.step_finished()

    # ---- between iterations ------------------------------------------------------------
    def between_iterations(
        self, name: str, original: Callable[..., Any], returns: Callable[[tuple[Any, ...]], Any], *, skip_when_held: bool
    ) -> Callable[..., Any]:
        """``original`` (a function ``train()`` calls between iterations), guarded (see the module docstring).

        ``returns(args)``: what the function returns when it is cut short or skipped.
        """

        def guarded(*args: Any, **kwargs: Any) -> Any:
            rt = self.runtime
            if self.state is None or rt is None or not self._attached:
                return original(*args, **kwargs)
            if self._held and skip_when_held:
                print(f"[torchpass] rank {rt.rank}: {name} skipped: a migration ended this iteration", file=sys.stderr, flush=True)
                return returns(args)
            try:
                return original(*args, **kwargs)
            except Exception as exc:  # re-raised unless a migration interrupted it
                if not rt.is_comm_failure(exc):
                    raise
                self._resume_between(self._recover(f"between iterations ({name}): {type(exc).__name__}: {str(exc)[:300]}"))
                self._hold(f"{name} was cut short by a migration")
                return returns(args)

        return guarded

    def train(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if self.state is not None and self.runtime is not None:
            if not self._attached:
                # No iteration was left to run (a spare that joined at the last one): go live here.
                self._attach(self.state.progress.iteration + 1)
            self._release_hold()
        return result

    def _resume_between(self, first: int) -> None:
        """After a migration between iterations: the next iteration follows, or the last one runs again first.

        Compared with the iteration train() completed, not with the loaded state's: a rollback
        loads the state of the iteration before it, which train() has counted past already.
        """
        completed = self._train_at
        if first == completed:
            self._redo = first
        elif first != completed + 1:
            raise RuntimeError(
                f"torchpass: the migration resumes the job at step {first}, but Megatron-LM's train() completed "
                f"iteration {completed}; only that one can run again"
            )

    def _hold(self, reason: str) -> None:
        assert self.runtime is not None
        comms.hold(True)
        self._held = True
        print(
            f"[torchpass] rank {self.runtime.rank}: {reason}; until the next iteration this rank's collectives are "
            "answered locally",
            file=sys.stderr,
            flush=True,
        )

    def _release_hold(self) -> None:
        if self._held:
            comms.hold(False)
            self._held = False

    def _recover(self, cause: str) -> int:
        """The survivor side of a migration, then the members' agreement on the resume step's epilogue."""
        rt = self.runtime
        assert rt is not None
        while True:
            first = rt.recover(cause)
            try:
                self._agree_on_epilogue(first)
                return first
            except Exception as exc:  # re-raised unless a migration interrupted the agreement
                if not rt.is_comm_failure(exc):
                    raise
                cause = f"agreeing after the migration: {type(exc).__name__}: {str(exc)[:300]}"

    def _agree_on_epilogue(self, first: int) -> None:
        """Whether the code train() runs after iteration ``first`` already ran on some member (one all-reduce).

        A member whose train() completed iteration ``first`` before the migration (the
        job was rolled back to it) runs it again unseen by train(), so never runs that
        code again; every other member then runs it with its collectives held locally.
        The first collective of every member after a migration, issued exactly once.
        """
        ran = torch.tensor([1.0 if self._train_at >= first else 0.0])
        dist.all_reduce(ran, op=dist.ReduceOp.MAX)
        self._hold_epilogue_of = first if ran.item() > 0 and self._train_at < first else None


def _completed_elsewhere_result(losses: dict[str, torch.Tensor] | None) -> tuple[Any, ...]:
    """What Megatron-LM's ``train_step`` returns for an iteration this rank took from a replica.

    ``(loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm,
    num_zeros_in_grad, max_attention_logit)``: the losses reduced before the commit
    (none off the last stage, or if the forward-backward did not finish here); the
    gradient norm is not known on this rank; the update was made.
    """
    return losses or {}, 0, False, False, 0, None, None, 0


def _with_forward_backward(
    args: tuple[Any, ...], kwargs: dict[str, Any], wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``train_step``'s arguments with its ``forward_backward_func`` wrapped (train() passes it 7th, core_r0.17)."""
    if "forward_backward_func" in kwargs:
        return args, {**kwargs, "forward_backward_func": wrap(kwargs["forward_backward_func"])}
    if len(args) < 7:
        raise TypeError("torchpass: Megatron-LM's train_step was called without a forward_backward_func")
    return (*args[:6], wrap(args[6]), *args[7:]), kwargs


def refuse_unsupported(args: Any) -> None:
    """Megatron-LM features whose loop changes the state outside ``train_step``, refused before training."""
    refused = {
        "inprocess_restart": "--inprocess-restart (it restarts every rank's pretrain() from a checkpoint; torchpass "
        "moves the failed rank to a hot spare and keeps the others running: use one of them)",
        "iterations_to_skip": "--iterations-to-skip (train() then counts iterations that train_step never runs)",
        "perform_rl_step": "--perform-rl-step (RL rollouts change the data iterator between iterations)",
    }
    for name, why in refused.items():
        if getattr(args, name, None):
            raise ValueError(f"torchpass: --torchpass cannot be combined with {why}")
