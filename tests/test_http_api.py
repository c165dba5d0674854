"""The OpenAI-compatible HTTP door, end to end through a real server on loopback: the official `openai`
client (which nobody here wrote) and curl, against the same engine, tokens and limits as gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import itertools
import json
import re
import socket
import ssl
import subprocess
import threading
import time
import tracemalloc
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import soundfile as sf
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from clients.client import RecognizerClient
from clients.scoring import normalize
from engine import Engine
from service.config import ServerConfig
from service.doors.openai_http import TRANSCRIPTIONS_PATH as TRANSCRIPTIONS
from tests.support.audio import JFK_FLAC, RATE, speak
from tests.support.certs import Pem, make_pki
from tests.support.server import HOST, ServerProcess, ServerThread

pytestmark = pytest.mark.slow
TOKEN = "http-test-token"
ASK_NOT = "ask not what your country can do for you"


@pytest.fixture(scope="module")
def http_server(service_engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    server = ServerThread(ServerConfig(auth_tokens_file=str(tokens)), service_engine, http=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(http_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=http_server.http_url + "/v1", api_key=TOKEN, max_retries=0, timeout=120)


def transcribe(client: openai.OpenAI, **kwargs: object) -> object:
    with open(JFK_FLAC, "rb") as f:
        return client.audio.transcriptions.create(model="whisper-1", file=f, **kwargs)  # type: ignore[call-overload]


def http_count(code: str) -> float:
    return REGISTRY.get_sample_value("asr_http_requests_total", {"code": code}) or 0.0


def curl(*args: str) -> tuple[int, str]:
    """(HTTP status, body) of one curl call."""
    proc = subprocess.run(
        ["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    body, _, status = proc.stdout.rpartition("\n")
    return int(status), body


def test_json_is_the_same_text_as_grpc_recognize(client: openai.OpenAI, http_server: ServerThread) -> None:
    before = http_count("200")
    recognized = REGISTRY.get_sample_value("asr_recognize_seconds_count") or 0.0
    result = transcribe(client)
    assert ASK_NOT in normalize(result.text)  # type: ignore[attr-defined]
    assert http_count("200") == before + 1
    assert REGISTRY.get_sample_value("asr_recognize_seconds_count") == recognized + 1  # as a gRPC Recognize

    async def grpc_text() -> str:
        async with RecognizerClient(http_server.target, token=TOKEN) as c:
            response = await c.recognize_file(JFK_FLAC)
        return " ".join(r.alternatives[0].transcript for r in response.results)

    # one path for both doors: the same recording gives the same words
    assert normalize(result.text) == normalize(http_server.call(grpc_text(), timeout=120))  # type: ignore[attr-defined]


def test_text_format(client: openai.OpenAI) -> None:
    text = transcribe(client, response_format="text")
    assert isinstance(text, str)
    assert ASK_NOT in normalize(text)


def test_verbose_json_has_timed_segments(client: openai.OpenAI) -> None:
    result = transcribe(client, response_format="verbose_json", timestamp_granularities=["segment"])
    assert result.language == "english"  # type: ignore[attr-defined]
    assert 10.5 < result.duration < 11.5  # type: ignore[attr-defined]
    segments = result.segments  # type: ignore[attr-defined]
    assert segments and [s.id for s in segments] == list(range(len(segments)))
    assert all(0 <= s.start < s.end <= result.duration + 0.1 for s in segments)  # type: ignore[attr-defined]
    assert all(a.end <= b.start + 0.05 for a, b in itertools.pairwise(segments))
    assert normalize(" ".join(s.text for s in segments)) == normalize(result.text)  # type: ignore[attr-defined]
    assert all(s.avg_logprob < 0 for s in segments)


def test_temperature_samples_and_is_reported_per_segment(client: openai.OpenAI) -> None:
    """OpenAI's `temperature`: above 0 the door samples at it and verbose_json says so; 0 decodes greedily
    (with the fallback, which this clear recording never needs); past 1 is refused naming the field."""
    greedy = transcribe(client, response_format="verbose_json", temperature=0)
    sampled = transcribe(client, response_format="verbose_json", temperature=0.9)
    again = transcribe(client, response_format="verbose_json", temperature=0.9)
    assert ASK_NOT in normalize(greedy.text)  # type: ignore[attr-defined]
    assert {s.temperature for s in greedy.segments} == {0.0}  # type: ignore[attr-defined]
    assert sampled.segments and {s.temperature for s in sampled.segments} == {0.9}  # type: ignore[attr-defined]
    assert sampled.text == again.text  # type: ignore[attr-defined]  # its generator is seeded by the audio
    with pytest.raises(openai.BadRequestError) as refused:
        transcribe(client, temperature=1.5)
    assert refused.value.body["param"] == "temperature"  # type: ignore[index]
    assert "temperature must be from 0 to 1" in refused.value.body["message"]  # type: ignore[index]


def test_srt_and_vtt(client: openai.OpenAI) -> None:
    srt = transcribe(client, response_format="srt")
    vtt = transcribe(client, response_format="vtt")
    assert isinstance(srt, str) and isinstance(vtt, str)
    stamp = r"(\d\d):(\d\d):(\d\d)[,.](\d{3})"
    srt_cues = re.findall(rf"^(\d+)\n{stamp} --> {stamp}\n(.+)$", srt, re.M)
    assert srt_cues and [int(c[0]) for c in srt_cues] == list(range(1, len(srt_cues) + 1))
    assert ASK_NOT in normalize(" ".join(c[-1] for c in srt_cues))
    assert vtt.startswith("WEBVTT\n\n")
    vtt_cues = re.findall(rf"^{stamp} --> {stamp}\n(.+)$", vtt, re.M)
    assert [c[-1] for c in vtt_cues] == [c[-1] for c in srt_cues]
    assert "." in vtt.splitlines()[2] and "," in srt.splitlines()[1]  # each format's own separator


def test_stream_sends_deltas_then_done(client: openai.OpenAI) -> None:
    events = list(transcribe(client, stream=True))  # type: ignore[call-overload]
    types = [e.type for e in events]
    assert types[-1] == "transcript.text.done" and set(types[:-1]) == {"transcript.text.delta"}
    assert "".join(e.delta for e in events[:-1]) == events[-1].text
    assert ASK_NOT in normalize(events[-1].text)


def test_wrong_token_is_refused_in_openai_shape(http_server: ServerThread) -> None:
    before = http_count("401")
    bad = openai.OpenAI(base_url=http_server.http_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        transcribe(bad)
    assert e.value.status_code == 401
    assert "invalid bearer token" in str(e.value)
    status, body = curl(
        "-F", f"file=@{JFK_FLAC}", "-F", "model=whisper-1", http_server.http_url + "/v1/audio/transcriptions"
    )
    assert status == 401
    error = json.loads(body)["error"]
    assert "missing credentials" in error["message"] and error["code"] == "invalid_api_key"
    assert http_count("401") == before + 2


def test_curl_transcribes_and_refuses_bad_fields_by_name(http_server: ServerThread, tmp_path: Path) -> None:
    url = http_server.http_url + "/v1/audio/transcriptions"
    auth = ("-H", f"Authorization: Bearer {TOKEN}")
    status, body = curl(
        *auth, "-F", f"file=@{JFK_FLAC}", "-F", "model=whisper-1", "-F", "response_format=text", url
    )
    assert status == 200 and ASK_NOT in normalize(body)

    status, body = curl(*auth, "-F", f"file=@{JFK_FLAC}", "-F", "response_format=xml", url)
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "response_format"
    assert "response_format must be one of json, text, verbose_json, srt, vtt" in error["message"]

    status, body = curl(*auth, "-F", f"file=@{JFK_FLAC}", "-F", "language=xx", url)
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "language" and "'xx'" in error["message"]

    not_audio = tmp_path / "notes.txt"
    not_audio.write_text("this is not a recording\n")
    status, body = curl(*auth, "-F", f"file=@{not_audio}", url)
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "file" and "WAV or FLAC" in error["message"]

    status, body = curl(*auth, "-F", "model=whisper-1", url)
    assert status == 400 and json.loads(body)["error"]["param"] == "file"


def test_word_granularity_gives_timed_words(http_server: ServerThread) -> None:
    url = http_server.http_url + TRANSCRIPTIONS
    auth = ("-H", f"Authorization: Bearer {TOKEN}")
    status, body = curl(
        *auth, "-F", f"file=@{JFK_FLAC}", "-F", "response_format=verbose_json",
        "-F", "timestamp_granularities[]=word", url,
    )  # fmt: skip
    assert status == 200, body
    result = json.loads(body)
    words = result["words"]
    assert normalize(" ".join(w["word"] for w in words)) == normalize(result["text"])
    assert ASK_NOT in normalize(" ".join(w["word"] for w in words))
    assert all(0 <= w["start"] <= w["end"] <= result["duration"] + 0.1 for w in words)
    assert [w["start"] for w in words] == sorted(w["start"] for w in words)


# Spoken as a caller reads a card out, in groups; Luhn-valid (a test Visa number).
CARD_SENTENCE = (
    "My card number is four five three two, zero one five one, one two eight three, zero three six six."
)


@pytest.fixture(scope="module")
def card_call(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wav = tmp_path_factory.mktemp("card") / "card.wav"
    sf.write(wav, speak(CARD_SENTENCE), RATE, subtype="PCM_16")
    return wav


def digits(text: str) -> str:
    return "".join(re.findall(r"\d", text))


def spoken_text(fmt: str, body: str) -> str:
    """The transcript text of one response, without the numbers a format adds of its own (ids, times,
    cue numbers)."""
    if fmt == "json":
        return str(json.loads(body)["text"])
    if fmt == "verbose_json":
        v = json.loads(body)
        return " ".join([v["text"], *(x["text"] for x in v["segments"]), *(w["word"] for w in v["words"])])
    if fmt == "stream":
        events = [
            json.loads(line.removeprefix("data: ")) for line in body.splitlines() if line.startswith("data: ")
        ]
        return " ".join(e.get("delta", "") + " " + e.get("text", "") for e in events)
    if fmt in ("srt", "vtt"):  # cue lines only: not the header, cue numbers or times
        return " ".join(line for line in body.splitlines() if not re.fullmatch(r"WEBVTT|[\d:.,> -]*", line))
    return body


def test_redaction_through_the_http_door_masks_a_spoken_card_number(
    http_server: ServerThread, card_call: Path
) -> None:
    """With redact=pci no output the door can give (text, json, verbose_json's text, segments and words,
    srt, vtt, the stream's events) carries the card's digits; without it the same call shows them, so the
    audio really holds a card the server transcribes."""
    url = http_server.http_url + TRANSCRIPTIONS
    call = ("-H", f"Authorization: Bearer {TOKEN}", "-F", f"file=@{card_call}")
    status, body = curl(*call, "-F", "response_format=text", url)
    assert status == 200 and "number is" in normalize(body), body
    assert len(digits(body)) >= 12, f"the control call shows no card number: {body!r}"

    outputs = {}
    for fmt in ("text", "json", "verbose_json", "srt", "vtt"):
        words = ("-F", "timestamp_granularities[]=word") if fmt == "verbose_json" else ()
        outputs[fmt] = curl(*call, "-F", f"response_format={fmt}", "-F", "redact=pci", *words, url)
    outputs["stream"] = curl(*call, "-F", "stream=true", "-F", "redact=pci", url)
    for fmt, (status, body) in outputs.items():
        assert status == 200, (fmt, body)
        text = spoken_text(fmt, body)
        assert "number is" in normalize(text), (fmt, text)  # the words around the card stay
        assert len(digits(text)) <= 4, f"{fmt}: the card number left the server: {text!r}"
    assert json.loads(outputs["verbose_json"][1])["words"]


def test_upload_over_max_recognize_bytes_is_413_naming_the_limit(
    service_engine: Engine, tmp_path: Path
) -> None:
    limit = JFK_FLAC.stat().st_size // 2
    server = ServerThread(ServerConfig(max_recognize_bytes=limit), service_engine, http=True).start()
    try:
        url = server.http_url + "/v1/audio/transcriptions"
        status, body = curl("-F", f"file=@{JFK_FLAC}", url)
        error = json.loads(body)["error"]
        assert status == 413 and error["param"] == "file"
        assert f"limit of {limit} bytes (max_recognize_bytes)" in error["message"]
        # what fits still goes through on the same server
        short = tmp_path / "short.wav"
        sf.write(short, speak("Thank you for calling."), RATE, subtype="PCM_16")
        assert short.stat().st_size < limit
        status, body = curl("-F", f"file=@{short}", "-F", "response_format=text", url)
        assert status == 200 and "thank you for calling" in normalize(body)
    finally:
        server.stop()


def test_models_lists_the_served_model(client: openai.OpenAI, service_engine: Engine) -> None:
    assert [m.id for m in client.models.list()] == [service_engine.info.name]


def test_mutual_tls_on_the_http_door(service_engine: Engine, tmp_path: Path) -> None:
    """With --tls-cert/--tls-key/--tls-client-ca the door is HTTPS with the gRPC port's certificate and
    asks for a client certificate from the same CA."""
    pki = make_pki(tmp_path / "pki")
    config = ServerConfig(
        tls_cert=str(pki.server.cert), tls_key=str(pki.server.key), tls_client_ca=str(pki.ca)
    )
    server = ServerThread(config, service_engine, http=True).start()
    try:
        base_url = server.http_url.replace("http://", "https://") + "/v1"

        def client_with(cert: Pem | None) -> openai.OpenAI:
            context = ssl.create_default_context(cafile=str(pki.ca))
            if cert is not None:
                context.load_cert_chain(str(cert.cert), str(cert.key))
            return openai.OpenAI(
                base_url=base_url,
                api_key="unused",
                max_retries=0,
                http_client=openai.DefaultHttpxClient(verify=context),
            )

        result = transcribe(client_with(pki.client))
        assert ASK_NOT in normalize(result.text)  # type: ignore[attr-defined]
        for cert in (None, pki.rogue_client):  # no client certificate; one from another CA
            with pytest.raises(openai.APIConnectionError):
                transcribe(client_with(cert))
        plain = subprocess.run(
            ["curl", "-sS", "-F", f"file=@{JFK_FLAC}", server.http_url + "/v1/audio/transcriptions"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert plain.returncode != 0 or "ask not" not in normalize(plain.stdout)  # plaintext gets nothing
    finally:
        server.stop()


def test_draining_refuses_new_http_calls_with_503(service_engine: Engine) -> None:
    server = ServerThread(ServerConfig(), service_engine, http=True).start()
    try:
        server.loop.call_soon_threadsafe(server.server.recognizer.drain)
        status, body = curl("-F", f"file=@{JFK_FLAC}", server.http_url + "/v1/audio/transcriptions")
        error = json.loads(body)["error"]
        assert status == 503 and "draining" in error["message"] and error["type"] == "server_error"
    finally:
        server.stop()


def _recognize_calls_open(metrics_port: int) -> float:
    """asr_door_active_calls{kind="recognize"}: recorded calls the server is working on now."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        families = text_string_to_metric_families(r.read().decode())
        return sum(
            s.value
            for f in families
            if f.name == "asr_door_active_calls"
            for s in f.samples
            if s.labels.get("kind") == "recognize"
        )


def test_sigterm_lets_an_http_call_in_flight_finish(tmp_path: Path) -> None:
    """A recording being transcribed when the pod is told to stop still gets its whole transcript."""
    audio, rate = sf.read(JFK_FLAC, dtype="float32")
    long_call = tmp_path / "three-jfk.wav"
    sf.write(long_call, np.concatenate([audio, audio, audio]), rate, subtype="PCM_16")
    server = ServerProcess(http=True).wait_serving()
    try:
        outcome: dict[str, object] = {}

        def call() -> None:
            client = openai.OpenAI(
                base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120
            )
            with open(long_call, "rb") as f:
                outcome["text"] = client.audio.transcriptions.create(model="whisper-1", file=f).text

        thread = threading.Thread(target=call)
        thread.start()
        deadline = time.monotonic() + 60
        # in flight: the server holds the call (asr_audio_seconds, which the test once waited on, counts a
        # recording once it is transcribed: the call could be over before the poll saw it)
        while _recognize_calls_open(server.metrics_port) == 0:
            assert time.monotonic() < deadline and thread.is_alive(), outcome
            time.sleep(0.05)
        server.terminate()
        thread.join(120)
        assert server.wait(60) == 0, server.log()
        assert normalize(str(outcome.get("text", ""))).count("your country") >= 3, (outcome, server.log())
    finally:
        server.stop()


async def test_the_door_on_the_default_host_answers_on_ipv4(service_engine: Engine) -> None:
    """`--host [::]` (the default) must reach IPv4 clients too: asyncio binds "::" IPv6-only, and a pod
    is reached at its IPv4 address."""
    from service.runtime.server import AsrServer
    from tests.support.server import HOST, free_port

    config = ServerConfig(host="[::]", port=0, metrics_port=0, http_port=free_port())
    server = AsrServer(config, service_engine)
    await server.start()
    await server.load()
    try:
        url = f"http://{HOST}:{config.http_port}/v1/models"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=30).read())
        assert json.loads(body)["data"], body
    finally:
        await server.stop(0.5, stop_engine=False)


