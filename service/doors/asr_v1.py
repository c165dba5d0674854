"""The asr.v1.Recognizer servicer: checks requests, runs streams (service/pipeline/session.py) and whole recordings.

Every refusal is a gRPC status whose message names the field and the limit; nothing one call does can
fail another.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio

from engine import DecodeOptions, EngineOverloaded, Transcript, UtteranceHandle
from engine.api import EngineStopped, ModelInfo
from engine.prompt import check_prompt_chars
from engine.request import Priority
from service import metrics
from service.config import ServerConfig
from service.core.engine import RecognitionEngine
from service.core.stream_limit import StreamLimit
from service.pipeline.audio import (
    TARGET_RATE,
    AudioFormatError,
    AudioTooLong,
    EncodedAudio,
    RecordingInfo,
    decode_blocks,
    mixdown,
    probe_recording,
    validate_stream_format,
)
from service.pipeline.endpointing import Endpointer, EndpointSettings, Utterance
from service.pipeline.results import duration, recognize_results, result_options
from service.pipeline.session import (
    StreamError,
    StreamSession,
    StreamSettings,
    await_transcript,
    engine_refusal,
)

log = logging.getLogger("service.doors.asr_v1")

STREAM_ID_HEADER = "asr-stream-id"  # initial metadata of an accepted stream (see StreamingRecognize)
FIRST_REQUEST_TIMEOUT_S = 10.0  # a stream that sends no config is not kept waiting for it
# Bounds on what a RecognitionConfig may make the server work through (the prompt's: engine/prompt.py).
# BCP-47 tags: RFC 5646 asks for at least 35 characters; only the primary subtag is read.
MAX_LANGUAGE_CODE_CHARS = 64
MAX_REDACT_VALUES = 8  # three kinds exist; a repeat is harmless, a million of them is not

# BCP-47 primary subtags that Whisper spells differently.
_BCP47_TO_WHISPER = {"iw": "he", "jv": "jw", "nb": "no", "fil": "tl"}


def whisper_language(code: str, info: ModelInfo) -> str | None:
    """ "en-US" / "en" / "" -> Whisper's code (None: the model's default or detection)."""
    if len(code) > MAX_LANGUAGE_CODE_CHARS:
        raise ValueError(
            f"language_code has {len(code)} characters, over the limit of {MAX_LANGUAGE_CODE_CHARS} "
            "(a BCP-47 tag such as en-US, or Whisper's code)"
        )
    if not code.strip():
        return None
    primary = code.strip().replace("_", "-").split("-")[0].lower()
    lang = _BCP47_TO_WHISPER.get(primary, primary)
    if lang not in info.languages:
        hint = "only en" if info.languages == {"en"} else f"{len(info.languages)} Whisper languages"
        raise ValueError(f"language_code {code!r} is not supported by model {info.name} ({hint})")
    return lang


def encoding_name(value: int) -> str:
    """The proto enum as service/pipeline/audio.py spells it ("" when unset; an unknown number is named as such,
    so that the refusal says what the client sent)."""
    if value == asr_pb2.ENCODING_UNSPECIFIED:
        return ""
    if value not in asr_pb2.AudioEncoding.values():
        return f"unknown value {value}"
    return asr_pb2.AudioEncoding.Name(value)


def _seconds(d: object) -> float:
    return d.seconds + d.nanos / 1e9  # type: ignore[attr-defined]


def check_bounds(config: asr_pb2.RecognitionConfig) -> None:
    """Refuse (ValueError naming the field and the limit) a field that would make the server work through
    an unbounded amount of it, before anything else reads it."""
    check_prompt_chars(config.prompt)
    if len(config.redact) > MAX_REDACT_VALUES:
        raise ValueError(
            f"redact has {len(config.redact)} values, over the limit of {MAX_REDACT_VALUES} (PCI, SSN, NUMBERS)"
        )


def decode_options(config: asr_pb2.RecognitionConfig, engine: RecognitionEngine) -> DecodeOptions:
    """The engine's options for this config, every bound checked here, in the frontend: the prompt in
    characters, then in tokens with the engine's own tokenizer (ModelInfo.prompts)."""
    check_bounds(config)
    if engine.info.prompts is not None:
        engine.info.prompts.encode(config.prompt)  # remembered: an in-process engine finds it tokenized
    options = DecodeOptions(
        language=whisper_language(config.language_code, engine.info),
        prompt=config.prompt or None,
        timestamps=config.enable_segment_time_offsets,
        word_timestamps=config.enable_word_time_offsets or config.enable_word_confidence,
    )
    engine.validate(options)
    return options


