"""A module's persistent buffers as per-rank state.

BatchNorm's running statistics are the common case: every rank's forward
updates them from its own batch, so replicas of the parameters do not hold
the same buffers, and nothing in data-parallel training makes them so
(DeepSpeed never syncs them; DDP's ``broadcast_buffers`` overwrites them with
rank 0's at each forward, but the final forward's update is per rank and
``broadcast_buffers=False`` syncs nothing). Treated as part of the replicated
model state, a spare would copy another rank's statistics and the replicas'
fingerprints would disagree. So they travel with the rank's small state:
mirrored at step start and when the backward begins, in snapshots and buddy
copies, restored on a survivor that re-executes a step (its interrupted
forward updated them once already) and handed to whoever takes the rank over.

Every persistent buffer is classed this way, not only those a forward
changes: which ones change cannot be known before the first step, and the
state classes must be fixed before it. The cost is bounded by the buffers'
bytes (a few hundred KB for a ResNet-50), copied twice per step.
"""

from __future__ import annotations

from typing import Mapping

import torch

__all__ = ["ModuleBuffers"]


class ModuleBuffers:
    """The persistent buffers of a module: those its ``state_dict()`` saves, by ``state_dict`` key.

    Found once: modules update their buffers in place (a model that rebinds a
    buffer attribute during training is not supported).
    """

    def __init__(self, module: torch.nn.Module):
        self._live: dict[str, torch.Tensor] = {}
        for prefix, sub in module.named_modules():
            for name, buffer in sub._buffers.items():
                if buffer is not None and name not in sub._non_persistent_buffers_set:
                    self._live[f"{prefix}.{name}" if prefix else name] = buffer

    def __bool__(self) -> bool:
        return bool(self._live)

    def names(self) -> frozenset[str]:
        return frozenset(self._live)

    def copy(self) -> dict[str, torch.Tensor]:
        """Copies of the buffers' current values.

        Copies, not the live tensors: the mirror pickles records off the training
        thread while the next forward updates the buffers in place. Host copies:
        the small state is pickled (CUDA buffers are copied to the host here).
        """
        return {name: t.detach().to("cpu", copy=True) for name, t in self._live.items()}

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state`` into the live buffers; every buffer must be in it."""
        missing = sorted(set(self._live) - set(state))
        if missing:
            raise KeyError(f"torchpass: the received buffers lack {missing[:5]} ({len(missing)} missing)")
        for name, live in self._live.items():
            with torch.no_grad():
                live.copy_(state[name])
