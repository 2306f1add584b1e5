"""The checksum threads: small buffers checksummed where they are asked for, large ones on the pool, the same CRC32C either way."""

from __future__ import annotations

import threading

import torch

from torchpass.core import checksum
from torchpass.core.checksum import INLINE_BYTES, KnownCrc, crc32c, submit


def _bytes(n: int) -> memoryview:
    return memoryview(torch.arange(n, dtype=torch.uint8).numpy())


def test_a_small_buffer_is_checksummed_on_the_calling_thread(monkeypatch):
    seen = []

    def recording(data):
        seen.append(threading.current_thread())
        return crc32c(data)

    monkeypatch.setattr(checksum, "crc32c", recording)
    small = _bytes(INLINE_BYTES - 1)
    crc = submit(small)
    assert isinstance(crc, KnownCrc) and seen == [threading.current_thread()]
    assert crc.result() == crc32c(small)


def test_a_large_buffer_goes_to_a_checksum_thread(monkeypatch):
    seen = []

    def recording(data):
        seen.append(threading.current_thread().name)
        return crc32c(data)

    monkeypatch.setattr(checksum, "crc32c", recording)
    large = _bytes(INLINE_BYTES)
    assert submit(large).result() == crc32c(large)
    assert seen[0].startswith("torchpass-crc")
