"""Pickles that cannot run code when loaded: the format of every object torchpass reads from another process.

pickle's loader calls whatever callable a pickle names, so a process that can
write a store key or reach a transfer port could run code in any reader of a
plain pickle. torchpass still needs pickle's reach for the objects it moves
(state-dict skeletons and small state hold tuples, OrderedDicts, dtypes, RNG
states), so:

* :func:`loads` resolves only the globals registered with :func:`allow`
  (containers, ``torch.Size``, torch dtypes, and the few record classes
  torchpass and its adapters register next to their definitions); any other
  global fails with :class:`ForbiddenObject` naming it, before anything is
  called;
* tensors and NumPy arrays and scalars never go through their own reduce
  functions (torch's storage reduction calls ``torch.load``): :func:`dumps`
  writes them as persistent ids holding dtype, shape and raw bytes, rebuilt
  with ``torch.frombuffer`` / ``numpy.frombuffer``.

This is the same idea as torch's ``weights_only`` loader, with an explicit,
small allow-list and exact round trips (a tensor comes back bit for bit, any
dtype, bf16 included).
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

__all__ = ["ForbiddenObject", "allow", "dumps", "loads"]

_ALLOWED: dict[tuple[str, str], Any] = {}


class ForbiddenObject(pickle.UnpicklingError):
    """A pickle named a global that is not allowed: it was refused before anything ran."""


def allow(obj: Any) -> Any:
    """Let :func:`loads` rebuild ``obj`` (a class) by name; returns it, so it can decorate a class.

    Register only plain record types whose construction runs no code of consequence.
    """
    _ALLOWED[(obj.__module__, obj.__qualname__)] = obj
    return obj


for _type in (OrderedDict, set, frozenset, complex, slice, range, torch.Size):
    allow(_type)


def _torch_dtype(module: str, name: str) -> torch.dtype | None:
    if module != "torch":
        return None
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


_PLAIN = frozenset({str, int, float, bool, type(None), tuple, list, dict, bytes})
"""Types written as they are: the pickler asks about every object it writes (a manifest of 1,000
tensors: ~15,000 of them), and one set lookup answers most before three ``isinstance`` checks would."""


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in _PLAIN:
            return None
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if t.device.type != "cpu":
                raise TypeError(f"safe_pickle: a tensor on {t.device}: only CPU tensors are written")
            t = t.contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return ("tensor", str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise TypeError("safe_pickle: a NumPy array of Python objects cannot be written")
            return ("ndarray", obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
        if isinstance(obj, np.generic):
            return ("npscalar", obj.dtype.str, obj.tobytes())
        return None


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            found = _torch_dtype(module, name)
        if found is None:
            raise ForbiddenObject(
                f"refused to load {module}.{name}: only tensors, arrays, containers and the types registered with "
                "torchpass.core.safe_pickle.allow travel between torchpass processes"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or not pid or pid[0] not in ("tensor", "ndarray", "npscalar"):
            raise ForbiddenObject(f"unknown persistent id {str(pid)[:80]!r}")
        if pid[0] == "tensor":
            _, dtype_name, shape, raw = pid
            dtype = _torch_dtype("torch", dtype_name)
            if dtype is None:
                raise ForbiddenObject(f"unknown tensor dtype {dtype_name!r}")
            if not raw:
                return torch.empty(tuple(shape), dtype=dtype)
            return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(tuple(shape))
        if pid[0] == "ndarray":
            _, dtype_str, shape, raw = pid
            return np.frombuffer(bytearray(raw), dtype=np.dtype(dtype_str)).reshape(shape)
        _, dtype_str, raw = pid
        return np.frombuffer(raw, dtype=np.dtype(dtype_str))[0]


def dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """Rebuild what :func:`dumps` wrote; refuses (``ForbiddenObject``) any global not allowed."""
    return _Unpickler(io.BytesIO(data)).load()
