"""Every write of a WebSocket door bounded in time: a client that stops reading while the server still
has something to say (a final, a reply, the close frame) is cut off after --ws-send-timeout, so its
stream ends and its --max-streams place is given back. A close handshake cannot get through to such a
client either, so the connection is aborted, not closed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from aiohttp import web

from service import metrics

log = logging.getLogger("service.doors.shared.ws_deadline")


async def write_within(write: Awaitable[object], request: web.BaseRequest, timeout_s: float) -> bool:
    """Await `write` (a send or a close of the request's WebSocket); past `timeout_s` (0: no bound) abort
    the connection. False if it was aborted (or the peer had already reset it)."""
    try:
        await asyncio.wait_for(write, timeout_s or None)
    except TimeoutError:
        log.warning(
            "a WebSocket client read nothing for %.0f s while a message waited: connection aborted",
            timeout_s,
            extra={"fields": {"peer": request.remote or ""}},
        )
        metrics.refused("ws_send_timeout")
        if request.transport is not None:
            request.transport.abort()
        return False
    except ConnectionError:
        return False
    return True


class Outbox:
    """A WebSocket's messages to its client, written in order by one task of their own. The reader (replies
    to controls) and the writer (results) only queue: neither ever waits on the client, so a client that
    reads nothing cannot stall the reading of its own frames nor hold a lock the other side needs. Past
    `max_bytes` waiting, or a write past `timeout_s`, the connection is aborted and `on_abort` runs."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        request: web.BaseRequest,
        timeout_s: float,
        max_bytes: int,
        on_abort: Callable[[], None],
    ) -> None:
        self._ws, self._request, self._timeout_s, self._max_bytes = ws, request, timeout_s, max_bytes
        self._on_abort = on_abort
        self._queue: deque[str | tuple[int, bytes]] = deque()  # texts, then perhaps the close
        self._bytes = 0
        self._wake = asyncio.Event()
        self._closing = False
        self.aborted = False
        self._task = asyncio.get_running_loop().create_task(self._run())

    def send(self, text: str) -> None:
        if self._closing or self.aborted or self._ws.closed:
            return
        self._queue.append(text)
        self._bytes += len(text)
        if self._max_bytes and self._bytes > self._max_bytes:
            log.warning(
                "a WebSocket client left more than %d bytes of messages unread: connection aborted",
                self._max_bytes,
                extra={"fields": {"peer": self._request.remote or ""}},
            )
            metrics.refused("max_response_backlog_bytes")
            self._abort()
            return
        self._wake.set()

    async def close(self, code: int, message: bytes) -> None:
        """Queue the close after every message queued, and wait until it is written (or the connection
        aborted). Later messages are dropped."""
        if not self._closing and not self.aborted:
            self._closing = True
            self._queue.append((code, message))
            self._wake.set()
        await asyncio.wait({self._task})  # its end, whatever it was; a cancel of the caller still propagates

    async def aclose(self) -> None:
        """The call is over: stop writing whatever is left."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def _abort(self) -> None:
        self.aborted = True
        self._queue.clear()
        self._bytes = 0
        if self._request.transport is not None:
            self._request.transport.abort()
        self._wake.set()
        self._on_abort()

    async def _run(self) -> None:
        while not self.aborted:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            item = self._queue.popleft()
            if isinstance(item, str):
                written = await write_within(self._ws.send_str(item), self._request, self._timeout_s)
                self._bytes -= len(item)
            else:
                written = await write_within(
                    self._ws.close(code=item[0], message=item[1]), self._request, self._timeout_s
                )
                if written:
                    return
            if not written:
                if not self.aborted:
                    self._abort()
                return
