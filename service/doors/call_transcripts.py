"""Transcripts of telephony calls, followed by call id: a WebSocket on the HTTP port.

    GET /v1/calls/{call_id}/transcripts   one call (subscribe before it starts, or while it runs)
    GET /v1/calls/transcripts             every call, as each starts

Authenticated as every door (`Authorization: Bearer <token>` when the server has tokens). The server
sends JSON text messages and never reads any but the close:

    {"type": "call_started", "call_id", "platform", "stream_id", "channels": [leg labels], "attributes"}
    {"type": "transcript", "call_id", "channel": <leg label>, "is_final", "text", "start_s", "end_s"}
    {"type": "call_ended", "call_id", "status": "OK" | <how the stream ended>}

then, following one call, closes 1000 after `call_ended`. A subscriber slower than the call (more than
1024 messages waiting, or one message unsent for --ws-send-timeout) is closed 1008 and the call goes on;
on drain every subscriber gets what this server's calls said, then 1001.
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from service.doors.shared.auth import bearer_token
from service.doors.shared.http_door import HttpDoor
from service.doors.shared.telephony_socket import refusal
from service.doors.shared.ws_deadline import write_within
from service.recognizer.call_hub import CALL_ID_SYNTAX, EVERY_CALL, SubscriberLagged

log = logging.getLogger("service.doors.call_transcripts")

CALL_PATH = "/v1/calls/{call_id}/transcripts"
EVERY_CALL_PATH = "/v1/calls/transcripts"


class CallTranscriptsDoor(HttpDoor):
    def register(self, app: web.Application) -> None:
        app.router.add_get(EVERY_CALL_PATH, self.every_call)
        app.router.add_get(CALL_PATH, self.one_call)

    async def every_call(self, request: web.Request) -> web.StreamResponse:
        return await self._follow(request, EVERY_CALL)

    async def one_call(self, request: web.Request) -> web.StreamResponse:
        call_id = request.match_info["call_id"]
        if not CALL_ID_SYNTAX.fullmatch(call_id):
            return refusal(400, "call_id: 1 to 256 visible ASCII characters")
        return await self._follow(request, call_id)

    def _unauthenticated(self, request: web.Request) -> web.Response | None:
        if not self.tokens.enabled:
            return None
        token = bearer_token(request.headers.items())
        if token is None:
            return refusal(401, "missing credentials: send the header 'Authorization: Bearer <token>'")
        if not token or not self.tokens.check(token):
            return refusal(401, "invalid credentials")
        return None

    async def _follow(self, request: web.Request, call_id: str) -> web.StreamResponse:
        unauthenticated = self._unauthenticated(request)
        if unauthenticated is not None:
            return unauthenticated
        ws = web.WebSocketResponse(heartbeat=self.config.keepalive_time or None, max_msg_size=4096)
        if not ws.can_prepare(request).ok:
            return refusal(426, f"{request.path} is a WebSocket: send an Upgrade request")
        async with self.recognizer.call_hub.subscribe(call_id) as subscription:
            await ws.prepare(request)
            reader = asyncio.create_task(_until_closed(ws))
            reader.add_done_callback(lambda _: subscription.deliver(None))  # gone: stop waiting for the call
            try:
                async for message in subscription:
                    sent = await write_within(
                        ws.send_str(json.dumps(message)), request, self.config.ws_send_timeout
                    )
                    if not sent:
                        return ws
            except SubscriberLagged as e:
                await ws.close(code=1008, message=f"subscriber too slow: {e}"[:120].encode())
                return ws
            finally:
                reader.cancel()
        if not ws.closed:
            code = 1001 if self.recognizer.draining else 1000
            await write_within(ws.close(code=code), request, self.config.ws_send_timeout)
        return ws


async def _until_closed(ws: web.WebSocketResponse) -> None:
    async for _ in ws:  # the subscriber sends nothing the server needs; its close ends the loop
        pass
