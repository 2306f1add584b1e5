"""RNG streams of one process: capture, restore and digest.

Dropout masks and data augmentation draw from Python's ``random``, NumPy's
global generator and torch's default generators. A re-executed step must draw
exactly what the interrupted one drew, and a spare must continue the stream of
the rank it replaces, so all of them travel with a rank's small state.

Capture runs twice per step on the training thread, so it keeps Python's
Mersenne-Twister state as bytes (pickling 625 Python ints costs ~10x more).
"""

from __future__ import annotations

import array
import hashlib
import pickle
import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng", "rng_digest"]


def capture_rng() -> dict[str, Any]:
    """The state of every global generator (a few KB; copies, safe to keep)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": (version, array.array("Q", internal).tobytes(), gauss),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(array.array("Q", internal)), gauss))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_digest(state: dict[str, Any]) -> str:
    """Equal digests mean equal streams: used to tell whether replicas share their RNG."""
    h = hashlib.sha256()
    h.update(pickle.dumps(state["python"]))
    h.update(pickle.dumps(state["numpy"]))
    h.update(state["torch"].numpy().tobytes())
    for t in state.get("cuda", []):
        h.update(t.numpy().tobytes())
    if "provider" in state:
        h.update(pickle.dumps(state["provider"]))
    return h.hexdigest()[:32]
