"""The benchmark's training job, shared by every strategy: a GPT-like model, its synthetic data, its step log.

Every strategy's job script (``bench/jobs/``) builds the same model with the same
seed and trains on the same token stream: the batch of a rank at a step is a
pure function of ``(step, rank)`` (see :func:`slot`), so a restarted or
replacement process reads exactly the data the failed one would have.

Each rank appends JSON lines to ``<log-dir>/rank<r>.jsonl`` (a process that
takes over rank r appends to the same file): ``start`` when the process began,
``ready`` when it is about to train (after any checkpoint load), ``step`` per
completed optimizer step, ``saved`` per checkpoint. The driver reads progress
from these files and derives every figure from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .config import WorkloadConfig

__all__ = [
    "GPT",
    "build_model",
    "parameter_count",
    "state_bytes",
    "batch",
    "slot",
    "RankBatches",
    "StepLog",
    "parse_job_args",
    "workload_json",
    "loss_of",
]


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a 4x MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a head tied to the token embedding."""

    def __init__(self, cfg: WorkloadConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()


def build_model(cfg: WorkloadConfig) -> GPT:
    torch.manual_seed(cfg.seed)
    return GPT(cfg)


def parameter_count(cfg: WorkloadConfig) -> int:
    """Parameters of the model ``cfg`` describes (without building it)."""
    d, L = cfg.d_model, cfg.layers
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return cfg.vocab * d + cfg.seq_len * d + L * block + 2 * d


def slot(step: int, rank: int, world: int) -> int:
    """Index of the batch rank ``rank`` trains on at ``step`` (steps count from 1)."""
    return (step - 1) * world + rank


def batch(cfg: WorkloadConfig, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number ``index`` of the synthetic token stream: inputs and next-token targets."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + index)
    tokens = torch.randint(cfg.vocab, (cfg.batch_per_rank, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class RankBatches:
    """One rank's batches for steps 1..steps, re-iterable (torchpass replays and fast-forwards through it)."""

    def __init__(self, cfg: WorkloadConfig, rank: int, world: int):
        self.cfg, self.rank, self.world = cfg, rank, world

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (batch(self.cfg, slot(s, self.rank, self.world)) for s in range(1, self.cfg.steps + 1))

    def __len__(self) -> int:
        return self.cfg.steps


class StepLog:
    """Appends one rank's events to ``<log_dir>/rank<rank>.jsonl``, line-buffered so the driver sees them at once."""

    def __init__(self, log_dir: str | Path, rank: int, t_start: float):
        self._file = open(Path(log_dir) / f"rank{rank}.jsonl", "a", buffering=1)
        self.rank = rank
        self.event("start", t=t_start)

    def event(self, kind: str, **fields: Any) -> None:
        record = {"kind": kind, "t": time.time(), "pid": os.getpid(), "rank": self.rank, **fields}
        self._file.write(json.dumps(record) + "\n")

    def step(self, step: int, seconds: float, samples: int, **fields: Any) -> None:
        self.event("step", step=step, seconds=seconds, samples=samples, **fields)


def parse_job_args(
    description: str, checkpointing: bool = False, configure: Callable[[argparse.ArgumentParser], object] | None = None
) -> argparse.Namespace:
    """A job script's arguments: ``--workload`` (the config as JSON), ``--log-dir``, with ``checkpointing``
    ``--checkpoint-dir`` and ``--checkpoint-every``, and whatever ``configure`` adds to the parser."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--workload", required=True, help="WorkloadConfig as JSON")
    p.add_argument("--log-dir", required=True)
    if checkpointing:
        p.add_argument("--checkpoint-dir", required=True)
        p.add_argument("--checkpoint-every", type=int, required=True, help="K: save after every K-th step")
    if configure is not None:
        configure(p)
    args = p.parse_args()
    args.workload = WorkloadConfig(**json.loads(args.workload))
    torch.set_num_threads(args.workload.threads)
    return args


def workload_json(cfg: WorkloadConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg))


def state_bytes(cfg: WorkloadConfig) -> int:
    """fp32 parameters plus AdamW's two moments: what one rank holds."""
    return parameter_count(cfg) * 4 * 3
