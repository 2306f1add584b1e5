"""What an interrupted forward call returns to a loop that cannot be told to start the step again.

An adapter that owns an unchanged training loop's step boundaries through the
loop's data (DeepSpeed's ``for batch in loader: loss = engine(batch) ...``)
cannot make the loop jump back when a collective fails inside a forward: the
call must return, and the loop's next lines (a loss computed from the output,
``backward``, ``step``, logging) run before it draws its next micro-batch,
where the step starts again. Those lines must run without error and without
effect; the adapter makes ``backward`` and ``step`` return at once, and the
forward returns a *stand-in*: zeros with the structure, shapes, dtypes and
devices of the last output the forward returned (nested tuples, lists, dicts,
dataclass-like model outputs, as ``torch.utils._pytree`` flattens them).

:class:`OutputShape` keeps only that description, never the output itself
(a language model's logits can take gigabytes), so remembering it costs a
flatten per forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["OutputShape"]


@dataclass(frozen=True)
class _TensorLeaf:
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class _Opaque:
    """A leaf that is neither a tensor nor a plain value: only its type is kept (never the object)."""

    type_name: str


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _describe(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return _TensorLeaf(leaf.shape, leaf.dtype, leaf.device)
    if isinstance(leaf, _PLAIN):
        return leaf
    return _Opaque(f"{type(leaf).__module__}.{type(leaf).__qualname__}")


def _zeros(leaf: Any) -> Any:
    if isinstance(leaf, _TensorLeaf):
        return torch.zeros(leaf.shape, dtype=leaf.dtype, device=leaf.device)
    if isinstance(leaf, _Opaque):
        raise TypeError(
            f"torchpass cannot stand in for a forward output holding a {leaf.type_name}: return tensors, "
            "tuples, lists, dicts or a type registered with torch.utils._pytree from the model's forward"
        )
    return leaf


@dataclass(frozen=True)
class OutputShape:
    """The structure of one forward's output, and zeros of that structure (see the module docstring)."""

    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]
    """Per leaf: a :class:`_TensorLeaf` for a tensor, a plain value (None, a number, a string) as it
    was, an :class:`_Opaque` for anything else."""

    @classmethod
    def of(cls, output: Any) -> "OutputShape":
        leaves, spec = pytree.tree_flatten(output)
        return cls(spec, tuple(_describe(x) for x in leaves))

    def zeros(self) -> Any:
        """A fresh output of this structure, every tensor zeros (no autograd history).

        Raises TypeError naming the type when the output held a leaf that is
        neither a tensor nor a plain value (nothing of it was kept to rebuild).
        """
        return pytree.tree_unflatten([_zeros(x) for x in self.leaves], self.spec)
