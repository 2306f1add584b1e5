"""The Hugging Face Trainer hooks (``adapters/deepspeed/hf_trainer.py``) without a job: version gate, refusals, pass-through.

The migrations themselves are end to end (``test_hf_trainer_e2e.py``).
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import transformers

from torchpass.adapters.deepspeed import hf_trainer
from torchpass.core.config import TorchPassConfig

_HOOKED_METHODS = ("_run_epoch", "get_batch_samples", "_get_num_items_in_batch", "training_step", "_maybe_log_save_evaluate", "_load_rng_state")


def _arguments(tmp_path: Path, **kwargs: object) -> "transformers.TrainingArguments":
    return transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True, **kwargs)


def test_a_trainer_without_run_epoch_is_refused_naming_the_version() -> None:
    class Trainer:  # transformers 4's: one _inner_training_loop, no _run_epoch
        def get_batch_samples(self) -> None: ...

    with pytest.raises(RuntimeError, match=r"no _run_epoch\(\).*transformers 5"):
        hf_trainer.hook_trainer(types.SimpleNamespace(Trainer=Trainer))


def test_settings_the_trainer_cannot_migrate_with_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="include_num_input_tokens_seen='all'"):
        hf_trainer.check_trainer_arguments(_arguments(tmp_path, include_num_input_tokens_seen="all"), TorchPassConfig())
    with pytest.raises(ValueError, match='"buddy_interval_steps": 4'):
        hf_trainer.check_trainer_arguments(_arguments(tmp_path), TorchPassConfig(buddy_interval_steps=4))
    hf_trainer.check_trainer_arguments(_arguments(tmp_path), TorchPassConfig())


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(tmp_path: Path) -> list[dict]:
    transformers.set_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    args = _arguments(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3, logging_steps=1, save_strategy="no", seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens())
    trainer.train()
    return [{k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k} for e in trainer.state.log_history]


def test_a_trainer_without_a_migratable_engine_runs_unchanged(tmp_path: Path) -> None:
    """The hooks are on the class; a Trainer without DeepSpeed (or without the block) trains exactly as before."""
    import transformers.trainer as module

    before = _train(tmp_path / "plain")
    originals = {name: module.Trainer.__dict__[name] for name in _HOOKED_METHODS}
    try:
        hf_trainer.hook_trainer(module)
        hf_trainer.hook_trainer(module)  # idempotent
        assert module.Trainer.__dict__["training_step"] is not originals["training_step"]
        assert _train(tmp_path / "hooked") == before
    finally:
        for name, method in originals.items():
            setattr(module.Trainer, name, method)
        delattr(module.Trainer, hf_trainer._HOOKED)
        hf_trainer._ORIGINALS.clear()