# --- the door's edges (issue 19 item 9): slow, chunked, malformed and badly authorized requests ---

BOUNDARY = "asr-test-boundary"


def form_part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"


def form_body(*parts: bytes) -> bytes:
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def raw_request(
    port: int, headers: dict[str, str] | list[tuple[str, bytes]], body: bytes = b"", *, wait_s: float = 60
) -> tuple[int, dict[str, object], http.client.HTTPResponse]:
    """POST exactly these bytes (headers as given, even if malformed) and read the answer with the
    stdlib's HTTP parser: (status, error body, response)."""
    items = headers.items() if isinstance(headers, dict) else headers
    head = f"POST {TRANSCRIPTIONS} HTTP/1.1\r\nHost: {HOST}\r\n".encode()
    for key, value in items:
        head += key.encode() + b": " + (value if isinstance(value, bytes) else value.encode()) + b"\r\n"
    sock = socket.create_connection((HOST, port), timeout=wait_s)
    sock.sendall(head + b"\r\n" + body)
    response = http.client.HTTPResponse(sock)
    response.begin()
    data = response.read()
    sock.close()
    return response.status, json.loads(data) if data.startswith(b"{") else {}, response


def multipart_headers(body: bytes | None = None, **extra: str) -> dict[str, str]:
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}", **extra}
    if body is not None:
        headers["Content-Length"] = str(len(body))
    return headers


