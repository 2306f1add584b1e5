"""Test support: the final-state digests the Megatron jobs of the tests write (the bitwise oracle).

Leaves only: :func:`digest` hashes every tensor's dtype, shape and bytes and every
other value's repr, by path, so two states with equal values digest equal
whichever objects they share (a loaded optimizer's param groups hold copies
where a fresh one shares its defaults). :func:`optimizer_state` reads what a
Megatron optimizer holds, a distributed optimizer's shard of main params and
moments included (its ``state_dict()`` leaves those out).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

__all__ = ["digest", "optimizer_state", "summary"]


def digest(state: Any) -> str:
    """SHA-256 over every leaf of ``state`` in order: its path, and a tensor's dtype, shape and bytes or a value's repr."""
    h = hashlib.sha256()

    def visit(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                visit(item, f"{path}/{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(item, f"{path}/{i}")
        elif isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"{path}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(f"{path}|{value!r}|".encode())

    visit(state, "")
    return h.hexdigest()


def optimizer_state(optimizer: Any) -> Any:
    """A torch optimizer's ``state_dict()``; per part of a Megatron optimizer, its ``state_dict()`` and any shard."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer.state_dict()
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [
        {
            "common": part.state_dict(),
            "shard": part.get_parameter_state_dp_reshardable() if isinstance(part, DistributedOptimizer) else None,
        }
        for part in parts
    ]


def summary(final: dict[str, Any]) -> dict[str, Any]:
    """``{"digest", "components"}``: one digest per component of ``final``, and one over those."""
    components = {name: digest(value) for name, value in final.items()}
    return {"digest": hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest(), "components": components}
