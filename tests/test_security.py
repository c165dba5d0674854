"""Security against real loopback servers: bearer tokens (file, env, rotation), TLS and mutual TLS with
certificates made here, and no transcript text in logs unless --log-transcripts asks for it."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import REGISTRY

from clients import cli
from clients.client import RecognizerClient, Tls
from clients.scoring import corpus_wer, normalize
from engine import Engine
from service.config import ServerConfig
from service.doors.shared.auth import ENV_VAR
from service.runtime.logging import JsonFormatter
from tests.support.audio import make_conversation, silence, speak, to_linear16_bytes
from tests.support.calls import audio_requests, config_request, run_stream
from tests.support.certs import Pki, make_pki
from tests.support.server import HOST, ServerThread

pytestmark = pytest.mark.slow

TOKEN_A = "tok-alpha-6f1d2c"
TOKEN_B = "tok-bravo-93e0aa"
SILENCE_CONFIG = asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=16000)
SILENCE = to_linear16_bytes(silence(0.5))
SENTENCE = "The technician will visit your home on Thursday afternoon."


def handled(code: str, method: str = "Recognize") -> float:
    labels = {"grpc_type": "unary", "grpc_service": "asr.v1.Recognizer", "grpc_method": method}
    return REGISTRY.get_sample_value("grpc_server_handled_total", {**labels, "grpc_code": code}) or 0.0


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(f"# call-center integrations\n{TOKEN_A}\n\n  {TOKEN_B}  # second system\n")
    return path


@pytest.fixture(scope="module")
def auth_server(service_engine: Engine, tokens_file: Path) -> Iterator[ServerThread]:
    server = ServerThread(ServerConfig(auth_tokens_file=str(tokens_file)), service_engine).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def recognize_silence(client: RecognizerClient) -> asr_pb2.RecognizeResponse:
    return await client.recognize(SILENCE, SILENCE_CONFIG, deadline_s=30)


async def expect_code(coro: object, code: grpc.StatusCode) -> str:
    with pytest.raises(aio.AioRpcError) as e:
        await coro  # type: ignore[misc]
    assert e.value.code() == code, e.value
    return e.value.details() or ""


# --- bearer tokens ---


async def test_recognize_needs_a_known_bearer_token(
    auth_server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    refused_before = handled("UNAUTHENTICATED")
    async with RecognizerClient(auth_server.target) as client:
        details = await expect_code(recognize_silence(client), grpc.StatusCode.UNAUTHENTICATED)
        assert "authorization: Bearer <token>" in details
    async with RecognizerClient(auth_server.target, token="tok-guessed") as client:
        details = await expect_code(recognize_silence(client), grpc.StatusCode.UNAUTHENTICATED)
        assert details == "invalid bearer token"
    async with aio.insecure_channel(auth_server.target) as channel:
        call = asr_pb2_grpc.RecognizerStub(channel).Recognize(
            asr_pb2.RecognizeRequest(config=SILENCE_CONFIG, audio_content=SILENCE),
            metadata=(("authorization", f"Basic {TOKEN_A}"),),
        )
        assert "expected 'Bearer <token>'" in await expect_code(call, grpc.StatusCode.UNAUTHENTICATED)
    for token in (TOKEN_A, TOKEN_B):  # comments, blank lines and spaces in the file are ignored
        async with RecognizerClient(auth_server.target, token=token) as client:
            response = await recognize_silence(client)
        assert response.total_audio_duration.ToTimedelta().total_seconds() == pytest.approx(0.5)
    # refused calls are counted by the metrics interceptor, and no token (good or bad) reaches the logs
    assert handled("UNAUTHENTICATED") - refused_before == 3
    logged = "\n".join(JsonFormatter().format(r) for r in caplog.records)
    assert "unauthenticated calls refused" in logged
    for secret in ("tok-guessed", TOKEN_A, TOKEN_B):
        assert secret not in logged


async def test_streaming_needs_a_token_and_works_with_one(auth_server: ServerThread) -> None:
    audio, _ = make_conversation([SENTENCE], pause_s=0.8)
    requests = [config_request(), *audio_requests(to_linear16_bytes(audio))]
    async with aio.insecure_channel(auth_server.target) as channel:
        refused = await run_stream(channel, requests)
        served = await run_stream(channel, requests, metadata=(("authorization", f"Bearer {TOKEN_B}"),))
    assert refused.code == grpc.StatusCode.UNAUTHENTICATED, refused
    assert "authorization: Bearer <token>" in refused.details
    assert not refused.responses
    assert served.code == grpc.StatusCode.OK, served
    assert corpus_wer([SENTENCE], [served.text]) <= 0.2, served.text


async def test_health_open_for_probes_reflection_protected(auth_server: ServerThread) -> None:
    async with aio.insecure_channel(auth_server.target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="asr.v1.Recognizer"), timeout=30
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(aio.AioRpcError) as e:
            async for _ in stub.ServerReflectionInfo(iter([request]), timeout=30):
                pass
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        listed = [
            s.name
            async for r in stub.ServerReflectionInfo(
                iter([request]), timeout=30, metadata=(("authorization", f"Bearer {TOKEN_A}"),)
            )
            for s in r.list_services_response.service
        ]
        assert "asr.v1.Recognizer" in listed


async def test_health_closed_when_asked(service_engine: Engine, tokens_file: Path) -> None:
    server = ServerThread(
        ServerConfig(auth_tokens_file=str(tokens_file), auth_health_open=False), service_engine
    ).start()
    try:
        async with RecognizerClient(server.target) as client:
            assert "Bearer" in await expect_code(client.health(), grpc.StatusCode.UNAUTHENTICATED)
        async with RecognizerClient(server.target, token=TOKEN_A) as client:
            assert await client.health() == "SERVING"
    finally:
        server.stop()


async def test_token_rotation_by_rewriting_the_file_needs_no_restart(
    service_engine: Engine, tmp_path: Path
) -> None:
    path = tmp_path / "tokens"
    path.write_text("old-token-1111\n")
    server = ServerThread(ServerConfig(auth_tokens_file=str(path)), service_engine).start()
    try:
        async with RecognizerClient(server.target, token="old-token-1111") as client:
            await recognize_silence(client)
        # the way a Kubernetes Secret changes: a new file swapped in under the same name
        staged = tmp_path / "tokens.new"
        staged.write_text("new-token-2222\n")
        os.replace(staged, path)
        async with RecognizerClient(server.target, token="old-token-1111") as client:
            await expect_code(recognize_silence(client), grpc.StatusCode.UNAUTHENTICATED)
        async with RecognizerClient(server.target, token="new-token-2222") as client:
            await recognize_silence(client)
        # an unreadable file mid-rotation keeps the last good tokens rather than locking everyone out
        path.unlink()
        async with RecognizerClient(server.target, token="new-token-2222") as client:
            await recognize_silence(client)
        # an emptied file locks everyone out (auth never turns itself off)
        path.write_text("# no tokens\n")
        async with RecognizerClient(server.target, token="new-token-2222") as client:
            await expect_code(recognize_silence(client), grpc.StatusCode.UNAUTHENTICATED)
    finally:
        server.stop()


async def test_tokens_from_the_environment(service_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, " env-token-1 , env-token-2,")
    server = ServerThread(ServerConfig(), service_engine).start()
    monkeypatch.delenv(ENV_VAR)  # read once, at start
    try:
        for token in ("env-token-1", "env-token-2"):
            async with RecognizerClient(server.target, token=token) as client:
                await recognize_silence(client)
        async with RecognizerClient(server.target, token="env-token") as client:
            await expect_code(recognize_silence(client), grpc.StatusCode.UNAUTHENTICATED)
    finally:
        server.stop()


def test_unreadable_tokens_file_refuses_to_start(tmp_path: Path) -> None:
    from service.config import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--auth-tokens-file", str(tmp_path / "missing")])
    assert "--auth-tokens-file" in str(e.value) and "not a readable file" in str(e.value)


# --- TLS and mutual TLS ---


async def test_tls_server(service_engine: Engine, pki: Pki) -> None:
    server = ServerThread(
        ServerConfig(tls_cert=str(pki.server.cert), tls_key=str(pki.server.key)), service_engine
    ).start()
    try:
        async with RecognizerClient(server.target, tls=Tls(ca_cert=str(pki.ca))) as client:
            assert await client.health() == "SERVING"
            await recognize_silence(client)
        async with RecognizerClient(server.target) as client:  # plaintext to a TLS port
            await expect_code(recognize_silence(client), grpc.StatusCode.UNAVAILABLE)
        async with RecognizerClient(server.target, tls=Tls(ca_cert=str(pki.rogue_ca))) as client:
            await expect_code(recognize_silence(client), grpc.StatusCode.UNAVAILABLE)  # untrusted server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mtls_server(service_engine: Engine, pki: Pki, tokens_file: Path) -> Iterator[ServerThread]:
    """Mutual TLS and bearer tokens together: the certificate says which system, the token that it may."""
    config = ServerConfig(
        tls_cert=str(pki.server.cert),
        tls_key=str(pki.server.key),
        tls_client_ca=str(pki.ca),
        auth_tokens_file=str(tokens_file),
    )
    server = ServerThread(config, service_engine).start()
    yield server
    server.stop()


async def test_mutual_tls_requires_a_client_certificate_from_the_ca(
    mtls_server: ServerThread, pki: Pki
) -> None:
    good = Tls(str(pki.ca), str(pki.client.cert), str(pki.client.key))
    async with RecognizerClient(mtls_server.target, token=TOKEN_A, tls=good) as client:
        await recognize_silence(client)
    async with RecognizerClient(mtls_server.target, tls=good) as client:  # certificate but no token
        await expect_code(recognize_silence(client), grpc.StatusCode.UNAUTHENTICATED)
    for tls in (
        Tls(str(pki.ca)),  # no client certificate
        Tls(str(pki.ca), str(pki.rogue_client.cert), str(pki.rogue_client.key)),  # signed by another CA
    ):
        async with RecognizerClient(mtls_server.target, token=TOKEN_A, tls=tls) as client:
            await expect_code(recognize_silence(client), grpc.StatusCode.UNAVAILABLE)


def test_cli_passes_token_and_mutual_tls(
    mtls_server: ServerThread, pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import soundfile as sf

    wav = tmp_path / "sentence.wav"
    sf.write(wav, speak(SENTENCE), 16000, subtype="PCM_16")
    common = [str(wav), "--server", mtls_server.target, "--recognize", "--ca-cert", str(pki.ca)]
    mtls = ["--client-cert", str(pki.client.cert), "--client-key", str(pki.client.key)]
    cli.main([*common, *mtls, "--token", TOKEN_B])
    out = capsys.readouterr().out
    final = next(line for line in out.splitlines() if line.startswith("["))  # "# ..." lines are metadata
    assert corpus_wer([SENTENCE], [final.split("]", 1)[-1]]) <= 0.2, out
    with pytest.raises(SystemExit) as e:
        cli.main([*common, *mtls, "--token", "not-a-token"])
    assert "UNAUTHENTICATED" in str(e.value)


def test_tls_flags_refused_when_incomplete(pki: Pki) -> None:
    from service.config import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--tls-cert", str(pki.server.cert)])
    assert "--tls-cert and --tls-key go together" in str(e.value)
    with pytest.raises(SystemExit) as e:
        parse_args(["--tls-client-ca", str(pki.ca)])
    assert "--tls-client-ca needs --tls-cert" in str(e.value)


# --- no transcripts in logs unless asked ---


async def _stream_and_capture(target: str, caplog: pytest.LogCaptureFixture) -> tuple[str, str]:
    audio, _ = make_conversation([SENTENCE], pause_s=0.8)
    caplog.clear()
    async with RecognizerClient(target) as client:
        finals = [
            r.alternatives[0].transcript
            async for response in client.stream_file(audio, rate=16000)
            for r in response.results
            if r.is_final
        ]
    logs = "\n".join(JsonFormatter().format(r) for r in caplog.records)
    return " ".join(finals), logs


async def test_transcripts_stay_out_of_logs_unless_asked(
    asr_server: ServerThread, service_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    text, logs = await _stream_and_capture(asr_server.target, caplog)
    assert corpus_wer([SENTENCE], [text]) <= 0.2, text
    assert '"message": "utterance"' in logs  # the per-utterance line was written...
    words = [w for w in normalize(text).split() if len(w) > 4]  # "technician", "visit", "thursday", ...
    assert len(words) >= 3
    for word in words:  # ...without any of what was said
        assert word not in logs.lower(), word

    server = ServerThread(ServerConfig(log_transcripts=True), service_engine).start()
    try:
        text, logs = await _stream_and_capture(server.target, caplog)
    finally:
        server.stop()
    assert text.strip() and text.strip() in logs


# --- what an unauthenticated client can make the server read ---


class CountingRelay:
    """A TCP relay on loopback between a client and the server that counts the bytes the client got to
    send. HTTP/2 flow control lets a client send only what the server has room for, so the count is what
    the server agreed to read."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.sent = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> CountingRelay:
        self._server = await asyncio.start_server(self._relay, HOST, 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    @property
    def target(self) -> str:
        assert self._server is not None
        return f"{HOST}:{self._server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, counted: bool) -> None:
            try:
                while data := await src.read(1 << 16):
                    self.sent += len(data) if counted else 0
                    dst.write(data)
                    await dst.drain()
            finally:
                dst.close()

        await asyncio.gather(
            pump(reader, up_writer, True), pump(up_reader, writer, False), return_exceptions=True
        )


BIG = 60 << 20  # near the 64 MiB a Recognize request may carry (--max-recognize-bytes)
# What a refused client may get to send: the HTTP/2 window the transport grants before any handler reads
# (grpcio 1.85 on loopback, measured with this relay: 4 MiB at once, 8 MiB once its BDP probe has grown
# the window), with room; never its whole message.
UNREAD_BOUND = 16 << 20


async def test_an_unauthenticated_recognize_is_refused_before_its_message_is_read(
    auth_server: ServerThread,
) -> None:
    request = asr_pb2.RecognizeRequest(config=SILENCE_CONFIG, audio_content=bytes(BIG))
    async with CountingRelay(auth_server.target) as relay, aio.insecure_channel(relay.target) as channel:
        call = asr_pb2_grpc.RecognizerStub(channel).Recognize(request, timeout=60)
        assert "Bearer" in await expect_code(call, grpc.StatusCode.UNAUTHENTICATED)
    assert relay.sent < UNREAD_BOUND, f"the server read {relay.sent} bytes of a refused {BIG}-byte request"


async def test_an_unauthenticated_stream_is_refused_before_its_first_message_is_read(
    auth_server: ServerThread,
) -> None:
    first = asr_pb2.StreamingRecognizeRequest(audio_content=bytes(BIG))
    async with CountingRelay(auth_server.target) as relay, aio.insecure_channel(relay.target) as channel:
        refused = await run_stream(channel, [first], deadline_s=60)
    assert refused.code == grpc.StatusCode.UNAUTHENTICATED, refused
    assert relay.sent < UNREAD_BOUND, f"the server read {relay.sent} bytes of a refused {BIG}-byte message"