def error_while_sending(
    sock: socket.socket, send: Callable[[threading.Event], None], join_s: float
) -> tuple[http.client.HTTPResponse, dict[str, Any]]:
    """The server's answer (and its OpenAI-shaped error) to a body that `send` writes on `sock` from a
    thread until the answer comes (then `stop` is set); the socket is closed after."""
    stop = threading.Event()
    sender = threading.Thread(target=send, args=(stop,), daemon=True)
    sender.start()
    try:
        response = http.client.HTTPResponse(sock)
        response.begin()
        error = json.loads(response.read())["error"]
    finally:
        stop.set()
        sender.join(join_s)
        sock.close()
    return response, error


@pytest.fixture(scope="module")
def edge_server(service_engine: Engine) -> Iterator[ServerThread]:
    """Short upload clocks and a small upload bound, so each edge shows in a second or two."""
    config = ServerConfig(
        max_recognize_bytes=256 << 10,
        http_read_timeout=1.0,
        http_min_upload_rate=64 << 10,
        http_idle_timeout=1.0,
    )
    server = ServerThread(config, service_engine, http=True).start()
    yield server
    server.stop()


def test_a_request_head_sent_by_halves_is_closed_after_the_idle_timeout(edge_server: ServerThread) -> None:
    """Issue 26 #9: half a request line and no more, before any token is read, used to hold the connection
    for aiohttp's ~1 h keep-alive; now --http-idle-timeout (1 s here) closes it, and the port still serves."""
    sock = socket.create_connection((HOST, edge_server.server.http_port), timeout=30)
    sock.sendall(f"POST {TRANSCRIPTIONS} HTTP/1.1\r\nHost: {HOST}\r\nContent-Le".encode())
    assert sock.recv(1024) == b""  # the server closed it; the socket's 30 s timeout fails the test otherwise
    sock.close()
    with urllib.request.urlopen(f"{edge_server.http_url}/v1/models", timeout=30) as response:
        assert response.status == 200


