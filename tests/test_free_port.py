"""`eplb.ops.launch.free_port`: the port a launcher, a test or docs/regen.py gives the
server it starts next (rendezvous store, metrics endpoint) is free and lies below the
ephemeral range, from which outgoing connections take their local ports."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from eplb.ops import launch

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.skipif(not RANGE.exists(), reason="no Linux ephemeral port range on this system")
def test_ports_are_free_and_below_the_ephemeral_range():
    low = int(RANGE.read_text().split()[0])  # read here, not through launch.ephemeral_low
    ports = [launch.free_port() for _ in range(50)]
    assert all(_bindable(p) for p in ports)
    if low >= 2048:
        assert all(max(1024, low - launch.PORT_SPAN) <= p < low for p in ports), (low, ports)
    assert len(set(ports)) > 40  # drawn at random: two launches rarely get the same port


def test_a_port_in_use_is_never_given(monkeypatch, tmp_path):
    """With the range pinned to 40 ports, one of them held by a listener: never that one."""
    f = tmp_path / "range"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        if taken < 2048 + 40:
            pytest.skip("the system gave a low port")
        f.write_text(f"{taken + 20}\t60999\n")
        monkeypatch.setattr(launch, "PORT_SPAN", 40)
        original = launch.ephemeral_low
        monkeypatch.setattr(launch, "ephemeral_low", lambda: original(str(f)))
        ports = {launch.free_port() for _ in range(200)}
    assert taken not in ports
    assert ports <= set(range(taken - 20, taken + 20))


def test_without_an_ephemeral_range_the_system_picks(monkeypatch):
    monkeypatch.setattr(launch, "ephemeral_low", lambda: None)
    assert _bindable(launch.free_port())


def test_ephemeral_low_reads_the_first_number(tmp_path):
    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert launch.ephemeral_low(str(f)) == 32768
    f.write_text("garbage\n")
    assert launch.ephemeral_low(str(f)) is None
    assert launch.ephemeral_low(str(tmp_path / "missing")) is None
