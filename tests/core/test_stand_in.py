"""OutputShape: zeros with the structure of a forward's output, without keeping the output."""

from __future__ import annotations

import gc
import weakref
from collections import OrderedDict, namedtuple

import pytest
import torch

from torchpass.core.stand_in import OutputShape

Pair = namedtuple("Pair", "logits aux")


def test_nested_outputs_come_back_as_zeros_of_the_same_structure() -> None:
    out = {"loss": torch.tensor(2.5, requires_grad=True) * 2, "parts": [torch.ones(2, 3, dtype=torch.bfloat16), None, 7]}
    stand_in = OutputShape.of(out).zeros()
    assert set(stand_in) == {"loss", "parts"}
    assert stand_in["loss"].shape == () and stand_in["loss"].dtype == torch.float32 and stand_in["loss"].item() == 0.0
    assert not stand_in["loss"].requires_grad
    assert stand_in["parts"][0].dtype == torch.bfloat16 and stand_in["parts"][0].shape == (2, 3)
    assert stand_in["parts"][1:] == [None, 7]
    pair = OutputShape.of(Pair(torch.ones(4), OrderedDict(a=torch.ones(1)))).zeros()
    assert isinstance(pair, Pair) and isinstance(pair.aux, OrderedDict) and pair.logits.sum() == 0
    # A plain tensor, the common case (a module returning its loss).
    assert OutputShape.of(torch.ones(3)).zeros().tolist() == [0.0, 0.0, 0.0]


def test_the_output_itself_is_not_kept() -> None:
    big = torch.ones(1024)
    shape = OutputShape.of((big, big * 2))
    ref = weakref.ref(big)
    del big
    gc.collect()
    assert ref() is None
    assert shape.zeros()[1].shape == (1024,)


def test_an_output_it_cannot_rebuild_fails_naming_the_type() -> None:
    class Custom:
        pass

    shape = OutputShape.of((torch.ones(1), Custom()))
    with pytest.raises(TypeError, match="Custom"):
        shape.zeros()