def endpoint_settings(ep: asr_pb2.EndpointingConfig) -> EndpointSettings:
    return EndpointSettings.from_overrides(
        speech_start_threshold=ep.speech_start_threshold,
        speech_end_threshold=ep.speech_end_threshold,
        min_silence_s=_seconds(ep.min_silence_duration),
        max_utterance_s=_seconds(ep.max_utterance_duration),
        min_speech_s=_seconds(ep.min_speech_duration),
    )


def stream_settings(sc: asr_pb2.StreamingRecognitionConfig, engine: RecognitionEngine) -> StreamSettings:
    """Validate a StreamingRecognitionConfig (raises AudioFormatError/EndpointingError/ValueError)."""
    if not sc.HasField("config"):
        raise AudioFormatError(
            "streaming_config.config", "streaming_config.config is required (encoding, rate)"
        )
    c = sc.config
    encoding = encoding_name(c.encoding)
    rate, channels = validate_stream_format(encoding, c.sample_rate_hertz, c.audio_channel_count)
    return StreamSettings(
        encoding=encoding,
        sample_rate_hertz=rate,
        channels=channels,
        separate_channels=c.enable_separate_recognition_per_channel and channels > 1,
        options=decode_options(c, engine),
        endpointing=endpoint_settings(sc.endpointing),
        interim_results=sc.interim_results,
        single_utterance=sc.single_utterance,
        results=result_options(c),
    )


def _invalid(e: ValueError) -> str:
    field = getattr(e, "field", None)
    return f"{field}: {e}" if field and field not in str(e) else str(e)


def cut_utterances(audio: np.ndarray, settings: EndpointSettings) -> list[Utterance]:
    """A whole channel through the endpointer, as if streamed (tools and tests)."""
    endpointer = Endpointer(settings)
    events = endpointer.feed(audio) + endpointer.flush()
    return [e for e in events if isinstance(e, Utterance)]


class RecordingCutter:
    """A recording for Recognize, a block at a time: decoded, resampled and endpointed per channel (or
    the mixdown), so that memory follows the block, not the file (service/pipeline/audio.py decode_blocks)."""

    def __init__(
        self,
        data: EncodedAudio,
        info: RecordingInfo,
        separate: bool,
        settings: EndpointSettings,
        max_seconds: float | None = None,
    ) -> None:
        self.separate = separate
        self.samples = 0  # decoded so far, per channel, at 16 kHz
        self._blocks = decode_blocks(data, info, max_seconds=max_seconds)
        self._endpointers = [Endpointer(settings) for _ in range(info.channels if separate else 1)]
        self._done = False

    def _tag(self, i: int) -> int:
        return i + 1 if self.separate else 0

    def step(self) -> list[tuple[int, Utterance]] | None:
        """The utterances (channel tag, utterance) that end in the next block; None once all is done."""
        if self._done:
            return None
        block = next(self._blocks, None)
        found: list[tuple[int, Utterance]] = []
        if block is None:
            self._done = True
            for i, endpointer in enumerate(self._endpointers):
                found += [(self._tag(i), e) for e in endpointer.flush() if isinstance(e, Utterance)]
            return found
        self.samples += block.shape[1]
        per_channel = block if self.separate else mixdown(block)[None]
        for i, (endpointer, x) in enumerate(zip(self._endpointers, per_channel, strict=True)):
            found += [(self._tag(i), e) for e in endpointer.feed(x) if isinstance(e, Utterance)]
        return found


