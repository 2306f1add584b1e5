"""Hugging Face's ``transformers.Trainer`` over a migratable DeepSpeed engine, with the script unchanged.

A job written as Hugging Face's DeepSpeed guide writes it::

    args = TrainingArguments(..., deepspeed="ds_config.json")   # the config carries "torchpass": {...}
    Trainer(model=model, args=args, train_dataset=dataset).train()

is migratable under ``torchpass launch``. The Trainer owns the loop (transformers 5:
``_inner_training_loop`` calls ``_run_epoch`` per epoch; each optimizer step
draws its micro-batches at once with ``get_batch_samples``, counts their
tokens across ranks, runs ``training_step`` per micro-batch (forward,
``engine.backward`` and, at the last, ``engine.step()``, through accelerate),
then counts the step and logs in ``_maybe_log_save_evaluate``). It keeps loop
state DeepSpeed's engine does not: ``state`` (global step, epoch, log
history, total flos), ``control``, ``_total_loss_scalar`` and
``_globalstep_last_logged``, the same on every rank; the running loss
``_tr_loss`` and ``current_flos``, each rank's own. :class:`TrainerSteps`
hooks those methods on the Trainer class (a Trainer whose engine is not
migratable runs the originals) and carries that state (:class:`~.migration.LoopState`).

Protocol:

1. *Step start* is ``get_batch_samples`` (before the draw: the engine's
   counters, the scheduler and the RNG are marked there); the first
   ``_run_epoch`` attaches the rank. After the draw, the step's micro-batches
   and the RNG as the draw left it are kept, and the count of tokens across
   ranks runs guarded.
2. The ``training_step`` whose ``engine.step()`` takes the optimizer step
   *counts* the step; what the Trainer does next (its counters, then
   ``_maybe_log_save_evaluate``: the log, an evaluation, a checkpoint) is the
   step's *epilogue*. *Step end* is the next draw (or the epoch's end): the
   version's state, buddy copy included, is the Trainer's at the next step's
   start.
3. A collective failing inside a step (the token count, a forward, backward or
   optimizer step) runs the survivor side of the migration right there, and
   the step is executed again *in place*: the RNG as the draw left it, the
   token count, each micro-batch already run through ``training_step`` again
   with the accumulation boundary it had (its loss dropped: the Trainer
   counted it), then the interrupted one, whose loss is returned. The Trainer
   sees each micro-batch once.
4. A collective failing in an epilogue (the log's loss gather, ``store_flos``)
   runs the survivor side too. When the job resumes after the step, the
   members agree (one all-reduce in ``resume()``) whether an epilogue was cut
   short; if so every member runs it again from the state it began with: a
   survivor cut short in it, a survivor already past it (its state is put back
   afterwards: only the collectives are repeated) and a spare (with the lost
   rank's running loss). A log line may print twice on a rank already past it.
5. When the job resumes one step back (a buddy copy lost with its rank right
   after its optimizer step), a survivor executes that step again without the
   Trainer, which counted it, and runs the epilogues that followed it again for
   their collectives; the spare executes it as its own.
6. A spare builds its engine in its own ``train()``; its first ``_run_epoch``
   attaches it and receives the engine's state and the Trainer's (the lost
   rank's running loss and flos from its mirrored small state). Epochs before
   the job's end at once; the job's epoch runs through the Trainer's own
   resume path (``skip_first_batches``: the sampler skips the batches before
   the job's step without loading them), and its first draw leaves the RNG as
   the lost rank had it.

Invariants: the Trainer's state at version ``v`` is its state as step
``v + 1`` begins; every member issues the same collectives after a migration
(the re-executed step's, and an epilogue's when one is run again); the
Trainer counts each step and each micro-batch's loss once.

Requires of the job: transformers with ``Trainer._run_epoch`` (5.x); the
whole step drawn by ``get_batch_samples``; ``include_num_input_tokens_seen``
off (its count is a collective between micro-batches);
``buddy_interval_steps`` 1; no random numbers drawn between steps (callbacks,
the epilogue). Refused with an error naming the setting otherwise, except the
last.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.distributed as dist

from torchpass.core.rng import capture_rng, restore_rng

if TYPE_CHECKING:
    from torchpass.core.config import TorchPassConfig

    from .migration import EngineMigration

__all__ = ["TrainerSteps", "check_trainer_arguments", "hook_trainer"]

_IN_MEMORY = "<torchpass: the job's state, received in memory>"
"""What a spare passes as the Trainer's ``resume_from_checkpoint``: the Trainer's resume path positions the
epoch, no file is read (``_load_rng_state`` of it returns at once)."""
_WALL_CLOCK = ("_runtime", "_per_second")
"""Suffixes of the log-history keys the Trainer's ``speed_metrics`` writes (``train_runtime``,
``eval_samples_per_second``, ...): each rank's own wall-clock measurements, so not replicated state. They stay
out of what travels: a spare's copy of earlier log entries lacks them, and the replicated state is the same bytes
on every rank (replica verification, campaign fingerprints)."""
_STEPS = "_torchpass_trainer_steps"
_ORIGINALS: dict[str, Callable[..., Any]] = {}
"""The Trainer's own methods, by name, once hooked."""
_HOOKED = "_torchpass_trainer_hook"


