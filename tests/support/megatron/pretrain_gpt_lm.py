"""Test support: a Megatron-LM GPT pretraining script, written the way Megatron-LM's ``pretrain_gpt.py`` is.

Megatron-LM's own ``pretrain()`` -> ``train()`` -> ``train_step()`` runs it
(``megatron.training`` of megatron-core 0.17.0, see :mod:`.megatron_lm_wheel`):
a model provider building a ``GPTModel`` with the local transformer layer spec,
``forward_step`` with ``get_batch`` (``get_batch_on_this_tp_rank`` /
``get_batch_on_this_cp_rank``) and ``loss_func`` with the rerun state machine's
NaN/Inf checks, and a datasets provider over ``MockGPTDataset`` through
``BlendedMegatronDatasetBuilder``; ``pretrain`` goes through
``inprocess_restart.maybe_wrap_for_inprocess_restart`` as in 0.17. Nothing in it
imports torchpass: ``--torchpass`` on the command line is the whole integration.

What is added for the tests, and only observes:

* ``--test-workdir``: where the oracle files go (``progress/rank<r>``: the
  iteration being executed; ``logged_losses/rank<r>.jsonl``: the loss dict
  Megatron-LM's ``training_log`` receives per iteration, at full precision;
  ``out/rank<r>.json``: a SHA-256 per component of the final model, optimizer
  (with a distributed optimizer's shard of main params and moments), scheduler,
  counters and RNG tracker, and the PID; :mod:`.final_state`). The final state is read
  from what ``setup_model_and_optimizer`` and ``train`` returned, recorded by
  wrapping them.
* ``--test-step-sleep``: seconds of sleep in each forward step (faults land mid-step).
* the CPU shim (:mod:`.cpu_shim`) installed before anything is built.
"""

import time

_PROGRAM_START_TIME = time.time()

import json  # noqa: E402
import os  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import megatron.core  # noqa: E402,F401  (the shim patches megatron-core modules)
import torch  # noqa: E402

from tests.support.megatron import cpu_shim  # noqa: E402
from tests.support.megatron.final_state import optimizer_state, summary  # noqa: E402

cpu_shim.install()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.rerun_state_machine import get_rerun_state_machine  # noqa: E402
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker  # noqa: E402
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # noqa: E402
from megatron.training import get_args, get_timers, inprocess_restart, pretrain, print_rank_0  # noqa: E402
from megatron.training import set_startup_timestamps  # noqa: E402
from megatron.training import training as megatron_training  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args  # noqa: E402
from megatron.training.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank  # noqa: E402
from megatron.training.utils import is_first_or_last_pipeline_stage  # noqa: E402



def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Build the model."""
    args = get_args()
    print_rank_0("building GPT model ...")
    if config is None:
        config = core_transformer_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def get_batch(data_iterator, vp_stage=None):
    """Generate a batch."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    batch = get_batch_on_this_tp_rank(data_iterator)
    batch = get_batch_on_this_cp_rank(batch)
    return (batch[key] for key in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids"))


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """Loss function: the masked token losses' sum, the token count, and the report for logging."""
    args = get_args()
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    rerun_state_machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        rerun_state_machine.validate_result(
            result=loss,
            rejection_func=torch.isnan,
            message="found NaN in local forward loss calculation",
            tolerance=0.0,
            fatal=True,
        )
    return loss, num_tokens, report


def forward_step(data_iterator, model: GPTModel, return_schedule_plan: bool = False):
    """Forward training step."""
    args = get_args()
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    _TEST.progress(args.curr_iteration + 1)
    if args.test_step_sleep:
        time.sleep(args.test_step_sleep / max(1, args.global_batch_size // args.micro_batch_size))
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask, model=model)


def is_dataset_built_on_rank(vp_stage=None):
    return is_first_or_last_pipeline_stage(vp_stage) and parallel_state.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Build the train, validation and test datasets (mock data)."""
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        blend_per_split=None,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage), config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


def add_test_args(parser):
    group = parser.add_argument_group(title="test")
    group.add_argument("--test-workdir", required=True)
    group.add_argument("--test-step-sleep", type=float, default=0.0)
    return parser


class _TestRecorder:
    """What the tests read; it observes Megatron-LM's loop and changes nothing in it."""

    def __init__(self) -> None:
        self.built: tuple[Any, Any, Any] | None = None
        self.trained_to: int | None = None
        self.work: Path | None = None

    def install(self) -> None:
        setup, train, log = megatron_training.setup_model_and_optimizer, megatron_training.train, megatron_training.training_log

        def recording_setup(*args: Any, **kwargs: Any) -> Any:
            self.built = setup(*args, **kwargs)
            return self.built

        def recording_train(*args: Any, **kwargs: Any) -> Any:
            result = train(*args, **kwargs)
            self.trained_to = result[0]
            return result

        def recording_log(loss_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            iteration = args[2] if len(args) > 2 else kwargs["iteration"]
            if loss_dict:
                losses = {key: float(value) for key, value in loss_dict.items()}
                self._append("logged_losses", {"step": iteration, "losses": losses, "pid": os.getpid()})
            return log(loss_dict, *args, **kwargs)

        megatron_training.setup_model_and_optimizer = recording_setup
        megatron_training.train = recording_train
        megatron_training.training_log = recording_log

    def _folder(self, name: str) -> Path:
        if self.work is None:
            self.work = Path(get_args().test_workdir)
        folder = self.work / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _append(self, name: str, record: dict[str, Any]) -> None:
        with open(self._folder(name) / f"rank{torch.distributed.get_rank()}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def progress(self, iteration: int) -> None:
        (self._folder("progress") / f"rank{torch.distributed.get_rank()}").write_text(str(iteration))

    def finish(self) -> None:
        assert self.built is not None, "setup_model_and_optimizer never ran"
        args = get_args()
        model, optimizer, scheduler = self.built
        final = {
            "model": {f"chunk{i}": chunk.state_dict() for i, chunk in enumerate(model)},
            "optimizer": optimizer_state(optimizer),
            "scheduler": scheduler.state_dict(),
            "progress": {
                "iteration": self.trained_to,
                "consumed_train_samples": args.consumed_train_samples,
            },
            "rng_tracker": get_cuda_rng_tracker().get_states(),
        }
        out = {
            **summary(final),
            "pid": os.getpid(),
        }
        (self._folder("out") / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(out))


_TEST = _TestRecorder()


if __name__ == "__main__":
    _MAIN_ENTRY_TIME = time.time()
    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=_MAIN_ENTRY_TIME)
    train_valid_test_datasets_provider.is_distributed = True
    _TEST.install()
    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults={"tokenizer_type": "NullTokenizer"},
        extra_args_provider=add_test_args,
        store=store,
    )
    _TEST.finish()
