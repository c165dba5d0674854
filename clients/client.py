"""A Python client for asr.v1.Recognizer: stream a file or an array, recognize a recording, check health.

    async with RecognizerClient("127.0.0.1:50051") as client:
        async for response in client.stream_file("call.wav", realtime=True, interim=True):
            ...
        response = await client.recognize(open("call.flac", "rb").read(), RecognitionConfig(encoding=FLAC))

Audio sources: WAV/FLAC (anything soundfile reads) are sent as LINEAR16 at their own rate and channel
count; raw .ulaw/.alaw files as G.711 at 8 kHz; float arrays ([n] or [channels, n]) as LINEAR16.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Iterable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import soundfile as sf
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE_NAME = "asr.v1.Recognizer"
# The client's sample rates, defined once for clients/. The client speaks only the wire protocol and
# never imports the server's engine package (engine/constants.py), so it keeps its own names for them.
G711_RATE = 8000  # G.711 (mu-law, A-law) is 8 kHz by definition: what a telephone trunk carries
WIDEBAND_RATE = 16000  # LINEAR16 test audio at the rate Whisper hears (the server need not resample)
STREAM_ID_HEADER = "asr-stream-id"  # the server's headers carry it once it accepts a stream
_STOP_LISTENING = (
    asr_pb2.StreamingRecognizeResponse.END_OF_SINGLE_UTTERANCE,
    asr_pb2.StreamingRecognizeResponse.RECONNECT,
)
# 1 MiB is the server's default per-request limit; whole recordings can be larger.
MAX_MESSAGE_BYTES = 64 << 20
REDACTIONS = ("pci", "ssn", "numbers")  # RecognitionConfig.redact, as asr-client --redact spells them


def redactions(text: str | Sequence[str] | None) -> list[int]:
    """ "pci,ssn" (or ["pci", "ssn"]) -> [asr_pb2.PCI, asr_pb2.SSN]; ValueError naming the unknown one."""
    names = text.split(",") if isinstance(text, str) else list(text or ())
    values = []
    for name in (n.strip().lower() for n in names):
        if not name:
            continue
        if name not in REDACTIONS:
            raise ValueError(
                f"redact must be a comma-separated list of {', '.join(REDACTIONS)}, got {name!r}"
            )
        values.append(asr_pb2.Redaction.Value(name.upper()))
    return values


_G711_SUFFIXES = {".ulaw": "MULAW", ".mulaw": "MULAW", ".mu": "MULAW", ".alaw": "ALAW", ".al": "ALAW"}
_RAW_PCM_SUFFIXES = {".raw", ".pcm", ".s16", ".l16"}


def _options(
    separate_channels: bool,
    language: str | None,
    prompt: str | None,
    segment_offsets: bool,
    redact: Sequence[int],
    keyterms: Sequence[str],
    formatting: int,
) -> dict[str, Any]:
    """The RecognitionConfig fields a stream and a whole recording are both asked with."""
    return {
        "enable_separate_recognition_per_channel": separate_channels,
        "language_code": language or "",
        "prompt": prompt or "",
        "enable_segment_time_offsets": segment_offsets,
        "redact": redact,
        "keyterms": keyterms,
        "formatting": formatting,
    }


@dataclass(frozen=True)
class Tls:
    """TLS settings: the CA that signed the server (None: system roots) and an optional client pair (mTLS)."""

    ca_cert: str | None = None
    client_cert: str | None = None
    client_key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_cert),
            private_key=read(self.client_key),
            certificate_chain=read(self.client_cert),
        )


@dataclass(frozen=True)
class Audio:
    """Audio ready for the wire."""

    data: bytes
    encoding: int  # asr_pb2.AudioEncoding
    sample_rate_hertz: int
    channels: int

    @property
    def frame_bytes(self) -> int:
        return self.channels * (2 if self.encoding == asr_pb2.LINEAR16 else 1)

    @property
    def duration_s(self) -> float:
        return len(self.data) / self.frame_bytes / self.sample_rate_hertz


def float_to_linear16(audio: np.ndarray) -> bytes:
    """[n] or [channels, n] float in [-1, 1] -> interleaved signed 16-bit little-endian."""
    x = np.atleast_2d(np.asarray(audio, dtype=np.float32)).T
    return (np.clip(x, -1.0, 1.0) * 32767).round().astype("<i2").tobytes()


def load_audio(
    source: str | Path | np.ndarray,
    encoding: str = "auto",
    rate: int | None = None,
    channels: int | None = None,
) -> Audio:
    """Read a file or take an array, and say how it goes on the wire (see the module docstring)."""
    encoding = encoding.upper()
    if isinstance(source, np.ndarray):
        if rate is None:
            raise ValueError("rate is required for an array")
        x = np.atleast_2d(source)
        return Audio(float_to_linear16(x), asr_pb2.LINEAR16, rate, x.shape[0])
    path = Path(source)
    suffix = path.suffix.lower()
    if encoding in ("MULAW", "ALAW") or (encoding == "AUTO" and suffix in _G711_SUFFIXES):
        name = _G711_SUFFIXES.get(suffix, "MULAW") if encoding == "AUTO" else encoding
        return Audio(path.read_bytes(), asr_pb2.AudioEncoding.Value(name), rate or G711_RATE, channels or 1)
    if encoding == "LINEAR16" and suffix in _RAW_PCM_SUFFIXES:
        if rate is None:
            raise ValueError(f"{path}: raw PCM needs --rate")
        return Audio(path.read_bytes(), asr_pb2.LINEAR16, rate, channels or 1)
    if encoding not in ("AUTO", "LINEAR16"):
        raise ValueError(f"encoding must be auto, LINEAR16, MULAW or ALAW, got {encoding}")
    pcm, file_rate = sf.read(str(path), dtype="int16", always_2d=True)  # [n, channels]
    return Audio(pcm.astype("<i2").tobytes(), asr_pb2.LINEAR16, file_rate, pcm.shape[1])


def chunks_of(audio: Audio, chunk_ms: float) -> list[bytes]:
    """Whole frames per chunk, `chunk_ms` of audio each (the last may be shorter)."""
    step = max(1, round(audio.sample_rate_hertz * chunk_ms / 1000)) * audio.frame_bytes
    return [audio.data[i : i + step] for i in range(0, len(audio.data), step)]


async def paced(chunks: Sequence[bytes], chunk_s: float, realtime: bool) -> AsyncIterator[bytes]:
    """The chunks, at the audio's own pace when `realtime` (a live call), else as fast as the wire takes."""
    start = time.monotonic()
    for i, chunk in enumerate(chunks):
        if realtime:
            delay = start + i * chunk_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        yield chunk