@dataclass
class _Epilogue:
    """What one epilogue call began with: enough to run it again with the same inputs and effects."""

    serial: int
    args: tuple[Any, ...]
    """``_maybe_log_save_evaluate``'s arguments after ``tr_loss`` (grad norm, model, trial, epoch, ...)."""
    replicated: dict[str, Any]
    """The Trainer's replicated state as it began (its log history by length)."""
    tr_loss: torch.Tensor
    flos: float


@dataclass
class _Step:
    """One step as this rank executed it: enough to execute it again without the Trainer."""

    number: int
    rng_drawn: dict[str, Any] | None = None
    """The RNG as the step's draw left it: where the step's computation starts."""
    batches: list[Any] = dataclasses.field(default_factory=list)
    calls: list[tuple[Any, Any, bool]] = dataclasses.field(default_factory=list)
    """``training_step`` calls: (inputs, number of items, the accumulation boundary flag)."""
    epilogues: list[_Epilogue] = dataclasses.field(default_factory=list)
    """The epilogue calls that followed it (the step's own, an epoch's end)."""


class TrainerSteps:
    """Owns the step boundaries of one Trainer training a migratable engine (see the module docstring)."""

    def __init__(self, trainer: Any, migration: "EngineMigration"):
        self.trainer = trainer
        self.migration = migration
        self.runtime = migration.runtime
        self.engine = migration.engine
        self._attached = False
        self._number = 0
        """The step this rank executes (or ended last, between steps)."""
        self._counted = 0
        """The last step the Trainer counted (its optimizer step done, its loss added)."""
        self._step: _Step | None = None
        self._previous: _Step | None = None
        self._loss: torch.Tensor | None = None
        """The loss the step's last ``engine.backward`` was given (what that ``training_step`` returns)."""
        self._uncounted = False
        """Between the step's last backward and the Trainer counting its loss."""
        self._serial = 0
        """Epilogue calls so far (the same count on every member)."""
        self._in_epilogue: _Epilogue | None = None
        self._interrupted_epilogue = -1
        self._rerun = -1
        """After a migration without rollback: the serial of the epilogue every member runs again, or -1."""
        self._joined: dict[str, Any] | None = None
        """On a spare, from its join to its first step: the lost rank's local state."""
        self._joined_epilogue: dict[str, Any] | None = None
        self._spare_args: tuple[Any, ...] = ()
        """On a spare whose members agreed to run an epilogue again: its arguments."""
        self._spare_rng: dict[str, Any] | None = None
        check_trainer_arguments(trainer.args, self.runtime.config)
        migration.loop_state = self
        if migration.loader_loop is not None:
            # The Trainer's loop owns the steps: the engine's calls are DeepSpeed's own again.
            migration.loader_loop.delegate()
        backward = self.engine.backward

        def remembering_backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
            self._loss = loss.detach() if isinstance(loss, torch.Tensor) else None
            self._uncounted = bool(self.trainer.accelerator.gradient_state.sync_gradients)
            return backward(loss, *args, **kwargs)

        self.engine.backward = remembering_backward  # type: ignore[method-assign]

    # ---- epochs ------------------------------------------------------------------
    def run_epoch(self, original: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        if not self._attached:
            self._attach()
        result = self._spare_epoch(original, kwargs) if self._joined is not None else original(self.trainer, **kwargs)
        self._end_step()
        return result

    def _attach(self) -> None:
        first = self.runtime.attach(self.migration, None, self.engine.global_steps + 1, [])
        self._attached = True
        self._number = first
        self._counted = first - 1
        if self._joined is not None:
            self._spare_epilogue()
            self._spare_rng = capture_rng()

    def _spare_epoch(self, original: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        """A spare's epochs up to the job's: earlier ones end at once, the job's resumes at its step."""
        epoch, update = divmod(self.trainer.state.global_step, kwargs["num_update_steps_per_epoch"])
        if kwargs["epoch"] < epoch:
            return None
        if update == 0:
            # The job's epoch starts with the spare's first draw, as it did on the lost rank.
            self._spare_rng = None
        gas = self.trainer.args.gradient_accumulation_steps
        kwargs = {**kwargs, "resume_from_checkpoint": _IN_MEMORY, "epochs_trained": epoch, "steps_trained_in_current_epoch": update * gas}
        return original(self.trainer, **kwargs)

    # ---- the step ----------------------------------------------------------------
    def _begin_step(self, number: int) -> None:
        self.migration.step_begins()
        self.runtime.step_begin(number)

    def _end_step(self) -> None:
        """End the runtime's step once the Trainer's epilogues after it ran: the version's state is the next step's start."""
        if self.migration.in_step and self._counted == self._number:
            self.runtime.step_end(self._number)
            self.migration.step_ends()
            self._number += 1

    def draw(self, original: Callable[..., Any], epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        rt = self.runtime
        if not self._attached:
            raise RuntimeError(
                "torchpass: the Trainer drew a step's batches outside _run_epoch; a Trainer subclass that reorganizes "
                "the training loop is not supported with live migration"
            )
        self._end_step()
        while rt.ending.is_set():
            self._recover(f"generation ended before step {self._number}: {rt.ending_reason}")
            self._end_step()
        self._begin_step(self._number)
        self._previous, self._step = self._step, _Step(self._number)
        result = original(self.trainer, epoch_iterator, num_batches, device)
        self._joined = None
        if self._step.rng_drawn is None:
            raise RuntimeError(
                "torchpass: the Trainer's get_batch_samples did not count the step's items with "
                "_get_num_items_in_batch; a Trainer that overrides get_batch_samples is not supported with live migration"
            )
        return result

    def count_items(self, original: Callable[..., Any], batches: list[Any], device: Any) -> Any:
        step = self._step
        if not self.migration.in_step or step is None or step.rng_drawn is not None:
            return original(self.trainer, batches, device)
        if self._spare_rng is not None:
            # A spare's first draw started its loader mid-epoch, which the lost rank had done
            # steps before: the job's RNG is the one the spare received.
            restore_rng(self._spare_rng)
            self._spare_rng = None
        step.rng_drawn = capture_rng()
        step.batches = batches
        while True:
            try:
                return original(self.trainer, batches, device)
            except Exception as exc:  # re-raised unless a migration interrupted the count
                self._interrupted("the count of items", exc)
                restore_rng(step.rng_drawn)

    def micro_batch(self, original: Callable[..., Any], model: Any, inputs: Any, items: Any) -> Any:
        step = self._step
        if not self.migration.in_step or step is None or self._counted == step.number:
            raise RuntimeError(
                "torchpass: Trainer.training_step ran outside a step drawn by get_batch_samples; a Trainer subclass "
                "that reorganizes the training loop is not supported with live migration"
            )
        boundary = bool(self.trainer.accelerator.gradient_state.sync_gradients)
        step.calls.append((inputs, items, boundary))
        if boundary:
            self.runtime.last_forward_started()
        while True:
            try:
                loss = original(self.trainer, model, inputs, items)
                break
            except Exception as exc:  # re-raised unless a migration interrupted the micro-batch
                if self._interrupted("a training_step", exc):
                    loss = self._loss  # the optimizer step was done: the Trainer counts the step now
                    break
                self._execute(step, upto=len(step.calls) - 1)
        self._uncounted = False
        if boundary and self.engine.global_steps > self._counted:
            self._counted = step.number
        return loss

    def _execute(self, step: _Step, upto: int) -> None:
        """Execute ``step``'s computation again, its first ``upto`` micro-batches: the count, then each one."""
        assert step.rng_drawn is not None
        trainer = self.trainer
        restore_rng(step.rng_drawn)
        _ORIGINALS["_get_num_items_in_batch"](trainer, step.batches, trainer.args.device)
        gradient_state = trainer.accelerator.gradient_state
        for inputs, items, boundary in step.calls[:upto]:
            gradient_state._set_sync_gradients(boundary)
            _ORIGINALS["training_step"](trainer, trainer.model_wrapped, inputs, items)
        if upto < len(step.calls):
            gradient_state._set_sync_gradients(step.calls[upto][2])

    def _interrupted(self, where: str, exc: Exception) -> bool:
        """Recover from a collective failing in the step; True if its optimizer step was done (nothing to run again)."""
        if not self.runtime.is_comm_failure(exc):
            raise exc
        number = self._number
        first = self._recover(f"step {number} ({where}): {type(exc).__name__}: {str(exc)[:300]}")
        if first == number + 1:
            return True
        self._begin_step(number)
        print(
            f"[torchpass] rank {self.runtime.rank}: {where} was interrupted by a migration; step {number} runs again "
            "in place from its first micro-batch",
            file=sys.stderr,
            flush=True,
        )
        return False

    # ---- recovery -------------------------------------------------------------------
    def _recover(self, cause: str) -> int:
        """The survivor side of a migration, then catching up with the step the job resumes at; returns it."""
        rt = self.runtime
        while True:
            first = rt.recover(cause)
            try:
                self._catch_up(first)
                return first
            except Exception as exc:  # re-raised unless a migration interrupted the catching up
                if not rt.is_comm_failure(exc):
                    raise
                cause = f"catching up with step {first}: {type(exc).__name__}: {str(exc)[:300]}"

    def _catch_up(self, first: int) -> None:
        """Bring this survivor back to where it stood, issuing the collectives the other members issue meanwhile.

        Without rollback (``first`` is the step after the last one counted) the members
        may have agreed to run an epilogue again, which this rank runs if it finished it.
        With a rollback of one step (buddy copies lose the step a rank committed last),
        the step is executed again here, without the Trainer (which counted it), and
        the epilogues that followed it are run again; the spare runs them as its own.
        A rank whose optimizer step failed where the others' completed resumes after it.
        """
        serial, self._rerun = self._rerun, -1
        counted = self._counted
        if first == counted + 1:
            # The runtime's step ended with the recovery: the next draw begins ``first``.
            self._number = first
            interrupted = self._in_epilogue
            if serial >= 0 and (interrupted is None or interrupted.serial != serial):
                steps = [s for s in (self._previous, self._step) if s is not None]
                for entry in (e for s in steps for e in s.epilogues if e.serial == serial):
                    self._repeat_epilogue(entry)
            return
        if first == counted + 2 and self._number == counted + 1:
            # This rank's optimizer step failed where the others' completed (ZeRO's post-step gather):
            # it received the step's result from a replica, and the Trainer counts the step now.
            self._number = first
            return
        step = self._step if self._step is not None and self._step.number == counted else self._previous
        if first != counted or step is None or step.number != counted:
            raise RuntimeError(
                f"torchpass: the migration resumes the job at step {first}, but the Trainer counted steps up to "
                f"{counted} and can execute again only the last one"
            )
        in_step = self._number == counted + 1
        self._begin_step(counted)
        self._execute(step, upto=len(step.calls))
        print(
            f"[torchpass] rank {self.runtime.rank}: step {counted} was executed again (the lost rank's copy of it did "
            "not survive); the Trainer counted it already",
            file=sys.stderr,
            flush=True,
        )
        for entry in step.epilogues:
            if entry is not self._in_epilogue:
                self._repeat_epilogue(entry)
        if in_step:
            # The step this rank stood in starts again once the one before has ended.
            self._number = counted
            self._end_step()

    def _repeat_epilogue(self, entry: _Epilogue) -> None:
        """Run a finished epilogue again for its collectives; this rank's state is put back after."""
        trainer = self.trainer
        replicated, log = self._replicated_now(with_log=False), list(trainer.state.log_history)
        tr_loss, flos = trainer._tr_loss, float(trainer.current_flos)
        self._restore(entry)
        _ORIGINALS["_maybe_log_save_evaluate"](trainer, trainer._tr_loss, *entry.args)
        self._set_replicated(replicated)
        trainer.state.log_history, trainer._tr_loss, trainer.current_flos = log, tr_loss, flos

    def _restore(self, entry: _Epilogue) -> None:
        self._set_replicated(entry.replicated)
        self.trainer.current_flos = entry.flos
        self.trainer._tr_loss = entry.tr_loss.clone()

    # ---- the epilogue --------------------------------------------------------------
    def epilogue(self, original: Callable[..., Any], tr_loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        trainer = self.trainer
        self._serial += 1
        if "learning_rate" in kwargs:
            args = (*args, kwargs["learning_rate"])
        entry = _Epilogue(self._serial, args, self._replicated_now(with_log=False), tr_loss.detach().clone(), float(trainer.current_flos))
        if self._step is not None:
            self._step.epilogues.append(entry)
        self._in_epilogue = entry
        try:
            while True:
                try:
                    return original(trainer, trainer._tr_loss, *args)
                except Exception as exc:  # re-raised unless a migration interrupted the epilogue
                    if not self.runtime.is_comm_failure(exc):
                        raise
                    self._interrupted_epilogue = entry.serial
                    try:
                        self._recover(f"between steps (the Trainer's epilogue): {type(exc).__name__}: {str(exc)[:300]}")
                    finally:
                        self._interrupted_epilogue = -1
                    self._restore(entry)
        finally:
            self._in_epilogue = None

    def _spare_epilogue(self) -> None:
        """On a spare whose members agreed to run an epilogue again: run it from its start, as the lost rank would."""
        serial, self._rerun = self._rerun, -1
        if serial < 0:
            return
        trainer = self.trainer
        _ORIGINALS["_maybe_log_save_evaluate"](trainer, trainer._tr_loss, *self._spare_args)

    # ---- LoopState -------------------------------------------------------------------
    def _replicated_now(self, *, with_log: bool) -> dict[str, Any]:
        trainer = self.trainer
        state = {f.name: getattr(trainer.state, f.name) for f in dataclasses.fields(trainer.state) if f.name != "log_history"}
        log = trainer.state.log_history
        return {
            "state": copy.deepcopy(state),
            "log": [_without_wall_clock(entry) for entry in log] if with_log else len(log),
            "control": dataclasses.asdict(trainer.control),
            "total_loss": trainer._total_loss_scalar,
            "last_logged": trainer._globalstep_last_logged,
            "serial": self._serial,
        }

    def _set_replicated(self, state: Mapping[str, Any]) -> None:
        trainer = self.trainer
        for name, value in state["state"].items():
            setattr(trainer.state, name, copy.deepcopy(value))
        if isinstance(state["log"], int):
            del trainer.state.log_history[state["log"]:]
        else:
            trainer.state.log_history = copy.deepcopy(state["log"])
        for name, value in state["control"].items():
            setattr(trainer.control, name, value)
        trainer._total_loss_scalar = state["total_loss"]
        trainer._globalstep_last_logged = state["last_logged"]
        self._serial = state["serial"]

    def replicated(self) -> dict[str, Any]:
        """The Trainer's replicated state at this rank's version: as an epilogue in progress began, else as it is."""
        entry = self._in_epilogue
        if entry is None:
            return {**self._replicated_now(with_log=True), "epilogue": None}
        state = {**entry.replicated, "log": [_without_wall_clock(e) for e in self.trainer.state.log_history[: entry.replicated["log"]]]}
        return {**state, "epilogue": {"serial": entry.serial, "args": _without_model(entry.args)}}

    def load_replicated(self, state: Mapping[str, Any]) -> None:
        if self._attached:
            return  # a survivor restored from a replica holds the same Trainer state already
        self._set_replicated(state)
        self._joined_epilogue = state["epilogue"]

    def local(self) -> dict[str, Any]:
        """The running loss and flos at this rank's version: before that version's epilogue (``serial``) or after it."""
        trainer = self.trainer
        tr_loss, flos, serial = trainer._tr_loss.detach().clone(), float(trainer.current_flos), -1
        if self._uncounted and self._loss is not None and self._step is not None:
            # The step's last backward: its loss and flops are not counted yet; the state of
            # this version is the Trainer's once they are (its own arithmetic: the bits match).
            if trainer.args.logging_nan_inf_filter and (torch.isnan(self._loss) or torch.isinf(self._loss)):
                tr_loss = tr_loss + tr_loss / (1 + trainer.state.global_step - trainer._globalstep_last_logged)
            else:
                tr_loss = tr_loss + self._loss
            flos += float(trainer.floating_point_ops(self._step.calls[-1][0]))
            serial = self._serial + 1
        elif self._in_epilogue is not None:
            tr_loss, flos, serial = self._in_epilogue.tr_loss.clone(), self._in_epilogue.flos, self._in_epilogue.serial
        return {
            "tr_loss": tr_loss,
            "flos": flos,
            "before_epilogue": serial,
            "last_logged": trainer._globalstep_last_logged,
            "total_flos": trainer.state.total_flos,
        }

    def load_local(self, state: Mapping[str, Any]) -> None:
        if self._attached:
            return  # a survivor put back at its step start: its running loss counts this step's micro-batches already
        self._joined = dict(state)

    def resume(self) -> None:
        """Agree whether an epilogue of the target version was cut short (the largest serial), and settle a spare."""
        counted = self._counted
        interrupted = self._interrupted_epilogue if self._attached and self.runtime.version == counted else -1
        flag = torch.tensor([interrupted], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._rerun = int(flag.item())
        joined = self._joined
        if joined is None:
            return
        trainer = self.trainer
        trainer._tr_loss = joined["tr_loss"].clone()
        trainer.current_flos = joined["flos"]
        if self._rerun >= 0:
            entry = self._joined_epilogue
            if entry is None or entry["serial"] != self._rerun or joined["before_epilogue"] != self._rerun:
                raise RuntimeError(
                    f"torchpass: the members run the Trainer's epilogue {self._rerun} again, but the state this spare "
                    f"received is from the start of epilogue {entry and entry['serial']} (replicated) and "
                    f"{joined['before_epilogue']} (the lost rank's own)"
                )
            self._spare_args = _with_model(entry["args"], self.engine)
        elif joined["before_epilogue"] >= 0:
            # The lost rank's state before its last epilogue, which the survivors finished:
            # what that epilogue reset is reset here too.
            if trainer._globalstep_last_logged != joined["last_logged"]:
                trainer._tr_loss = trainer._tr_loss - trainer._tr_loss
            if trainer.state.total_flos != joined["total_flos"]:
                trainer.current_flos = 0


def _without_wall_clock(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {key: copy.deepcopy(value) for key, value in entry.items() if not key.endswith(_WALL_CLOCK)}


def check_trainer_arguments(args: Any, config: "TorchPassConfig") -> None:
    """Refuse, naming the setting, what a Trainer cannot migrate with: ``args`` are its ``TrainingArguments``."""
    if args.include_num_input_tokens_seen not in ("no", False):
        raise ValueError(
            f"torchpass: TrainingArguments.include_num_input_tokens_seen={args.include_num_input_tokens_seen!r} "
            "counts tokens with a collective between micro-batches, which a migration cannot re-execute in "
            'place; set it to "no" (the default) to train with live migration'
        )
    if config.buddy_interval_steps != 1:
        raise ValueError(
            f'torchpass: "buddy_interval_steps": {config.buddy_interval_steps} can take a migration back several '
            "steps, which the Trainer has counted and logged; keep it at 1 under the Trainer"
        )


def _without_model(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """An epilogue's arguments without the model (a spare passes its own engine) and with a plain grad norm."""
    grad_norm, _model, *rest = args
    return (float(grad_norm) if isinstance(grad_norm, torch.Tensor) else grad_norm, *rest)


def _with_model(args: tuple[Any, ...], model: Any) -> tuple[Any, ...]:
    grad_norm, *rest = args
    return (grad_norm, model, *rest)


# ---- hooks on the Trainer class -----------------------------------------------------------
def _steps_of(trainer: Any) -> TrainerSteps | None:
    steps = getattr(trainer, _STEPS, None)
    if steps is not None:
        return steps
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    from .install import migration_of

    migration = migration_of(trainer.model_wrapped)
    if migration is None:
        return None
    steps = TrainerSteps(trainer, migration)
    setattr(trainer, _STEPS, steps)
    return steps


def _wrap(cls: type, name: str, through: Callable[..., Any]) -> None:
    original = getattr(cls, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        steps = _steps_of(self)
        if steps is None:
            return original(self, *args, **kwargs)
        return through(steps, original, *args, **kwargs)

    _ORIGINALS[name] = original
    method.__doc__ = original.__doc__
    setattr(cls, name, method)


def hook_trainer(module: Any) -> None:
    """Route the Trainer's training loop through :class:`TrainerSteps` for Trainers with a migratable engine."""
    cls = module.Trainer
    if getattr(cls, _HOOKED, False):
        return
    for name in ("_run_epoch", "get_batch_samples", "_get_num_items_in_batch", "training_step", "_maybe_log_save_evaluate"):
        if not hasattr(cls, name):
            raise RuntimeError(
                f"torchpass: this transformers version's Trainer has no {name}(); live migration under the Trainer "
                "needs transformers 5 (its Trainer runs each epoch in _run_epoch)"
            )
    _wrap(cls, "_run_epoch", lambda steps, original, **kwargs: steps.run_epoch(original, kwargs))
    _wrap(cls, "get_batch_samples", lambda steps, original, *a: steps.draw(original, *a))
    _wrap(cls, "_get_num_items_in_batch", lambda steps, original, *a: steps.count_items(original, *a))
    _wrap(cls, "training_step", lambda steps, original, model, inputs, items=None: steps.micro_batch(original, model, inputs, items))
    _wrap(cls, "_maybe_log_save_evaluate", lambda steps, original, tr_loss, *a, **k: steps.epilogue(original, tr_loss, *a, **k))
    load_rng_state = cls._load_rng_state

    def _load_rng_state(self: Any, checkpoint: Any) -> Any:
        if checkpoint == _IN_MEMORY:
            return None  # a spare's RNG came with its state
        return load_rng_state(self, checkpoint)

    cls._load_rng_state = _load_rng_state
    setattr(cls, _HOOKED, True)
