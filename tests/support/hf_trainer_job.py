"""The Hugging Face Trainer job of the end-to-end tests: DeepSpeed under ``transformers.Trainer``, unchanged.

Written the way Hugging Face's DeepSpeed guide writes a Trainer job: a
``TrainingArguments(deepspeed="ds_config.json")`` whose JSON config uses
``"auto"`` values and carries the ``"torchpass"`` block, a tiny causal LM built
from a config (no download), a dataset made here, ``trainer.train()``. CPU:
DeepSpeed runs under the Trainer there with ``ddp_backend="gloo"``.

It imports nothing from torchpass. A ``TrainerCallback`` (user code, as any
job may have) writes ``progress/rank<r>`` (the step being executed) for the
harness to time faults. At the end each rank writes ``out/rank<r>.json``: a
SHA-256 of its model parameters, its fp32 partition (ZeRO 1-2) and Adam moments, the
engine's counters and the scheduler, the Trainer's ``log_history`` (the logged
losses, learning rates, gradient norms) and the PID.
"""

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

VOCAB = 64
SEQ = 16


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same on every rank (made from a fixed seed)."""

    def __init__(self, samples: int):
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (samples, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Progress(TrainerCallback):
    """Writes the step being executed for the harness; sleeps after each step so faults can be timed."""

    def __init__(self, path: Path, step_sleep: float):
        self.path = path
        self.step_sleep = step_sleep

    def on_step_begin(self, args, state, control, **kwargs):
        self.path.write_text(str(state.global_step + 1))

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.step_sleep)


def logged(trainer: Trainer) -> list[dict]:
    """The Trainer's log history without the timings (``train_runtime``, throughputs), which differ run to run."""
    timing = ("train_runtime", "_per_second")
    return [{k: v for k, v in entry.items() if not k.endswith(timing)} for entry in trainer.state.log_history]


def digest(trainer: Trainer) -> str:
    engine = trainer.model_wrapped
    h = hashlib.sha256()
    for name, p in trainer.model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    optimizer = engine.optimizer
    if hasattr(optimizer, "single_partition_of_fp32_groups"):  # ZeRO 1-2: this rank's fp32 partitions
        masters, inner = optimizer.single_partition_of_fp32_groups, optimizer.optimizer
    else:  # ZeRO-0: the torch optimizer over the parameters themselves
        masters, inner = [p for group in optimizer.param_groups for p in group["params"]], optimizer
    for master in masters:
        h.update(master.detach().contiguous().numpy().tobytes())
        for value in inner.state[master].values():
            h.update(value.detach().contiguous().numpy().tobytes() if torch.is_tensor(value) else repr(value).encode())
    h.update(repr((engine.global_steps, engine.global_samples, engine.micro_steps)).encode())
    h.update(repr(engine.lr_scheduler.state_dict()).encode())
    h.update(json.dumps(logged(trainer), sort_keys=True).encode())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", required=True)
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--epochs", type=float, default=3)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--no-block", action="store_true")
    args = p.parse_args()
    work = Path(args.workdir)
    for sub in ("progress", "out"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])

    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": args.zero},
        "steps_per_print": 10**6,
    }
    if not args.no_block:
        config["torchpass"] = {"enabled": True}
    ds_config = work / "out" / f"ds_config_rank{rank}.json"
    ds_config.write_text(json.dumps(config))

    training_args = TrainingArguments(
        output_dir=str(work / "out" / "trainer"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=args.epochs,
        learning_rate=5e-3,
        weight_decay=0.01,
        warmup_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=7,
        deepspeed=str(ds_config),
        ddp_backend="gloo",
        disable_tqdm=True,
    )
    set_seed(training_args.seed)  # as Hugging Face's example scripts do before building the model
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=Tokens(args.samples),
        callbacks=[Progress(work / "progress" / f"rank{rank}", args.step_sleep)],
    )
    trainer.train()
    (work / "out" / f"rank{rank}.json").write_text(
        json.dumps({"digest": digest(trainer), "pid": os.getpid(), "log_history": logged(trainer)})
    )


if __name__ == "__main__":
    main()
