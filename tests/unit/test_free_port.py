"""kvfleet.local_cluster.free_port: a cluster's processes bind their ports after the ports are
chosen, so two choices must never be the same port."""

from __future__ import annotations

import socket

from kvfleet.local_cluster import free_port


def test_ports_handed_out_are_distinct_and_bindable() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free at the time it was chosen
