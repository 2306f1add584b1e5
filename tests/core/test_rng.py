"""RNG capture: Python's and NumPy's global generators read from memory equal their ``getstate``/``get_state``,
bit for bit, in every state."""

from __future__ import annotations

import array
import random
import struct

import numpy as np
import pytest

from torchpass.core import rng


def _by_get_state(generator: np.random.RandomState) -> tuple:
    kind, key, pos, has_gauss, cached = generator.get_state()
    return kind, key.tobytes(), pos, has_gauss, cached


def _same(a: tuple, b: tuple) -> bool:
    # The cached Gaussian compared as bits: -0.0 and NaN payloads are told apart.
    return a[:4] == b[:4] and struct.pack("d", a[4]) == struct.pack("d", b[4])


def test_the_layout_is_proven_on_this_numpy() -> None:
    assert rng._numpy_layout() is not None


@pytest.mark.parametrize(
    "move",
    [
        lambda g: None,
        lambda g: g.random_sample(5),
        lambda g: g.standard_normal(1),  # leaves a Gaussian cached: has_gauss 1
        lambda g: g.standard_normal(2),
        lambda g: g.random_sample(700),  # past the key's 624 words: a new key
        lambda g: g.seed(7),
        lambda g: g.randint(0, 10, size=3),
    ],
    ids=["fresh", "uniform", "odd-normals", "even-normals", "regenerated-key", "reseeded", "integers"],
)
def test_a_capture_reads_numpys_state_exactly(move) -> None:
    generator = np.random.RandomState(3)
    move(generator)
    assert _same(rng._numpy_state(generator), _by_get_state(generator))


def test_a_cached_gaussian_set_back_without_moving_the_key_is_seen() -> None:
    """The case a change check on the key alone would miss: ``set_state`` restores the cached Gaussian that a
    draw consumed, key and position unchanged."""
    generator = np.random.RandomState(5)
    generator.standard_normal(1)
    saved = generator.get_state()
    generator.standard_normal(1)  # consumes the cached value: the key does not move
    before = rng._numpy_state(generator)
    generator.set_state(saved)
    after = rng._numpy_state(generator)
    assert before[:3] == after[:3] and (before[3], after[3]) == (0, 1)
    assert _same(after, _by_get_state(generator))


@pytest.mark.parametrize("cached", [0.0, -0.0, float("nan"), 1e-310])
def test_unusual_cached_gaussians_travel_as_bits(cached: float) -> None:
    generator = np.random.RandomState(11)
    kind, key, pos, _, _ = generator.get_state()
    generator.set_state((kind, key, pos, 1, cached))
    assert _same(rng._numpy_state(generator), _by_get_state(generator))


def test_the_global_generator_restores_to_the_same_draws() -> None:
    np.random.seed(1)
    np.random.standard_normal(3)
    state = rng.capture_rng()
    expected = (np.random.standard_normal(5), np.random.random_sample(800))
    np.random.seed(99)
    rng.restore_rng(state)
    drawn = (np.random.standard_normal(5), np.random.random_sample(800))
    assert all(np.array_equal(a, b) for a, b in zip(expected, drawn))


def test_an_unproven_layout_falls_back_to_get_state(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = np.random.RandomState(13)
    generator.standard_normal(1)
    fast = rng._numpy_state(generator)
    monkeypatch.setattr(rng, "_numpy_layout", lambda: None)
    assert _same(rng._numpy_state(generator), fast)


def _by_getstate(generator: random.Random) -> tuple:
    version, internal, gauss = generator.getstate()
    return version, array.array("Q", internal).tobytes(), gauss


def test_the_python_layout_is_proven_on_this_interpreter() -> None:
    assert rng._python_layout() is not None


@pytest.mark.parametrize(
    "move",
    [
        lambda g: None,
        lambda g: g.random(),
        lambda g: g.gauss(0.0, 1.0),  # leaves gauss_next set
        lambda g: g.getrandbits(32 * 700),  # past the key's 624 words: a new key
        lambda g: g.seed(7),
        lambda g: g.shuffle(list(range(10))),
    ],
    ids=["fresh", "random", "gauss", "regenerated-key", "reseeded", "shuffle"],
)
def test_a_capture_reads_pythons_state_exactly(move) -> None:
    generator = random.Random(3)
    move(generator)
    assert rng._python_state(generator) == _by_getstate(generator)


def test_the_python_global_generator_restores_to_the_same_draws() -> None:
    random.seed(1)
    random.gauss(0.0, 1.0)
    state = rng.capture_rng()
    expected = [random.gauss(0.0, 1.0), random.random(), random.getrandbits(40000)]
    random.seed(99)
    rng.restore_rng(state)
    assert [random.gauss(0.0, 1.0), random.random(), random.getrandbits(40000)] == expected


def test_an_unproven_python_layout_or_a_subclass_falls_back_to_getstate(monkeypatch: pytest.MonkeyPatch) -> None:
    class Seeded(random.Random):
        pass

    subclass = Seeded(5)
    assert rng._python_state(subclass) == _by_getstate(subclass)
    generator = random.Random(13)
    fast = rng._python_state(generator)
    monkeypatch.setattr(rng, "_python_layout", lambda: None)
    assert rng._python_state(generator) == fast
