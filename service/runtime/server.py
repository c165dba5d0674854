"""One frontend's servers: the gRPC port (grpc.aio: the asr.v1 and Google Speech doors, health, reflection, interceptors)
and the HTTP port (service/runtime/http_server.py: the HTTP doors), both on one recognition core
(service/recognizer/recognizer.py), with the engine's lifecycle and a graceful drain: `AsrServer`.

`asr-server` runs one engine process and N of these servers in frontend processes, their engine an
`EngineClient` (service/runtime/supervisor.py). In-process (tests, embedding) its engine is an `Engine`:
gRPC port first (health NOT_SERVING), model load and warm-up, SERVING.
An engine that dies (its scheduler thread, or its process) turns health NOT_SERVING and ends the
server non-zero, so Kubernetes replaces the pod.
On SIGTERM/SIGINT: NOT_SERVING at once, new calls refused, open streams told to RECONNECT and given
their pending finals, then exit 0 within --drain-seconds.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import time

import grpc
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from riva.client.proto import riva_asr_pb2_grpc

from engine.api import Engine
from engine.process.client import EngineClient
from service import metrics
from service.config import CALL_WEBHOOK_SECRET_ENV, ServerConfig
from service.doors import google_speech
from service.doors.asr_v1 import RecognizerServicer
from service.doors.asterisk.audiosocket import AudioSocketDoor
from service.doors.asterisk.websocket import AsteriskWebSocketDoor
from service.doors.audiohook import AudioHookDoor
from service.doors.call_transcripts import CallTranscriptsDoor
from service.doors.deepgram.door import DeepgramDoor
from service.doors.openai_http import OpenAIHttpDoor
from service.doors.openai_realtime.door import OpenAIRealtimeDoor
from service.doors.riva.servicer import SERVICE_NAME as RIVA_SERVICE_NAME
from service.doors.riva.servicer import RivaServicer
from service.doors.shared.auth import ENV_VAR, AuthInterceptor, TokenStore, read_secret
from service.doors.siprec.door import SiprecDoor
from service.doors.twilio import TwilioDoor
from service.recognizer.call_hub import CallHub
from service.recognizer.recognizer import Recognizer
from service.recognizer.stream_limit import StreamLimit
from service.runtime.call_webhook import CallWebhook
from service.runtime.exits import EXIT_ENGINE_FAILED, EXIT_LOAD_FAILED, EXIT_OK
from service.runtime.http_server import HttpServer
from service.runtime.interceptors import MetricsInterceptor
from service.runtime.message_limit import StreamMessageLimit
from service.runtime.tls import server_credentials
from service.vocabulary.engine import RecognitionEngine

log = logging.getLogger("service.runtime.server")

SERVICE_NAME = asr_pb2.DESCRIPTOR.services_by_name["Recognizer"].full_name  # "asr.v1.Recognizer"


def build_info() -> tuple[str, str]:
    try:
        version = importlib.metadata.version("callcenter-asr")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    # Set at image build time (e.g. --build-arg REVISION=$(git rev-parse --short HEAD)).
    return version, os.environ.get("ASR_REVISION", "unknown")


class AsrServer:
    """One server: gRPC services, health, and the engine's lifecycle. Usable in-process (tests) too.

    The engine is an in-process `Engine` (tests, embedding) or an `EngineClient` to the engine process
    (asr-server's frontend processes, which share the port, `reuse_port`, and the --max-streams count,
    `stream_limit`)."""

    def __init__(
        self,
        config: ServerConfig,
        engine: RecognitionEngine | None = None,
        *,
        reuse_port: bool = False,
        stream_limit: StreamLimit | None = None,
        call_hub: CallHub | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.reuse_port = reuse_port
        self.port = 0
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        # the engine is attached once loaded (load()); `stream_limit`: a count shared with other frontends
        # `call_hub`: the frontends' forwarder (service/recognizer/call_hub.py), else this process's own
        self.recognizer = Recognizer(config, stream_limit=stream_limit, call_hub=call_hub)
        self._server: aio.Server | None = None
        self._shutdown = asyncio.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.http: HttpServer | None = None  # the HTTP doors' port (--http-port), same loop
        self.audiosocket: AudioSocketDoor | None = None  # Asterisk's AudioSocket (--audiosocket-port)
        self.siprec: SiprecDoor | None = None  # the SIPREC recording server (--siprec-port)
        self.call_webhook: CallWebhook | None = None  # --call-webhook-url
        self.http_port = 0

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)  # type: ignore[arg-type]
        metrics.SERVING.set(1 if status == health_pb2.HealthCheckResponse.SERVING else 0)

    async def start(self) -> None:
        """Bind and start serving (health NOT_SERVING until `load` is done)."""
        self._loop = asyncio.get_running_loop()
        c = self.config
        credentials = server_credentials(c.tls_cert, c.tls_key, c.tls_client_ca)
        tokens = TokenStore(c.auth_tokens_file, os.environ.get(ENV_VAR, ""))
        # Metrics outermost, so refused calls are counted (grpc_code="UNAUTHENTICATED").
        interceptors: list[aio.ServerInterceptor] = [MetricsInterceptor()]
        if tokens.enabled:
            interceptors.append(AuthInterceptor(tokens, health_open=c.auth_health_open))
        interceptors.append(StreamMessageLimit(c.max_chunk_bytes))  # innermost: for admitted calls only
        server = aio.server(
            interceptors=interceptors,
            options=[
                # a Recognize request carries a whole recording
                (
                    "grpc.max_receive_message_length",
                    max(c.max_recognize_bytes, c.max_chunk_bytes) + (1 << 16),
                ),
                # never share a port silently with another process (gRPC's default is SO_REUSEPORT);
                # asr-server's frontends do share it, once the supervisor has checked it is free
                ("grpc.so_reuseport", 1 if self.reuse_port else 0),
                *connection_options(c),
            ],
            maximum_concurrent_rpcs=max_concurrent_rpcs(c),
        )
        asr_pb2_grpc.add_RecognizerServicer_to_server(RecognizerServicer(self.recognizer), server)
        server.add_generic_rpc_handlers(google_speech.GoogleSpeechDoor(self.recognizer).handlers())
        riva_asr_pb2_grpc.add_RivaSpeechRecognitionServicer_to_server(RivaServicer(self.recognizer), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                google_speech.SERVICE,
                RIVA_SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{c.host}:{c.port}"
        if credentials is not None:
            self.port = server.add_secure_port(address, credentials)
        else:
            self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind the gRPC port {address}")
        await server.start()
        self._server = server
        if c.http_port:  # the HTTP doors: the same recognition core, tokens and TLS
            self.http = HttpServer(c, reuse_port=self.reuse_port)
            OpenAIHttpDoor(c, self.recognizer, tokens).register(self.http.app)
            DeepgramDoor(c, self.recognizer, tokens).register(self.http.app)
            OpenAIRealtimeDoor(c, self.recognizer, tokens).register(self.http.app)
            TwilioDoor(c, self.recognizer, tokens).register(self.http.app)
            AsteriskWebSocketDoor(c, self.recognizer, tokens).register(self.http.app)
            AudioHookDoor(c, self.recognizer, tokens).register(self.http.app)
            CallTranscriptsDoor(c, self.recognizer, tokens).register(self.http.app)
            self.http_port = await self.http.start()
        if c.call_webhook_url:
            secret = read_secret(c.call_webhook_secret_file, CALL_WEBHOOK_SECRET_ENV).encode()
            self.call_webhook = CallWebhook(c.call_webhook_url, secret, c.call_webhook_queue)
            self.recognizer.call_hub.tap(self.call_webhook.deliver)
        if c.audiosocket_port:
            self.audiosocket = AudioSocketDoor(c, self.recognizer, reuse_port=self.reuse_port)
            await self.audiosocket.start()
        if c.siprec_port:
            self.siprec = SiprecDoor(c, self.recognizer, reuse_port=self.reuse_port)
            await self.siprec.start()
        log.info(
            "listening",
            extra={
                "fields": {
                    "address": c.host,
                    "port": self.port,
                    "http_port": self.http_port,
                    "tls": "mutual" if c.tls_client_ca else ("on" if credentials else "off"),
                    "auth": "bearer" if tokens.enabled else "off",
                }
            },
        )

    async def load(self) -> None:
        """Load (unless given), start and warm the engine, then report SERVING."""
        started = time.perf_counter()
        if self.engine is None:
            engine = await asyncio.to_thread(Engine, self.config.engine)
            self.engine = engine
            engine.start(on_failure=self._on_engine_failure)
            if self.config.engine.warmup:
                await asyncio.to_thread(engine.warmup)
        elif isinstance(self.engine, EngineClient):
            # the engine process going away must end this server as a dead scheduler does
            self.engine.start(on_failure=self._on_engine_failure)
        info = self.engine.info
        metrics.MODEL_INFO.labels(info.name, info.device, info.dtype).set(1)
        log.info(
            "model ready",
            extra={
                "fields": {
                    "model": info.name,
                    "device": info.device,
                    "dtype": info.dtype,
                    "kv_cache_bytes": info.kv_cache_bytes,
                    "load_s": round(time.perf_counter() - started, 2),
                }
            },
        )
        self.recognizer.engine = self.engine
        if not self._shutdown.is_set():
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def _on_engine_failure(self, exc: BaseException) -> None:
        # Called from the scheduler thread.
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._engine_failed, exc)

    def _engine_failed(self, exc: BaseException) -> None:
        log.critical("engine scheduler died; exiting", extra={"fields": {"error": repr(exc)}})
        self._failure = exc
        self.request_shutdown()

    def request_shutdown(self) -> None:
        """SIGTERM/SIGINT (or an engine failure): begin the drain."""
        self._shutdown.set()

    async def drain(self, grace: float | None = None, *, stop_engine: bool = True) -> None:
        """Stop taking calls, let open streams finish what they heard, stop the server and (unless told
        not to: an engine other servers share) the engine."""
        grace = self.config.drain_seconds if grace is None else grace
        deadline = time.monotonic() + grace
        await self.health.enter_graceful_shutdown()  # NOT_SERVING for every service, for good
        metrics.SERVING.set(0)
        self.recognizer.drain()
        n = len(self.recognizer.sessions)
        log.info("draining", extra={"fields": {"open_streams": n, "drain_seconds": grace}})
        # leave a little of the grace for server.stop to close the transport
        idle = await self.recognizer.wait_idle(max(0.0, deadline - time.monotonic() - 0.5))
        if not idle:
            log.warning("drain deadline reached with streams still open; they are cancelled")
        if self.call_webhook is not None:  # every message of this process's calls, within the grace
            await self.call_webhook.flush(deadline - time.monotonic() - 0.5)
        await self.recognizer.call_hub.close()  # subscribers have every message of this process's calls
        if self.audiosocket is not None:
            await self.audiosocket.stop(0)
        if self.siprec is not None:
            await self.siprec.stop(0)
        if self.http is not None:  # HTTP requests in flight get what is left of the grace, as gRPC calls do
            await asyncio.gather(
                self.http.stop(max(0.0, deadline - time.monotonic())), self._stop_grpc(deadline)
            )
        else:
            await self._stop_grpc(deadline)
        if stop_engine and self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        log.info("stopped")

    async def _stop_grpc(self, deadline: float) -> None:
        if self._server is not None:
            await self._server.stop(max(0.0, deadline - time.monotonic()))

    async def run(self) -> int:
        """The whole life of the process; returns its exit code."""
        try:
            await self.start()
        except Exception as e:
            log.error(f"could not start the gRPC server: {e}")
            return EXIT_LOAD_FAILED
        load = asyncio.create_task(self.load())
        stop = asyncio.create_task(self._shutdown.wait())
        await asyncio.wait({load, stop}, return_when=asyncio.FIRST_COMPLETED)
        if load.done() and load.exception() is not None:
            err = load.exception()
            log.error(
                f"could not load model {self.config.engine.model!r}: {err}",
                extra={"fields": {"model": self.config.engine.model, "error": repr(err)}},
            )
            stop.cancel()
            await self.stop()
            return EXIT_LOAD_FAILED
        await stop
        if self._failure is not None:
            await self.health.enter_graceful_shutdown()
            await self.stop()
            return EXIT_ENGINE_FAILED
        if not load.done():  # told to stop while loading: nothing is open yet
            await self.health.enter_graceful_shutdown()
            await self.stop()
            return EXIT_OK
        await self.drain()
        return EXIT_OK

    async def stop(self, grace: float = 1.0, *, stop_engine: bool = True) -> None:
        """Stop at once: calls still open after `grace` seconds are cancelled."""
        await self.recognizer.call_hub.close()
        if self.call_webhook is not None:
            await self.call_webhook.close()
        if self.audiosocket is not None:
            await self.audiosocket.stop(grace)
        if self.siprec is not None:
            await self.siprec.stop(grace)
        if self.http is not None:
            await self.http.stop(grace)
        if self._server is not None:
            await self._server.stop(grace)
        if stop_engine and self.engine is not None:
            await asyncio.to_thread(self.engine.stop)


# Clients may ping a connection this often when neither side sends anything (gRPC's default, 5 min,
# would end with GOAWAY "too_many_pings" a client that keeps its channel warm every 10-60 s, as Google's
# and most gRPC clients' keepalive guides suggest).
CLIENT_PING_MIN_INTERVAL_S = 10.0
CLIENT_PING_STRIKES = 2  # gRPC's default: pings more often than that, twice, and the connection ends
_INT_MAX = 2**31 - 1  # gRPC's integer channel arguments are C ints


def _ms(seconds: float) -> int:
    return min(round(seconds * 1000), _INT_MAX)


def connection_options(c: ServerConfig) -> list[tuple[str, int]]:
    """gRPC keepalive and connection-age options (docs/operations.md "Idle and vanished clients")."""
    options = [
        # the server pings a connection that has been quiet for --keepalive-time; no answer within
        # --keepalive-timeout closes it and cancels its calls (their places and engine work are freed)
        ("grpc.keepalive_time_ms", _ms(c.keepalive_time)),
        ("grpc.keepalive_timeout_ms", _ms(c.keepalive_timeout)),
        # the deadline of the ping's answer is this one in gRPC core (1 min when unset): measured with
        # grpcio 1.85, keepalive_timeout_ms alone closed nothing within 25 s of an unanswered ping
        ("grpc.http2.ping_timeout_ms", _ms(c.keepalive_timeout)),
        # and keeps pinging a connection the client streams to without the server sending anything
        # back (by default gRPC stops after 2 pings without data of its own)
        ("grpc.http2.max_pings_without_data", 0),
        # idle channels may be kept warm by the client's own pings
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(CLIENT_PING_MIN_INTERVAL_S)),
        ("grpc.http2.max_ping_strikes", CLIENT_PING_STRIKES),
    ]
    if c.max_connection_age:
        options += [
            ("grpc.max_connection_age_ms", _ms(c.max_connection_age)),
            # a call in flight is never cut: none is longer than --max-stream-seconds (and a Recognize
            # no longer than --max-recognize-seconds of audio, transcribed faster than real time)
            (
                "grpc.max_connection_age_grace_ms",
                _ms(max(c.max_stream_seconds, c.max_recognize_seconds) + 60),
            ),
        ]
    return options


def max_concurrent_rpcs(c: ServerConfig) -> int:
    """--max-concurrent-rpcs, or its default from --max-streams."""
    return c.max_concurrent_rpcs or c.max_streams + 128


def init_metrics() -> None:
    version, revision = build_info()
    metrics.BUILD_INFO.labels(version, revision).set(1)
    # Children created up front so dashboards see zeros instead of "no data".
    for outcome in ("final", "empty", "cancelled", "error"):
        metrics.UTTERANCES.labels(outcome)
    metrics.STREAMS.labels(grpc.StatusCode.OK.name)
    metrics.HTTP_REQUESTS.labels("200")
    # rate() needs a series before the first call ends, or the error ratio reads NaN at first.
    for grpc_type, method in (("bidi_stream", "StreamingRecognize"), ("unary", "Recognize")):
        metrics.GRPC_HANDLED.labels(grpc_type, SERVICE_NAME, method, grpc.StatusCode.OK.name)
