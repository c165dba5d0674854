"""The Deepgram door's pre-recorded half: `POST /v1/listen` with the recording as the body."""

from __future__ import annotations

import hashlib
import uuid

from aiohttp import web

from service.doors.deepgram import messages
from service.doors.deepgram.common import (
    BODY_ERRORS,
    DOOR,
    DeepgramError,
    Listen,
    now,
    recognition_settings,
    span,
    words_of,
)
from service.doors.deepgram.options import ListenOptions
from service.doors.shared.http_body import BodyError, BoundedBody
from service.recognizer.framing import container_of
from service.recognizer.recognizer import probe_recording
from service.vocabulary.errors import RecognitionError
from service.vocabulary.types import (
    AudioFormat,
    Identity,
)


async def transcribe(door: Listen, request: web.Request) -> web.Response:
    request_id = str(uuid.uuid4())
    try:
        caller = door.authenticate(request)
        options = door.options(request, live=False)
        if request.content_type == "application/json":
            raise DeepgramError(
                400,
                "Bad Request",
                "url: this server does not fetch audio from a URL; send the audio as the request body",
                "url",
            )
        data = await _read_body(door, request)
        return await _transcribe(door, data, options, "encoding" in request.query, request_id, caller)
    except DeepgramError as e:
        response = e.response(request_id)
        if e.status in (408, 413):
            response.force_close()  # the rest of the body is not read
        return response


async def _read_body(door: Listen, request: web.Request) -> bytearray:
    """The body, within the bounds every HTTP door puts on an upload (shared/http_body.py):
    --max-recognize-bytes, --http-read-timeout, --http-min-upload-rate."""
    c = door.config
    limit = c.max_recognize_bytes
    try:
        body = BoundedBody(
            request,
            limit,
            lambda _: f"the audio is over the limit of {limit} bytes (max_recognize_bytes)",
            c.http_read_timeout,
            c.http_min_upload_rate,
        )
        return await body.read_all()
    except BodyError as e:
        raise DeepgramError(e.status, BODY_ERRORS[e.status], e.message) from e


async def _transcribe(
    door: Listen,
    data: bytearray,
    options: ListenOptions,
    encoding_given: bool,
    request_id: str,
    caller: Identity,
) -> web.Response:
    container = container_of(data[:16])
    if container in ("WAV", "FLAC"):
        audio_format = AudioFormat(container)
    elif container is not None:
        raise DeepgramError(
            400, "Bad Request", f"encoding: {container} files are not decoded here; send WAV, FLAC or raw "
            "linear16, mulaw or alaw with encoding and sample_rate", "encoding",
        )  # fmt: skip
    elif encoding_given:
        audio_format = AudioFormat(options.encoding, options.sample_rate, options.channels)
    else:
        raise DeepgramError(
            400,
            "Bad Request",
            "encoding: the audio is no WAV or FLAC file; for raw audio give encoding and sample_rate",
            "encoding",
        )
    settings = recognition_settings(options, audio_format)
    try:
        result = await door.recognizer.recognize(data, settings, door=DOOR, identity=caller)
    except RecognitionError as e:
        raise DeepgramError.of(e) from e
    if audio_format.encoding in ("WAV", "FLAC"):
        channels = probe_recording(data, audio_format.encoding, 0, 0).channels
    else:
        channels = options.channels
    out_channels = channels if options.multichannel else 1
    utterances = []
    for r in result.results:
        words = words_of(r)
        start, end = span(r, words)
        utterances.append(
            messages.Utterance(
                max(r.channel - 1, 0), start, end, r.transcript, r.confidence, words, r.speaker
            )
        )
    body = messages.prerecorded(
        request_id=request_id,
        created=now(),
        duration=result.duration_s,
        channels=out_channels,
        sha256=hashlib.sha256(data).hexdigest(),
        model=door.model_card(),
        utterances=utterances,
        punctuated=options.punctuated,
        with_utterances=options.utterances,
        warnings=options.warnings,
        tags=options.tags,
    )
    return web.Response(
        text=messages.dump(body), content_type="application/json", headers={"dg-request-id": request_id}
    )
