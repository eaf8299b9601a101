"""cluster/cli/free_port.py: the ports servers bind come from outside the kernel's
ephemeral range (where outgoing connections and Ray's port-0 binds take theirs) and are free."""

from __future__ import annotations

import socket

from splitserve.cluster.cli import free_port as ports


def test_free_port_is_below_the_ephemeral_range_above_rays_worker_ports_and_bindable():
    start = ports._ephemeral_start()
    seen = {ports.free_port() for _ in range(20)}
    assert len(seen) > 1  # random, so two xdist workers asking at once do not collide
    for port in seen:
        assert ports.RAY_WORKER_PORTS_END <= port < start
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_held_port_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.free_port()))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports.random, "sample", lambda population, k: [taken, *population[:k]])
        assert ports.free_port() != taken
