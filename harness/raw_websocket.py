"""A WebSocket client that reads nothing after its handshake, for the tests and benchmarks of a server's
bounds on such clients (a client library would keep reading into its own queue)."""

from __future__ import annotations

import asyncio
import socket


async def silent_websocket(host: str, port: int, path: str) -> socket.socket:
    """A WebSocket opened by hand on a socket with a 4 KiB receive buffer, whose handshake reply is the
    last thing it ever reads (a client library would keep reading into its own queue)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, port))
    await loop.sock_sendall(
        sock,
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n".encode(),
    )
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += await loop.sock_recv(sock, 1)
    assert reply.startswith(b"HTTP/1.1 101"), reply
    return sock


def masked_text_frame(text: str) -> bytes:
    """One client text frame (RFC 6455 5.2: FIN, opcode 1, the mask bit and key, the masked payload)."""
    payload = text.encode()
    assert len(payload) < 126
    key = b"\x01\x02\x03\x04"
    return bytes([0x81, 0x80 | len(payload)]) + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))
