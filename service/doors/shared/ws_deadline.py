"""Every write of a WebSocket door bounded in time: a client that stops reading while the server still
has something to say (a final, a reply, the close frame) is cut off after --ws-send-timeout, so its
stream ends and its --max-streams place is given back. A close handshake cannot get through to such a
client either, so the connection is aborted, not closed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from aiohttp import web

log = logging.getLogger("service.doors.ws_deadline")


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
        if request.transport is not None:
            request.transport.abort()
        return False
    except ConnectionError:
        return False
    return True
