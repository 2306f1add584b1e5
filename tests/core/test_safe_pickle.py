"""safe_pickle: exact round trips of what torchpass moves, and no code run for anything else."""

from __future__ import annotations

import os
import pickle
import random
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from torchpass.core import safe_pickle
from torchpass.core.rng import capture_rng, restore_rng


class _Canary:
    """A pickle that creates a file when loaded by a plain unpickler."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_small_state_round_trips_bit_for_bit():
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    record = {
        "rng": capture_rng(),
        "data": {"position": 17, "epoch": 2},
        "buffers": OrderedDict(running_mean=torch.randn(4), num_batches_tracked=torch.tensor(9)),
        "bf16": torch.randn(3, 2).to(torch.bfloat16),
        "empty": torch.empty(0, 3),
        "shape": torch.Size([2, 3]),
        "dtype": torch.float16,
        "scalar": np.float64(0.25),
        "set": {1, 2},
    }
    back = safe_pickle.loads(safe_pickle.dumps(record))
    assert type(back["buffers"]) is OrderedDict
    for name, t in record["buffers"].items():
        assert torch.equal(back["buffers"][name], t) and back["buffers"][name].dtype == t.dtype
    assert back["bf16"].dtype == torch.bfloat16 and torch.equal(back["bf16"], record["bf16"])
    assert back["empty"].shape == (0, 3)
    assert back["shape"] == torch.Size([2, 3]) and back["dtype"] is torch.float16
    assert back["scalar"] == np.float64(0.25) and back["scalar"].dtype == np.float64
    assert back["set"] == {1, 2} and back["data"] == record["data"]
    assert back["rng"] == record["rng"]  # plain bytes and scalars (core/rng.py)
    restore_rng(back["rng"])  # a loaded state restores the streams
    again = (np.random.rand(), torch.rand(1).item(), random.random())
    restore_rng(record["rng"])
    assert again == (np.random.rand(), torch.rand(1).item(), random.random())


def test_a_pickle_that_would_run_code_is_refused_before_anything_runs(tmp_path):
    canary = tmp_path / "canary"
    hostile = pickle.dumps({"state": _Canary(canary)})
    with pytest.raises(safe_pickle.ForbiddenObject, match="posix.system|os.system"):
        safe_pickle.loads(hostile)
    assert not canary.exists()


@pytest.mark.parametrize("pid", [("exec", "print(1)"), "tensor", ("tensor", "not_a_dtype", (1,), b"\0\0\0\0")])
def test_unknown_persistent_ids_are_refused(pid):
    class _P(pickle.Pickler):
        def persistent_id(self, obj):
            return pid if obj == "x" else None

    import io

    buf = io.BytesIO()
    _P(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(["x"])
    with pytest.raises(safe_pickle.ForbiddenObject):
        safe_pickle.loads(buf.getvalue())


def test_torch_globals_other_than_dtypes_are_refused():
    hostile = pickle.dumps(torch.load)  # a function: loading it by name is where torch.load-based attacks start
    with pytest.raises(safe_pickle.ForbiddenObject, match="torch.serialization.load|torch.load"):
        safe_pickle.loads(hostile)
