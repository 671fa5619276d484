"""kvfleet.local_cluster.free_port: a cluster's processes bind their ports after the ports are
chosen, so two choices must never be the same port."""

from __future__ import annotations

import socket

import pytest

from kvfleet.local_cluster import ephemeral_range, free_port


def test_ports_handed_out_are_distinct_and_bindable() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free at the time it was chosen


def test_ports_are_picked_below_the_range_outgoing_connections_take_theirs_from() -> None:
    """A port of the OS's ephemeral range may become a connection's source port before the
    process it was chosen for binds it: free_port stays below that range where it leaves room."""
    low, high = ephemeral_range()
    assert 1024 < low <= high
    ports = [free_port() for _ in range(50)]
    if low - 10000 >= 1000:
        assert all(10000 <= p < low for p in ports), ports


def test_a_port_bound_now_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvfleet.local_cluster as lc

    low, _ = ephemeral_range()
    if low - 10000 < 1000:
        pytest.skip(f"the ephemeral range starts at {low}: free_port takes a port of its own there")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # in the ephemeral range: a port free_port would never try
        busy = taken.getsockname()[1]
        picks = iter([busy, busy, 23456, 23457, 23458, 23459])
        monkeypatch.setattr(lc.random, "randrange", lambda a, b: next(picks))
        monkeypatch.setattr(lc, "ephemeral_range", lambda: (busy + 1, busy + 2000))
        got = free_port()
    assert got != busy and got in (23456, 23457, 23458, 23459)
