"""A free loopback port for tests and benchmark scripts that start servers (one helper, not one copy
per script). The server itself reserves its ports with service.runtime.supervisor.reserve_port."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port nothing listens on right now (the kernel's pick for port 0). Another process may take it
    before the caller binds it: fine for tests and benchmarks on one machine, not for production."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
