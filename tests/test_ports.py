"""The supervisor's port check (service/runtime/supervisor.py reserve_port) on real sockets: a port held only by
closing connections is free, a live listener or another server's holder is not. The whole restart on a
real asr-server is tests/test_server_processes.py::test_a_restart_on_the_same_ports_serves_at_once_while_old_connections_close."""

from __future__ import annotations

import socket
import time

import psutil
import pytest

from service.runtime.ports import LOOPBACK
from service.runtime.supervisor import reserve_port


def listener(port: int = 0, host: str = LOOPBACK) -> socket.socket:
    """A listening socket as gRPC and aiohttp open theirs in asr-server's frontends."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host.strip("[]"), port))
    s.listen()
    return s


def state_on(port: int) -> set[str]:
    return {c.status for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port}


def test_a_port_held_only_by_closing_connections_is_free() -> None:
    server = listener()
    port = server.getsockname()[1]
    client = socket.create_connection((LOOPBACK, port))  # a client that never closes its end
    try:
        accepted, _ = server.accept()
        accepted.close()  # the server's end: FIN sent, the client never answers with its own
        server.close()
        deadline = time.monotonic() + 5
        while "FIN_WAIT2" not in state_on(port):
            assert time.monotonic() < deadline, state_on(port)
            time.sleep(0.01)
        with reserve_port(LOOPBACK, port) as holder:
            assert holder.getsockname()[1] == port
    finally:
        client.close()


def test_a_listening_port_is_not_free() -> None:
    with listener() as live, pytest.raises(OSError):
        reserve_port(LOOPBACK, live.getsockname()[1])


@pytest.mark.parametrize("host", [LOOPBACK, "[::]"])
def test_a_port_another_server_holds_is_not_free_while_it_loads(host: str) -> None:
    """Before its frontends listen, a server holds its ports with a socket that never listens."""
    with reserve_port(host, 0) as holder:
        port = holder.getsockname()[1]
        for other in (host, LOOPBACK):
            with pytest.raises(OSError):
                reserve_port(other, port)
        # its own frontends still bind it (SO_REUSEPORT); a second server still may not
        with listener(port, host), pytest.raises(OSError):
            reserve_port(host, port)
