"""A ``dist.Store`` that logs what it is asked, for tests of the requests a component makes of its store."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


class RecordingStore(dist.Store):
    """``base`` with a log of every request, in order: (operation, key, value bytes; 0 where no value moves).

    c10d calls it through its trampoline, so it logs what gloo's rendezvous asks as well as Python callers.
    """

    def __init__(self, base: dist.Store) -> None:
        super().__init__()
        self._base = base
        self.log: list[tuple[str, str, int]] = []

    def set(self, key: str, value: bytes) -> None:
        self.log.append(("set", key, len(value)))
        self._base.set(key, value)

    def get(self, key: str) -> bytes:
        value = self._base.get(key)
        self.log.append(("get", key, len(value)))
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.log += [("wait", key, 0) for key in keys]
        self._base.wait(keys, timeout or timedelta(seconds=30))

    def check(self, keys: list[str]) -> bool:
        self.log += [("check", key, 0) for key in keys]
        return self._base.check(keys)
