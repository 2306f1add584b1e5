"""RNG streams of one process: capture, restore and digest.

Dropout masks and data augmentation draw from Python's ``random``, NumPy's
global generator and torch's default generators. A re-executed step must draw
exactly what the interrupted one drew, and a spare must continue the stream of
the rank it replaces, so all of them travel with a rank's small state.

Capture runs twice per step on the training thread and its result is
serialized once per step off it, so every stream is kept as plain bytes:
pickling 625 Python ints costs ~10x more than their bytes, and a torch tensor
~5x more than its bytes (50 us against 10 us for the 5 KB CPU generator).

CUDA: only the generator of the *current* device travels. A spare that takes
over rank r runs on its own GPU (see :mod:`torchpass.core.devices`), so the
state rank r's device generator had must land on the device the spare's
framework selected with ``set_device``, not on rank r's device index.
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
    """The state of every global generator (a few KB of plain bytes; copies, safe to keep)."""
    version, internal, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": (version, _python_words(internal), gauss),
        "numpy": (kind, key.tobytes(), pos, has_gauss, cached),
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return state


def _python_words(internal: tuple[int, ...]) -> bytes:
    """Python's Mersenne-Twister words as bytes, reused while the stream has not moved (a tuple compare)."""
    global _last_python
    if _last_python is None or _last_python[0] != internal:
        _last_python = (internal, array.array("Q", internal).tobytes())
    return _last_python[1]


_last_python: tuple[tuple[int, ...], bytes] | None = None


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(array.array("Q", internal)), gauss))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.frombuffer(key, dtype=np.uint32).copy(), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "cuda" in state:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8))


def rng_digest(state: dict[str, Any]) -> str:
    """Equal digests mean equal streams: used to tell whether replicas share their RNG."""
    h = hashlib.sha256()
    h.update(pickle.dumps(state["python"]))
    h.update(pickle.dumps(state["numpy"]))
    h.update(state["torch"])
    h.update(state.get("cuda", b""))
    if "provider" in state:
        h.update(pickle.dumps(state["provider"]))
    return h.hexdigest()[:32]
