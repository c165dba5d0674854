"""The Deepgram door: live `GET /v1/listen` (WebSocket) and pre-recorded `POST /v1/listen`, on the HTTP port.

A translation layer: the query (options.py) -> the core's StreamSettings / RecognitionSettings; binary
frames -> `Stream.audio`, the control messages (messages.py) -> `finalize`, `finish`, `keep_alive`,
`update_keyterms`; the core's events -> `Results`, `SpeechStarted`, `UtteranceEnd` (utterance_end.py),
then `Metadata`; the core's errors -> an HTTP status before the upgrade, or an `Error` message and a close
code after it (docs/operations.md, "The Deepgram door", lists each).

Handshake order: credentials (401), the query (400 naming the option), then the core's admission
(503 loading or draining, 429 at --max-streams) and its checks of the settings (400 naming the option).
A refused handshake carries Deepgram's error body {err_code, err_msg, request_id} and its `dg-error`
header; the SDK raises it as ApiError(status_code).
"""

from __future__ import annotations

from functools import partial

from aiohttp import web

from service.doors.deepgram.common import LISTEN_PATH, Listen
from service.doors.deepgram.live import listen
from service.doors.deepgram.prerecorded import transcribe


class DeepgramDoor(Listen):
    """The door's routes, registered on the HTTP port's application (runtime/http_server.py): live
    (live.py) and pre-recorded (prerecorded.py) on one path."""

    def register(self, app: web.Application) -> None:
        app.router.add_get(LISTEN_PATH, partial(listen, self))
        app.router.add_post(LISTEN_PATH, partial(transcribe, self))
