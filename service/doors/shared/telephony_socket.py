"""What the telephony WebSocket doors (AudioHook, Twilio, Asterisk chan_websocket) share: the refusal
before the upgrade in one JSON shape, and a call that outlives its handler.

A platform hangs up by closing the socket, and the HTTP port cancels a handler whose client went away
(runtime/http_server.py: handler_cancellation, which frees the other doors' work at once). A telephony
call must instead finish what it heard: its last words are transcribed and published to the call's
subscribers. So the call runs as a task of its own, which the handler only waits for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from aiohttp import web


def refusal(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


class TelephonySockets:
    """One door's calls in flight, each on its own task."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._calls: set[asyncio.Task[None]] = set()

    async def upgrade(
        self, request: web.Request, ws: web.WebSocketResponse
    ) -> web.WebSocketResponse | web.Response:
        """Prepare `ws`, or the 426 for a request that is no WebSocket upgrade."""
        if not ws.can_prepare(request).ok:
            return refusal(426, f"{self.path} is a WebSocket: send an Upgrade request")
        await ws.prepare(request)
        return ws

    async def run(self, call: Coroutine[Any, Any, None], name: str) -> None:
        """Run `call` to its end, even when the handler awaiting it is cancelled."""
        task = asyncio.create_task(call, name=name)
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)
        await asyncio.shield(task)
