import socket
from pathlib import Path

import pytest

from torchpass.core import free_port as free_port_module
from torchpass.core.free_port import free_port


def _low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


@pytest.mark.skipif(not Path("/proc/sys/net/ipv4/ip_local_port_range").exists(), reason="Linux's ephemeral range file")
def test_the_port_is_outside_the_range_outgoing_connections_draw_from_and_can_be_listened_on() -> None:
    for _ in range(20):
        port = free_port()
        assert port < _low()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()


def test_a_port_in_use_is_never_returned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        draws = iter([taken, taken, *range(1024, 65536)])  # the held port first, then any other

        class _Draws:
            def randrange(self, low: int, high: int) -> int:
                return next(draws)

        monkeypatch.setattr(free_port_module.random, "SystemRandom", _Draws)
        range_file = tmp_path / "range"
        range_file.write_text("65535 65535\n")  # draws above the real range so the test's own picks are accepted
        monkeypatch.setattr(free_port_module, "_EPHEMERAL_RANGE", range_file)
        monkeypatch.setattr(free_port_module, "_LOWEST", 1024)
        assert free_port() != taken


def test_a_host_whose_ephemeral_range_starts_low_gets_the_kernels_choice(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    range_file = tmp_path / "range"
    range_file.write_text("1024 65535\n")
    monkeypatch.setattr(free_port_module, "_EPHEMERAL_RANGE", range_file)
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
