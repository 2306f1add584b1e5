"""State capture and restore: a manifest of named tensors plus a skeleton of small objects.

A rank's migratable state is a mapping of named *components* (``"model"``,
``"optimizer"``, ``"scheduler"``, ``"rng"``, ...), each the ``state_dict()`` of
a framework object. :func:`capture` flattens it into

* the tensors, in a fixed order, each described by a :class:`TensorEntry`
  (name, dtype, shape, byte size, the state class it belongs to), referencing
  the live storage: capture copies nothing;
* a *skeleton*: the nested structure with every tensor replaced by its index,
  written with :mod:`~torchpass.core.safe_pickle` (a receiver rebuilds it
  without running code). It holds the small objects (step counters,
  hyper-parameters).

:func:`rebuild` is the inverse on the receiving side, after the transfer has
filled the receiver's buffers. :func:`fingerprint` digests the tensor bytes'
CRC32Cs so two data-parallel replicas can be checked to hold identical state
before one is copied from the other.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from . import safe_pickle
from .checksum import CHUNK_BYTES, Crc, CrcTable, chunk_grid
from .cuda_staging import mark_ready, pinned_like, stage_to_host

__all__ = [
    "TensorEntry",
    "Manifest",
    "Captured",
    "capture",
    "rebuild",
    "fingerprint",
    "state_digest",
    "tensor_bytes",
]


@safe_pickle.allow
@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a manifest."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    state_class: str


@safe_pickle.allow
@dataclass
class Manifest:
    """Everything a receiver needs to allocate buffers and rebuild the state."""

    entries: list[TensorEntry]
    skeleton: bytes
    version: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


@dataclass
class Captured:
    """A manifest and the live tensors it describes, in entry order."""

    manifest: Manifest
    tensors: list[torch.Tensor]
    crcs: CrcTable | None = None
    """The chunk CRCs of this copy, kept with it once its bytes no longer change (a snapshot,
    a held buddy copy, a published copy); None for live state, whose bytes the next step changes."""
    private: frozenset[int] = frozenset()
    """Indices of the tensors :func:`capture` copied (the non-contiguous ones): already a copy
    at this version that no live tensor shares, so a snapshot keeps it rather than copy it again."""
    device_events: dict[torch.device, Any] | None = None
    """For a capture that kept live CUDA tensors: per device, the point of the stream they must be read at."""

    def checksums(self) -> CrcTable:
        """The copy's own CRC table, or a new one over its tensors (CRCs valid while they do not change)."""
        return self.crcs if self.crcs is not None else CrcTable([tensor_bytes(t) for t in self.tensors])


