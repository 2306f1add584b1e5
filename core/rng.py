"""RNG streams of one process: capture, restore and digest.

Dropout masks and data augmentation draw from Python's ``random``, NumPy's
global generator and torch's default generators. A re-executed step must draw
exactly what the interrupted one drew, and a spare must continue the stream of
the rank it replaces, so all of them travel with a rank's small state.

Capture runs twice per step on the training thread and its result is
serialized once per step off it, so every stream is kept as plain bytes:
pickling 625 Python ints costs ~10x more than their bytes, and a torch tensor
~5x more than its bytes (50 us against 10 us for the 5 KB CPU generator).

Python's and NumPy's global generators are read from memory where that is
proven exact. Their own accessors build the 624-word Mersenne-Twister key one
element at a time: NumPy's legacy ``get_state`` in a Python-level loop (88 us of
a 151 us capture on this machine), Python's ``getstate`` as a tuple of 625 ints
(19 us), and a capture runs twice per step. In both the words lie contiguous in
the generator's C state. Each layout is checked once per process against the
accessor on a private generator (:func:`_numpy_layout`, :func:`_python_layout`);
where any check fails, the accessor is used.

CUDA: only the generator of the *current* device travels. A spare that takes
over rank r runs on its own GPU (see :mod:`torchpass.core.devices`), so the
state rank r's device generator had must land on the device the spare's
framework selected with ``set_device``, not on rank r's device index.
"""

from __future__ import annotations

import _random
import array
import ctypes
import functools
import hashlib
import pickle
import random
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng", "rng_digest"]