@pytest.fixture(scope="module")
def two_connection_server(service_engine: Engine) -> Iterator[ServerThread]:
    server = ServerThread(ServerConfig(http_max_connections=2), service_engine, http=True).start()
    yield server
    server.stop()


def test_connections_past_the_cap_are_503_naming_the_flag_and_a_freed_place_serves(
    two_connection_server: ServerThread,
) -> None:
    """Issue 26 #9: nothing bounded the HTTP port's open connections, before any token is read: enough idle
    sockets took every file descriptor of the frontend, and with them every call on it. Past
    --http-max-connections (2 here) a connection is answered 503 naming the flag and closed."""
    port = two_connection_server.server.http_port
    refused_before = http_count("503")
    held = [socket.create_connection((HOST, port), timeout=30) for _ in range(2)]
    time.sleep(0.2)  # the server has taken both
    extra = socket.create_connection((HOST, port), timeout=30)
    extra.sendall(f"GET /v1/models HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
    response = http.client.HTTPResponse(extra)
    response.begin()
    error = json.loads(response.read())["error"]
    assert response.status == 503, error
    assert "http_max_connections" in error["message"] and "2 " in error["message"], error
    assert response.getheader("Retry-After")
    assert http_count("503") == refused_before + 1  # asr_http_requests_total{code="503"}
    extra.close()
    held.pop().close()
    deadline = time.monotonic() + 10
    while True:  # the server notices the close
        try:
            with urllib.request.urlopen(f"{two_connection_server.http_url}/v1/models", timeout=30) as ok:
                assert ok.status == 200
            break
        except urllib.error.HTTPError as e:
            assert e.code == 503 and time.monotonic() < deadline, e
            time.sleep(0.1)
    for sock in held:
        sock.close()


def test_an_upload_that_stalls_is_408_with_connection_close(edge_server: ServerThread) -> None:
    body = form_body(form_part("file", JFK_FLAC.read_bytes()[:200_000], "jfk.flac"))
    before = http_count("408")
    sock = socket.create_connection((HOST, edge_server.server.http_port), timeout=30)
    head = f"POST {TRANSCRIPTIONS} HTTP/1.1\r\nHost: {HOST}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in multipart_headers(body).items())
    sock.sendall(head.encode() + b"\r\n" + body[:1000])  # then nothing: a client that stalled
    response = http.client.HTTPResponse(sock)
    response.begin()  # the test's own socket timeout (30 s) fails it if the server waits for ever
    error = json.loads(response.read())["error"]
    assert response.status == 408, error
    assert "http_read_timeout" in error["message"] and "1 s" in error["message"], error
    assert response.getheader("Connection") == "close"  # closed once aiohttp's lingering close is over
    sock.close()
    assert http_count("408") == before + 1


def test_an_upload_that_trickles_under_the_minimum_rate_is_408(edge_server: ServerThread) -> None:
    """A client that sends a little every half second never idles past the read timeout, but at ~1 KB/s
    it would hold the handler for minutes: the minimum average rate ends it."""
    body = form_body(form_part("file", JFK_FLAC.read_bytes()[:200_000], "jfk.flac"))
    sock = socket.create_connection((HOST, edge_server.server.http_port), timeout=30)
    head = f"POST {TRANSCRIPTIONS} HTTP/1.1\r\nHost: {HOST}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in multipart_headers(body).items())
    sock.sendall(head.encode() + b"\r\n")

    def trickle(stop: threading.Event) -> None:
        for offset in range(0, len(body), 500):
            if stop.wait(0.5):
                return
            with contextlib.suppress(OSError):
                sock.sendall(body[offset : offset + 500])

    response, error = error_while_sending(sock, trickle, join_s=5)
    assert response.status == 408, error
    assert "http_min_upload_rate" in error["message"] and "65536 bytes/s" in error["message"], error


def test_a_chunked_upload_is_size_checked_as_it_streams(edge_server: ServerThread) -> None:
    """No Content-Length (Transfer-Encoding: chunked): the bound applies to the whole body as it arrives,
    every part counted, not only the `file` part."""
    limit = edge_server.config.max_recognize_bytes
    sent = 0
    sock = socket.create_connection((HOST, edge_server.server.http_port), timeout=30)
    head = f"POST {TRANSCRIPTIONS} HTTP/1.1\r\nHost: {HOST}\r\nTransfer-Encoding: chunked\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in multipart_headers().items())
    sock.sendall(head.encode() + b"\r\n")

    def send_forever(stop: threading.Event) -> None:
        # small fields that never end, each one well under any per-field bound: only a bound on the whole
        # stream stops them (a 64 KiB text field or a 64 MiB file part would each be accepted)
        nonlocal sent
        part = form_part("temperature", b"0" * (32 << 10))
        with contextlib.suppress(OSError):
            while not stop.is_set() and sent < 64 * limit:
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
                sent += len(part)

    response, error = error_while_sending(sock, send_forever, join_s=30)
    assert response.status == 413, error
    assert f"limit of {limit} bytes (max_recognize_bytes)" in error["message"], error
    assert sent < 64 * limit, "the server read the whole never-ending field"


@pytest.mark.parametrize(
    ("content_type", "body", "what"),
    [
        (
            "multipart/form-data; boundary=other-boundary",
            form_body(form_part("model", b"whisper-1")),
            "boundary",
        ),
        ("multipart/form-data", form_body(form_part("model", b"whisper-1")), "boundary"),
        (f"multipart/form-data; boundary={BOUNDARY}", b"not a multipart body at all\r\n", "boundary"),
        (f"multipart/form-data; boundary={'b' * 80}", b"--" + b"b" * 80 + b"--\r\n", "boundary"),
        (  # a part that never ends: the body stops before its closing boundary
            f"multipart/form-data; boundary={BOUNDARY}",
            form_part("model", b"whisper-1") + form_part("file", b"RIFF....WAVE")[:-2],
            "EOF",
        ),
    ],
    ids=["wrong-boundary", "no-boundary", "not-multipart", "boundary-too-long", "truncated"],
)
def test_a_malformed_multipart_body_is_400_not_500(
    edge_server: ServerThread, content_type: str, body: bytes, what: str
) -> None:
    before = http_count("500")
    headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
    status, error, _ = raw_request(edge_server.server.http_port, headers, body)
    assert status == 400, error
    message = error["error"]["message"]  # type: ignore[index]
    assert "multipart/form-data" in message and what in message, message
    assert http_count("500") == before


@pytest.mark.parametrize(
    "authorization",
    [b"Bearer \xff\xfe\xfd", b"Bearer caf\xc3\xa9", b"\xff\xfe", b"Bearer a b", b"Bearer"],
    ids=["not-utf8", "non-ascii", "no-scheme", "space-in-token", "no-token"],
)
def test_a_malformed_authorization_header_is_401_not_500(
    http_server: ServerThread, authorization: bytes
) -> None:
    body = form_body(form_part("model", b"whisper-1"))
    before = http_count("500")
    headers: list[tuple[str, bytes]] = [
        *((k, v.encode()) for k, v in multipart_headers(body).items()),
        ("Authorization", authorization),
    ]
    status, error, response = raw_request(http_server.server.http_port, headers, body)
    assert status == 401, error
    assert error["error"]["code"] == "invalid_api_key", error  # type: ignore[index]
    assert "Bearer" in response.getheader("WWW-Authenticate", "")
    assert http_count("500") == before


def test_an_upload_is_held_once_in_memory(service_engine: Engine, tmp_path: Path) -> None:
    """The upload is read into one buffer and the Recognize core reads it there: the server's peak
    (Python allocations, traced while it handles the request) is one copy of the file plus the decoder's
    working set (one 10 s block, ~8 MiB at 48 kHz stereo float), not two or three copies (a bytes copy of
    the form buffer, the RecognizeRequest's own, the copy read back out)."""
    wav = tmp_path / "quiet.wav"
    rng = np.random.default_rng(0)
    seconds, rate = 100, 48000  # 48 kHz stereo float32: 37 MiB, no speech (nothing for the engine)
    sf.write(wav, (rng.standard_normal((seconds * rate, 2)) * 1e-4).astype("float32"), rate, subtype="FLOAT")
    size = wav.stat().st_size
    server = ServerThread(ServerConfig(), service_engine, http=True).start()
    try:
        tracemalloc.start()
        try:
            baseline = tracemalloc.get_traced_memory()[0]
            status, body = curl(
                "-F", f"file=@{wav}", "-F", "response_format=json", server.http_url + TRANSCRIPTIONS
            )
            peak = tracemalloc.get_traced_memory()[1] - baseline
        finally:
            tracemalloc.stop()
    finally:
        server.stop()
    assert status == 200, body
    assert json.loads(body)["usage"]["seconds"] == seconds
    assert peak < 1.5 * size, f"peak {peak / 2**20:.1f} MiB for an upload of {size / 2**20:.1f} MiB"