class RecognizerClient:
    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: Tls | bool | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        """`tls`: None/False for plaintext (loopback, in-cluster with a mesh), True for system roots,
        or a Tls. `token` goes out as `authorization: Bearer <token>`."""
        self.target = target
        self.token = token
        self.tls = Tls() if tls is True else (tls or None)
        self.options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            *options,
        ]
        self._channel: aio.Channel | None = None

    # --- connection ---

    @property
    def channel(self) -> aio.Channel:
        # created on first use, inside the caller's event loop
        if self._channel is None:
            if self.tls is not None:
                self._channel = aio.secure_channel(self.target, self.tls.credentials(), options=self.options)
            else:
                self._channel = aio.insecure_channel(self.target, options=self.options)
        return self._channel

    @property
    def stub(self) -> asr_pb2_grpc.RecognizerStub:
        return asr_pb2_grpc.RecognizerStub(self.channel)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None

    async def __aenter__(self) -> RecognizerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- health ---

    async def health(self, service: str = SERVICE_NAME, deadline_s: float = 5.0) -> str:
        """The server's health status name for `service` ("SERVING", "NOT_SERVING", ...)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = await stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=deadline_s, metadata=self.metadata()
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def wait_until_serving(self, within_s: float = 120.0) -> None:
        """Poll health until SERVING (the model loads and warms up first); TimeoutError if it never is."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                if await self.health(deadline_s=max(0.1, min(5.0, deadline - time.monotonic()))) == "SERVING":
                    return
            except aio.AioRpcError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.target} not SERVING after {within_s:g} s")
            await asyncio.sleep(0.2)

    # --- streaming ---

    async def stream(
        self,
        config: asr_pb2.StreamingRecognitionConfig,
        chunks: AsyncIterable[bytes] | Iterable[bytes],
        *,
        deadline_s: float | None = None,
    ) -> AsyncGenerator[asr_pb2.StreamingRecognizeResponse, None]:
        """The raw stream: `config`, then each chunk as audio_content; yields every response.
        Leaving the loop early (or closing the generator) cancels the call on the server."""

        stop_sending = asyncio.Event()
        call_over = asyncio.Event()

        async def requests() -> AsyncIterator[asr_pb2.StreamingRecognizeRequest]:
            # grpc.aio reports INTERNAL (or CANCELLED) instead of the server's status when a write or the
            # half-close races the server ending the call (grpc/grpc#36066). So: audio goes only after
            # the server's headers say the stream was accepted, and when the server ends the stream
            # itself (a refusal, RECONNECT, END_OF_SINGLE_UTTERANCE) this side neither writes nor
            # half-closes, it waits for the end of the call.
            yield asr_pb2.StreamingRecognizeRequest(streaming_config=config)
            headers = await call.initial_metadata()
            if not any(key == STREAM_ID_HEADER for key, _ in headers or ()):
                await call_over.wait()  # refused: the call's status says why
                return
            if isinstance(chunks, AsyncIterable):
                async for chunk in chunks:
                    if stop_sending.is_set():
                        break
                    yield asr_pb2.StreamingRecognizeRequest(audio_content=chunk)
            else:
                for chunk in chunks:
                    if stop_sending.is_set():
                        break
                    yield asr_pb2.StreamingRecognizeRequest(audio_content=chunk)
            if stop_sending.is_set():
                await call_over.wait()

        call = self.stub.StreamingRecognize(requests(), metadata=self.metadata(), timeout=deadline_s)
        try:
            async for response in call:
                if response.speech_event_type in _STOP_LISTENING:
                    stop_sending.set()  # the server hears no more audio on this stream and will end it
                yield response
        finally:
            call_over.set()
            call.cancel()  # no-op once the call has ended

    async def stream_file(
        self,
        source: str | Path | np.ndarray,
        encoding: str = "auto",
        rate: int | None = None,
        channels: int | None = None,
        chunk_ms: float = 20,
        realtime: bool = False,
        interim: bool = False,
        separate_channels: bool = False,
        single_utterance: bool = False,
        prompt: str | None = None,
        language: str | None = None,
        segment_offsets: bool = False,
        endpointing: asr_pb2.EndpointingConfig | None = None,
        deadline_s: float | None = None,
        redact: Sequence[int] = (),
        keyterms: Sequence[str] = (),
        formatting: int = asr_pb2.FORMATTING_UNSPECIFIED,
    ) -> AsyncIterator[asr_pb2.StreamingRecognizeResponse]:
        """Stream a file or array in `chunk_ms` chunks (paced in real time if asked); yields responses.
        `redact`: asr_pb2.Redaction values (see redactions()); `formatting`: an asr_pb2.Formatting value."""
        audio = load_audio(source, encoding, rate, channels)
        config = asr_pb2.StreamingRecognitionConfig(
            config=asr_pb2.RecognitionConfig(
                encoding=audio.encoding,  # type: ignore[arg-type]
                sample_rate_hertz=audio.sample_rate_hertz,
                audio_channel_count=audio.channels,
                **_options(
                    separate_channels, language, prompt, segment_offsets, redact, keyterms, formatting
                ),
            ),
            single_utterance=single_utterance,
            interim_results=interim,
            endpointing=endpointing,
        )
        chunks = paced(chunks_of(audio, chunk_ms), chunk_ms / 1000, realtime)
        async with aclosing(self.stream(config, chunks, deadline_s=deadline_s)) as responses:
            async for response in responses:
                yield response

    # --- whole recordings ---

    async def recognize(
        self, audio: bytes, config: asr_pb2.RecognitionConfig, *, deadline_s: float | None = None
    ) -> asr_pb2.RecognizeResponse:
        request = asr_pb2.RecognizeRequest(config=config, audio_content=audio)
        return await self.stub.Recognize(request, metadata=self.metadata(), timeout=deadline_s)

    async def recognize_file(
        self,
        path: str | Path,
        encoding: str = "auto",
        rate: int | None = None,
        channels: int | None = None,
        separate_channels: bool = False,
        prompt: str | None = None,
        language: str | None = None,
        segment_offsets: bool = False,
        deadline_s: float | None = None,
        redact: Sequence[int] = (),
        keyterms: Sequence[str] = (),
        formatting: int = asr_pb2.FORMATTING_UNSPECIFIED,
    ) -> asr_pb2.RecognizeResponse:
        """FLAC and WAV files go as they are (the server reads their header); G.711 files as raw bytes.
        `redact`: asr_pb2.Redaction values (see redactions()); `formatting`: an asr_pb2.Formatting value."""
        path = Path(path)
        whole = path.read_bytes()
        head = whole[:4]
        if encoding.upper() == "AUTO" and head in (b"fLaC", b"RIFF"):
            data, enc, rate, channels = whole, (asr_pb2.FLAC if head == b"fLaC" else asr_pb2.WAV), 0, 0
        else:
            audio = load_audio(path, encoding, rate, channels)
            data, enc, rate, channels = audio.data, audio.encoding, audio.sample_rate_hertz, audio.channels
        config = asr_pb2.RecognitionConfig(
            encoding=enc,  # type: ignore[arg-type]
            sample_rate_hertz=rate or 0,
            audio_channel_count=channels or 0,
            **_options(separate_channels, language, prompt, segment_offsets, redact, keyterms, formatting),
        )
        return await self.recognize(data, config, deadline_s=deadline_s)


def transcribe(target: str, path: str | Path, **kwargs: Any) -> list[asr_pb2.SpeechRecognitionResult]:
    """Synchronous convenience: Recognize one file and return its results."""

    async def run() -> list[asr_pb2.SpeechRecognitionResult]:
        async with RecognizerClient(
            target, token=kwargs.pop("token", None), tls=kwargs.pop("tls", None)
        ) as c:
            return list((await c.recognize_file(path, **kwargs)).results)

    return asyncio.run(run())