def capture_rng() -> dict[str, Any]:
    """The state of every global generator (a few KB of plain bytes; copies, safe to keep)."""
    state: dict[str, Any] = {
        "python": _python_state(random.getstate.__self__),
        "numpy": _numpy_state(np.random.mtrand._rand),
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return state


def _python_state(generator: random.Random) -> tuple[int, bytes, float | None]:
    """``generator.getstate()`` with the words as bytes (``array("Q")`` of key then index): read from memory
    when :func:`_python_layout` proved it exact."""
    offset = _python_layout()
    if offset is None or type(generator) is not random.Random:
        version, internal, gauss = generator.getstate()
        return version, _python_words(internal), gauss
    raw = ctypes.string_at(id(generator) + offset, 4 + _MT_WORDS * 4)
    words = np.empty(_MT_WORDS + 1, dtype=np.uint64)
    words[:_MT_WORDS] = np.frombuffer(raw, dtype=np.uint32, count=_MT_WORDS, offset=4)
    words[_MT_WORDS] = struct.unpack_from("i", raw)[0]
    return generator.VERSION, words.tobytes(), generator.gauss_next


@functools.cache
def _python_layout() -> int | None:
    """Offset in a ``random.Random`` of CPython's ``int index`` (the key's 624 words follow it), proven
    against ``getstate`` on a private generator in several states; None if unproven."""
    probe = random.Random(20261207)
    size = _random.Random.__basicsize__
    internal = probe.getstate()[1]
    found = ctypes.string_at(id(probe), size).find(struct.pack(f"{_MT_WORDS}I", *internal[:_MT_WORDS]))
    if found < 4 or found + _MT_WORDS * 4 > size:
        return None
    offset = found - 4
    for move in (lambda: probe.random(), lambda: probe.getrandbits(32 * 700), lambda: probe.seed(7), lambda: probe.gauss(0, 1)):
        move()
        version, internal, gauss = probe.getstate()
        raw = ctypes.string_at(id(probe) + offset, 4 + _MT_WORDS * 4)
        if array.array("I", raw[4:]).tolist() + [struct.unpack_from("i", raw)[0]] != list(internal):
            return None
    return offset


def _python_words(internal: tuple[int, ...]) -> bytes:
    """Python's Mersenne-Twister words as bytes, reused while the stream has not moved (a tuple compare)."""
    global _last_python
    if _last_python is None or _last_python[0] != internal:
        _last_python = (internal, array.array("Q", internal).tobytes())
    return _last_python[1]


_last_python: tuple[tuple[int, ...], bytes] | None = None

_MT_WORDS = 624
"""Words of a Mersenne-Twister key (numpy's ``RK_STATE_LEN``, CPython's ``N``)."""
_MT_STATE_BYTES = _MT_WORDS * 4 + 4
"""numpy's ``mt19937_state``: the key's uint32 words, then ``int pos``."""


@dataclass(frozen=True)
class _AugmentedLayout:
    """Where a legacy ``RandomState`` keeps its cached Gaussian (``aug_bitgen_t``), as byte offsets in the object."""

    has_gauss: int
    gauss: int


def _numpy_state(generator: np.random.RandomState) -> tuple[str, bytes, int, int, float]:
    """``generator.get_state()`` with the key as bytes: read from memory when :func:`_numpy_layout` proved it exact."""
    layout = _numpy_layout()
    bits = generator._bit_generator
    if layout is None or type(bits) is not np.random.MT19937:
        kind, key, pos, has_gauss, cached = generator.get_state()
        return kind, key.tobytes(), pos, has_gauss, cached
    return _numpy_read(generator, layout)


def _numpy_read(generator: np.random.RandomState, layout: _AugmentedLayout) -> tuple[str, bytes, int, int, float]:
    """The legacy state tuple, read from the bit generator's C state and the object's cached Gaussian."""
    raw = ctypes.string_at(generator._bit_generator.ctypes.state_address, _MT_STATE_BYTES)
    aug = ctypes.string_at(id(generator), layout.gauss + 8)
    (pos,) = struct.unpack_from("i", raw, _MT_WORDS * 4)
    (has_gauss,) = struct.unpack_from("i", aug, layout.has_gauss)
    (cached,) = struct.unpack_from("d", aug, layout.gauss)
    return "MT19937", raw[: _MT_WORDS * 4], pos, has_gauss, cached


@functools.cache
def _numpy_layout() -> _AugmentedLayout | None:
    """Find and verify, on a private generator, where a legacy ``RandomState`` keeps its state; None if unproven.

    The bit generator's C state is its key words then ``pos`` (numpy's ``mt19937_state``); the Gaussian a
    ``standard_normal`` draw cached lives in the ``RandomState`` object itself, found by setting it to two
    known values and diffing the object's bytes. Then the memory read must equal ``get_state`` exactly, for
    states with and without a cached Gaussian, or it is not used.
    """
    probe = np.random.RandomState(20261207)
    if type(probe) is not type(np.random.mtrand._rand) or type(probe._bit_generator) is not np.random.MT19937:
        return None
    size = type(probe).__basicsize__
    kind, key, pos, _, _ = probe.get_state()

    def image(has_gauss: int, gauss: float) -> bytes:
        probe.set_state((kind, key, pos, has_gauss, gauss))
        return ctypes.string_at(id(probe), size)

    first, second = 1.2345678912345678e-123, -9.87654321987654e200
    flag = [i for i, (a, b) in enumerate(zip(image(1, first), image(0, first))) if a != b]
    moved = [i for i, (a, b) in enumerate(zip(image(1, first), image(1, second))) if a != b]
    if len(flag) != 1 or not moved or moved[0] % 8 or moved[-1] - moved[0] >= 8:
        return None
    layout = _AugmentedLayout(has_gauss=flag[0] - flag[0] % 4, gauss=moved[0])
    if layout.gauss + 8 > size:
        return None
    for draw in (lambda: probe.random_sample(700), lambda: probe.standard_normal(3), lambda: probe.standard_normal(2)):
        draw()
        kind, key, pos, has_gauss, cached = probe.get_state()
        expected = (kind, key.tobytes(), pos, has_gauss, cached)
        read = _numpy_read(probe, layout)
        if read != expected or struct.pack("d", read[4]) != struct.pack("d", expected[4]):
            return None
    return layout


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
