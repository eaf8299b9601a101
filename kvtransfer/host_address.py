"""resolve_host: the address a replica binds and publishes (torch-free, for every worker;
kvtransfer/rendezvous.py re-exports it)."""

from __future__ import annotations

import socket

from splitserve.kvtransfer.errors import TransportUsageError

__all__ = ["resolve_host"]


def resolve_host(host: str) -> str:
    """The address to bind and publish: host itself, or for "auto" this node's IP address."""
    if not host:
        raise TransportUsageError("host must be an address, a hostname or 'auto'")
    if host != "auto":
        return host
    try:
        # The source address of the outward route; connecting a UDP socket sends no packet.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))
            address = probe.getsockname()[0]
        if not address.startswith("0."):
            return address
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