@safe_pickle.allow
class _Ref:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Ref, (self.index,))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor, without copying (any dtype, bf16 included)."""
    if not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor")
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def _same_mapping(original: dict, items: dict) -> dict:
    # Module state dicts are OrderedDicts and keep their type; every other mapping becomes a dict.
    return OrderedDict(items) if isinstance(original, OrderedDict) else items


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def capture(
    components: Mapping[str, Any],
    state_classes: Mapping[str, str],
    version: int,
    meta: Mapping[str, Any] | None = None,
    *,
    device_tensors: str = "stage",
) -> Captured:
    """Flatten ``components`` (name -> state dict) into a manifest over the live tensors.

    ``state_classes`` maps a component name to its state class (see
    :mod:`torchpass.core.topology`); components without an entry are ``"small"``.
    Non-contiguous tensors and CUDA tensors are the only ones copied (listed in
    :attr:`Captured.private`): a CUDA tensor is staged into pinned host memory
    (:mod:`torchpass.core.cuda_staging`), all of a capture's in one pass.
    ``device_tensors`` says what a CUDA tensor becomes: ``"stage"`` that pinned
    copy; ``"buffers"`` an empty pinned buffer of its shape (receive buffers,
    whose contents the transfer overwrites); ``"live"`` the CUDA tensor itself,
    with :attr:`Captured.device_events` marking the point a later staging must
    see (a buddy snapshot, staged off the training thread).
    """
    if device_tensors not in ("stage", "buffers", "live"):
        raise ValueError(f"capture: device_tensors={device_tensors!r}; expected 'stage', 'buffers' or 'live'")
    entries: list[TensorEntry] = []
    tensors: list[torch.Tensor] = []
    private: set[int] = set()
    on_device: list[int] = []

    def walk(obj: Any, path: str, cls: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
                raise TypeError(
                    f"state entry {path!r} is a {type(obj).__name__}; capture plain tensors "
                    "(an adapter converts DTensors to their local shards first)"
                )
            t = obj.detach()
            if t.device.type not in ("cpu", "cuda"):
                raise TypeError(f"state entry {path!r} is on {t.device}; torchpass captures CPU and CUDA state")
            if not t.is_contiguous():
                t = t.contiguous()
                private.add(len(tensors))
            if t.device.type == "cuda":
                on_device.append(len(tensors))
            entries.append(TensorEntry(path, _dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size(), cls))
            tensors.append(t)
            return _Ref(len(tensors) - 1)
        if isinstance(obj, dict):
            return _same_mapping(obj, {k: walk(v, f"{path}/{k}", cls) for k, v in obj.items()})
        if isinstance(obj, list):
            return [walk(v, f"{path}/{i}", cls) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(walk(v, f"{path}/{i}", cls) for i, v in enumerate(obj))
        return obj

    skeleton = {name: walk(value, name, state_classes.get(name, "small")) for name, value in components.items()}
    manifest = Manifest(entries, safe_pickle.dumps(skeleton), version, dict(meta or {}))
    if on_device and device_tensors == "live":
        return Captured(manifest, tensors, private=frozenset(private - set(on_device)), device_events=mark_ready({tensors[i].device for i in on_device}))
    if on_device:
        if device_tensors == "stage":
            hosts = stage_to_host([tensors[i] for i in on_device])
        else:
            hosts = [pinned_like(tensors[i]) for i in on_device]
        for i, host in zip(on_device, hosts):
            tensors[i] = host
        private.update(on_device)
    return Captured(manifest, tensors, private=frozenset(private))


def rebuild(manifest: Manifest, tensors: list[torch.Tensor]) -> dict[str, Any]:
    """Put ``tensors`` back into the skeleton: the inverse of :func:`capture`."""
    if len(tensors) != len(manifest.entries):
        raise ValueError(f"manifest lists {len(manifest.entries)} tensors, got {len(tensors)}")

    def walk(obj: Any) -> Any:
        if isinstance(obj, _Ref):
            return tensors[obj.index]
        if isinstance(obj, dict):
            return _same_mapping(obj, {k: walk(v) for k, v in obj.items()})
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(walk(v) for v in obj)
        return obj

    return walk(safe_pickle.loads(manifest.skeleton))


def fingerprint(captured: Captured, state_classes: set[str] | None = None, *, chunk_bytes: int = CHUNK_BYTES) -> str:
    """A digest of the tensors (optionally only some state classes) and their names, dtypes and shapes.

    The CRC32Cs of each tensor's chunks of ``chunk_bytes`` (taken from the copy's CRC
    table where it has one, so a copy fingerprinted and then sent is read once) with the
    entry metadata; equal fingerprints at one ``chunk_bytes`` mean bitwise-equal state.
    Fingerprints are compared within one run only (replicas against each other, final
    states against the fault-free run's), never against digests of another release.
    """
    table = captured.checksums()
    entries = captured.manifest.entries
    wanted = [i for i, e in enumerate(entries) if state_classes is None or e.state_class in state_classes]
    crcs: dict[int, list[Crc]] = {i: [] for i in wanted}
    for chunk in chunk_grid([e.nbytes for e in entries], chunk_bytes, wanted):
        crcs[chunk[0]].append(table.crc(chunk))  # all submitted before the first is awaited: every core works
    h = hashlib.sha256()
    for i, futures in crcs.items():
        h.update(f"{entries[i].name}|{entries[i].dtype}|{entries[i].shape}|".encode())
        for future in futures:
            h.update(future.result().to_bytes(4, "little"))
    return h.hexdigest()


def state_digest(components: Mapping[str, Any]) -> str:
    """SHA-256 over every tensor's bytes, name, dtype and shape, and the skeleton: the bitwise oracle."""
    captured = capture(components, {}, version=0)
    h = hashlib.sha256(captured.manifest.skeleton)
    for entry, t in zip(captured.manifest.entries, captured.tensors):
        h.update(f"{entry.name}|{entry.dtype}|{entry.shape}|".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()