class RecognizerServicer(asr_pb2_grpc.RecognizerServicer):
    def __init__(
        self,
        config: ServerConfig,
        engine: RecognitionEngine | None = None,
        stream_limit: StreamLimit | None = None,
    ) -> None:
        self.config = config
        self.engine = engine  # None while the model loads: calls are refused UNAVAILABLE
        # --max-streams, shared by every frontend process of asr-server (service/core/stream_limit.py)
        self.stream_limit = stream_limit or StreamLimit(config.max_streams)
        self.draining = False
        self.sessions: set[StreamSession] = set()
        self._reserved = 0  # streams of this process admitted (and holding a place under the limit)
        self._recognizing = 0  # Recognize calls (and HTTP transcriptions) under way
        self._idle = asyncio.Event()
        self._idle.set()
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}"

    # --- lifecycle (server.py) ---

    def drain(self) -> None:
        """Refuse new calls; every open stream sends RECONNECT, finishes what it heard and ends OK."""
        self.draining = True
        for session in list(self.sessions):
            session.drain()

    async def wait_idle(self, seconds: float) -> bool:
        """Wait until no stream is open, at most `seconds`; True if none is."""
        try:
            async with asyncio.timeout(seconds):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    def _check_available(self) -> RecognitionEngine:
        if self.draining:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another replica")
        if self.engine is None:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, "model is still loading; retry shortly")
        return self.engine

    # --- StreamingRecognize ---

    async def StreamingRecognize(
        self,
        request_iterator: AsyncIterator[asr_pb2.StreamingRecognizeRequest],
        context: aio.ServicerContext,
    ) -> AsyncIterator[asr_pb2.StreamingRecognizeResponse]:
        code = grpc.StatusCode.OK
        session: StreamSession | None = None
        admitted = released = False

        def release(code_name: str) -> None:
            """Give back what the stream holds (its place under max_streams, its engine slots): once,
            from whichever comes first of the handler's end and the RPC's end."""
            nonlocal released
            if released:
                return
            released = True
            if session is not None:
                self.sessions.discard(session)
                session.abandon()
            if admitted:
                self.stream_limit.release()
                self._reserved -= 1
                metrics.ACTIVE_STREAMS.dec()
                if self._reserved == 0:
                    self._idle.set()
            metrics.STREAMS.labels(code_name).inc()

        def rpc_done(ctx: aio.ServicerContext) -> None:
            # A cancel or deadline that lands while the generator is parked at `yield` (gRPC sending a
            # response) ends the RPC without resuming the generator: its `finally` would only run when
            # it is garbage-collected, and until then the stream would hold its place and its slots.
            remaining = ctx.time_remaining()
            expired = remaining is not None and remaining <= 0
            release((grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED).name)

        try:
            # Refusals come after the first request is read, never before: a grpc.aio client whose first
            # write races a status reports INTERNAL instead of it (grpc/grpc#36066). The config is the
            # first thing any client sends, so this is still at once.
            try:
                async with asyncio.timeout(FIRST_REQUEST_TIMEOUT_S):
                    first = await anext(aiter(request_iterator), None)
            except TimeoutError:
                raise StreamError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"first request must carry streaming_config; none came within {FIRST_REQUEST_TIMEOUT_S:g} s",
                ) from None
            engine = self._check_available()
            if not self.stream_limit.try_acquire():
                raise StreamError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"server is at its limit of {self.stream_limit.limit} concurrent streams (max_streams)",
                )
            self._reserved += 1
            self._idle.clear()
            admitted = True
            metrics.ACTIVE_STREAMS.inc()
            context.add_done_callback(rpc_done)  # type: ignore[arg-type]
            if first is None or first.WhichOneof("streaming_request") != "streaming_config":
                raise StreamError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "first request must carry streaming_config (then audio_content in later requests)",
                )
            try:
                settings = stream_settings(first.streaming_config, engine)
            except ValueError as e:  # AudioFormatError and EndpointingError are ValueErrors naming the field
                raise StreamError(grpc.StatusCode.INVALID_ARGUMENT, _invalid(e)) from e
            session = StreamSession(f"s{self._prefix}-{next(self._ids)}", settings, engine, self.config)
            self.sessions.add(session)
            # Headers now, not with the first result: they tell the client its stream was accepted, so it
            # starts sending audio only then. A client still writing when a refusal arrives gets INTERNAL
            # instead of the refusal from grpc.aio (grpc/grpc#36066); RecognizerClient waits for this.
            await context.send_initial_metadata(((STREAM_ID_HEADER, session.id),))
            log.debug("stream started", extra={"fields": {"stream_id": session.id, "peer": context.peer()}})
            async for response in session.responses(request_iterator):
                yield response
        except StreamError as e:
            code = e.code
            await context.abort(e.code, e.message)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = grpc.StatusCode.UNKNOWN
            raise
        finally:
            release(code.name)
            if session is not None:
                await session.close()  # wait for its tasks to stop

    # --- Recognize ---

    async def Recognize(
        self, request: asr_pb2.RecognizeRequest, context: aio.ServicerContext
    ) -> asr_pb2.RecognizeResponse:
        started = time.perf_counter()
        try:
            return await self._recognize(request.config, request.audio_content)
        except StreamError as e:
            await context.abort(e.code, e.message)
            raise  # unreachable: abort raises
        finally:
            metrics.RECOGNIZE_SECONDS.observe(time.perf_counter() - started)

    async def _recognize(self, c: asr_pb2.RecognitionConfig, data: EncodedAudio) -> asr_pb2.RecognizeResponse:
        """One recording, for gRPC Recognize and the HTTP door alike: at most --max-recognize-calls at once.
        `data` is read in place, never copied: gRPC passes `request.audio_content` read once (each read of
        a bytes field is a fresh copy, upb), the HTTP door the buffer it read the upload into."""
        engine = self._check_available()
        if self._recognizing >= self.config.max_recognize_calls:
            raise StreamError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server is at its limit of {self.config.max_recognize_calls} concurrent Recognize calls "
                "(max_recognize_calls); recorded work waits for live calls, retry with backoff",
            )
        self._recognizing += 1
        try:
            return await self._recognize_recording(engine, c, data)
        finally:
            self._recognizing -= 1

    async def _recognize_recording(
        self, engine: RecognitionEngine, c: asr_pb2.RecognitionConfig, data: EncodedAudio
    ) -> asr_pb2.RecognizeResponse:
        if not data:
            raise StreamError(grpc.StatusCode.INVALID_ARGUMENT, "audio_content is empty")
        if len(data) > self.config.max_recognize_bytes:
            raise StreamError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"audio_content of {len(data)} bytes is over the limit of "
                f"{self.config.max_recognize_bytes} bytes (max_recognize_bytes); use StreamingRecognize",
            )
        limit_s = self.config.max_recognize_seconds
        try:
            encoding = encoding_name(c.encoding)
            # Recorded work: served after live calls, in its own share of the engine (engine/policy.py).
            options = dataclasses.replace(decode_options(c, engine), priority=Priority.RECORDED)
            result_opts = result_options(c)
            # The header (or the byte count) says how long the recording is: a small FLAC of silence
            # can hold hours, so the length is checked before anything is decoded.
            info = probe_recording(data, encoding, c.sample_rate_hertz, c.audio_channel_count)
        except ValueError as e:
            raise StreamError(grpc.StatusCode.INVALID_ARGUMENT, _invalid(e)) from e
        if info.seconds > limit_s:
            raise _too_long(f"audio_content holds {info.seconds:.0f} s of audio", limit_s)
        separate = c.enable_separate_recognition_per_channel and info.channels > 1
        mode = "mono" if info.channels == 1 else ("separate" if separate else "mixdown")
        cutter = RecordingCutter(data, info, separate, EndpointSettings(), limit_s)
        del data  # the cutter holds the one copy it reads from
        window: collections.deque[tuple[int, Utterance, UtteranceHandle]] = collections.deque()
        jobs: list[tuple[int, Utterance]] = []
        transcripts: list[Transcript] = []

        async def settle_oldest() -> None:
            tag, u, handle = window[0]
            while True:
                try:
                    transcripts.append(await await_transcript(handle))
                    break
                except EngineOverloaded:
                    # An engine in another process refuses on the future, not in submit(): once one of
                    # our own later utterances is done (a place freed), this one goes in again.
                    pending = [asyncio.wrap_future(h.future) for _, _, h in window if not h.future.done()]
                    if not pending:
                        raise  # nothing of ours to wait for: the server is busy with other calls
                    await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    handle = engine.submit(u.audio, options, ready_time=time.monotonic())
                    window[0] = (tag, u, handle)
            window.popleft()
            jobs.append((tag, u))

        async def submit(u: Utterance) -> UtteranceHandle:
            while True:
                try:
                    return engine.submit(u.audio, options, ready_time=time.monotonic())
                except EngineOverloaded:
                    if not window:
                        raise  # nothing of ours to wait for: the server is busy with other calls
                    await settle_oldest()  # a recording can wait: our oldest frees a place first

        # A bounded window of utterances in flight per call: a recording of any length is fed to the
        # engine as it is decoded, and one long file cannot fill the engine's queue ahead of live calls.
        try:
            while (found := await asyncio.to_thread(cutter.step)) is not None:
                for tag, u in found:
                    while len(window) >= self.config.recognize_inflight:
                        await settle_oldest()
                    window.append((tag, u, await submit(u)))
            while window:
                await settle_oldest()
        except AudioTooLong as e:  # the header claimed less than the file holds
            raise _too_long(str(e), limit_s) from e
        except ValueError as e:
            if isinstance(e, AudioFormatError):
                raise StreamError(grpc.StatusCode.INVALID_ARGUMENT, _invalid(e)) from e
            raise engine_refusal(e) from e
        except (EngineOverloaded, EngineStopped) as e:
            raise engine_refusal(e) from e
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("recognize failed")
            raise StreamError(grpc.StatusCode.INTERNAL, f"recognition failed: {type(e).__name__}: {e}") from e
        finally:
            for _, _, h in window:  # frees their slots if the call failed or the client went away
                if not h.future.done():
                    h.cancel()
                    metrics.UTTERANCES.labels("cancelled").inc()
        metrics.AUDIO_SECONDS.labels(mode).inc(cutter.samples / TARGET_RATE)
        # Each channel's utterances are redacted together (a card number may span two of them).
        results = []
        for result in recognize_results(jobs, transcripts, result_opts):
            metrics.UTTERANCES.labels("empty" if result is None else "final").inc()
            if result is not None:
                results.append(result)
        results.sort(key=lambda r: (r.start_offset.ToNanoseconds(), r.channel_tag))
        return asr_pb2.RecognizeResponse(
            results=results, total_audio_duration=duration(cutter.samples / TARGET_RATE)
        )


def _too_long(what: str, limit_s: float) -> StreamError:
    return StreamError(
        grpc.StatusCode.OUT_OF_RANGE,
        f"{what}, over the limit of {limit_s:g} s (max_recognize_seconds); "
        "split the recording or use StreamingRecognize",
    )
