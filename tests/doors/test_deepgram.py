"""The Deepgram door end to end: the official deepgram-sdk (its async client, unmodified, pointed at this
server through DeepgramClientEnvironment) against a real server on loopback with real tiny.en.

Every message a test reads comes through the SDK's `recv()`, and is validated again by the SDK's own
pydantic type (`strict`), so a field the SDK requires cannot be missing unnoticed. A call ends when the
server closes the socket; websockets' ConnectionClosed (which the SDK lets through) says with which code.
Each call is bounded by a deadline (asyncio.timeout), so a server bug fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import websockets
from deepgram import AsyncDeepgramClient
from deepgram.core.api_error import ApiError
from deepgram.environment import DeepgramClientEnvironment
from deepgram.listen.v1.types import (
    ListenV1Configure,
    ListenV1ConfigureFailure,
    ListenV1ConfigureSuccess,
    ListenV1Error,
    ListenV1Finalize,
    ListenV1Metadata,
    ListenV1Results,
    ListenV1SpeechStarted,
    ListenV1UtteranceEnd,
)
from deepgram.types import ListenV1Response
from prometheus_client import REGISTRY

from clients.scoring import corpus_wer, normalize
from engine import Engine
from service.config import ServerConfig
from tests.support.audio import (
    JFK_FLAC,
    JFK_TEXT,
    RATE,
    make_conversation,
    silence,
    speak,
    stereo,
    to_linear16_bytes,
    to_mulaw_8k_bytes,
)
from tests.support.engine import jfk_16k
from tests.support.server import DOOR_TOKEN, ServerProcess, ServerThread
from tests.support.two_speakers import one_speaker_call, two_speaker_call, word_accuracy

Server = ServerThread | ServerProcess

pytestmark = pytest.mark.slow
TOKEN = DOOR_TOKEN
CALL_DEADLINE_S = 120.0
AGENT = ["Thank you for calling, how can I help you today?"]
CUSTOMER = ["I would like to cancel my subscription please."]


@pytest.fixture(scope="session")
def tokens_file(door_tokens_file: Path) -> Path:
    return door_tokens_file


@pytest.fixture(scope="session")
def server(door_server: ServerThread) -> ServerThread:
    return door_server


def environment(server: Server) -> DeepgramClientEnvironment:
    http, ws = server.http_url, server.http_url.replace("http://", "ws://")
    return DeepgramClientEnvironment(base=http, production=ws, agent=ws, agent_rest=http)


def client(server: Server, token: str = TOKEN, **kwargs: Any) -> AsyncDeepgramClient:
    return AsyncDeepgramClient(api_key=token, environment=environment(server), **kwargs)


_TYPES: dict[str, type[Any]] = {
    "Results": ListenV1Results,
    "Metadata": ListenV1Metadata,
    "SpeechStarted": ListenV1SpeechStarted,
    "UtteranceEnd": ListenV1UtteranceEnd,
    "Error": ListenV1Error,
    "ConfigureSuccess": ListenV1ConfigureSuccess,
    "ConfigureFailure": ListenV1ConfigureFailure,
}


def strict(message: Any) -> Any:
    """The message the SDK returned, validated again by its type: every required field present."""
    assert not isinstance(message, bytes | dict), f"the SDK could not type this message: {message!r}"
    kind = _TYPES[message.type]
    assert isinstance(message, kind), message
    return kind.model_validate(message.model_dump(by_alias=True))


@dataclass
class Call:
    """What a live call received, in order, and how the server closed it."""

    messages: list[Any] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)  # time.monotonic() of each message
    close_code: int | None = None
    close_reason: str = ""

    def of(self, kind: type[Any]) -> list[Any]:
        return [m for m in self.messages if isinstance(m, kind)]

    @property
    def results(self) -> list[ListenV1Results]:
        return self.of(ListenV1Results)

    @property
    def finals(self) -> list[ListenV1Results]:
        return [r for r in self.results if r.is_final]

    @property
    def interims(self) -> list[ListenV1Results]:
        return [r for r in self.results if not r.is_final]

    def text(self, channel: int = 0) -> str:
        return " ".join(
            r.channel.alternatives[0].transcript
            for r in self.finals
            if r.channel_index[0] == channel and r.channel.alternatives[0].transcript
        )


async def receive_all(sock: Any, call: Call) -> None:
    while True:
        try:
            message = await sock.recv()
        except websockets.exceptions.ConnectionClosed as e:
            call.close_code = e.rcvd.code if e.rcvd else None
            call.close_reason = e.rcvd.reason if e.rcvd else ""
            return
        call.messages.append(strict(message))
        call.arrived.append(time.monotonic())


@contextlib.asynccontextmanager
async def live(server: Server, call: Call, *, token: str = TOKEN, **options: Any) -> AsyncIterator[Any]:
    """A live connection whose messages land in `call`; on leaving, waits (bounded) for the server to
    close the socket."""
    options.setdefault("model", "nova-3")
    async with asyncio.timeout(CALL_DEADLINE_S):
        async with client(server, token).listen.v1.connect(**options) as sock:
            receiver = asyncio.create_task(receive_all(sock, call))
            try:
                yield sock
                await receiver
            finally:
                receiver.cancel()


async def send_paced(sock: Any, data: bytes, chunk_bytes: int, bytes_per_s: float | None) -> None:
    """Audio in chunks, at `bytes_per_s` (None: as fast as the socket takes it)."""
    start = time.monotonic()
    for i in range(0, len(data), chunk_bytes):
        if bytes_per_s:
            await asyncio.sleep(max(0.0, start + i / bytes_per_s - time.monotonic()))
        await sock.send_media(data[i : i + chunk_bytes])


def wer(reference: str, hypothesis: str) -> float:
    return corpus_wer([reference], [hypothesis])


def jfk_mulaw() -> bytes:
    return to_mulaw_8k_bytes(jfk_16k())


def door_streams(code: str) -> float:
    labels = {"door": "deepgram", "kind": "stream", "code": code}
    return REGISTRY.get_sample_value("asr_door_calls_total", labels) or 0.0


# --- a real-speech call --------------------------------------------------------------------------------


async def test_real_speech_mulaw_call_with_interims_words_events_and_metadata(server: ServerThread) -> None:
    """jfk.flac as 8 kHz mu-law, paced in real time, as a telephony gateway sends it: interims before
    each final, finals whose words carry times and punctuation, SpeechStarted and UtteranceEnd, then
    CloseStream's Metadata and a normal close."""
    data = jfk_mulaw()
    streams_before = door_streams("OK")
    call = Call()
    async with live(
        server, call, encoding="mulaw", sample_rate=8000, channels=1, interim_results="true",
        punctuate="true", vad_events="true", utterance_end_ms=1000, language="en-US", tag="jfk",
    ) as sock:  # fmt: skip
        await send_paced(sock, data + to_mulaw_8k_bytes(silence(1.5)), 160 * 5, 8000)  # 100 ms chunks
        await sock.send_close_stream()

    assert call.close_code == 1000, call
    assert wer(normalize(JFK_TEXT), normalize(call.text())) < 0.15, call.text()
    assert call.interims, "interim_results=true"
    final_at = [call.arrived[call.messages.index(f)] for f in call.finals]
    for interim in call.interims:  # an interim comes before the final of its stretch of audio
        covering = [
            t
            for f, t in zip(call.finals, final_at, strict=True)
            if f.start <= interim.start < f.start + f.duration
        ]
        assert covering and call.arrived[call.messages.index(interim)] <= covering[0]
    for f in call.finals:
        alt = f.channel.alternatives[0]
        assert f.speech_final and not f.from_finalize and f.channel_index == [0, 1]
        assert alt.words and 0 <= alt.confidence <= 1
        for w in alt.words:  # offsets from the call's start, inside the result's stretch
            assert f.start - 0.05 <= w.start <= w.end <= f.start + f.duration + 0.05
            assert w.punctuated_word and normalize(w.punctuated_word) == normalize(w.word)
        assert f.metadata.model_info.name == server.engine.info.name
    words = [w for f in call.finals for w in f.channel.alternatives[0].words]
    assert all(a.start <= b.start for a, b in itertools.pairwise(words))
    assert 10.0 < words[-1].end < 11.2  # "country" ends near 11 s
    started = call.of(ListenV1SpeechStarted)
    assert len(started) >= len(call.finals) >= 3
    for f in call.finals:  # each final's speech was announced first, at about its start
        assert any(abs(s.timestamp - f.start) < 0.6 for s in started), (
            f.start,
            [s.timestamp for s in started],
        )
    ends = call.of(ListenV1UtteranceEnd)
    assert ends and ends[-1].last_word_end == pytest.approx(words[-1].end, abs=0.002)
    assert call.messages.index(ends[-1]) > call.messages.index(call.finals[-1])
    metadata = call.of(ListenV1Metadata)
    assert len(metadata) == 1 and call.messages[-1] is metadata[0]
    assert metadata[0].duration == pytest.approx(len(data) / 8000 + 1.5, abs=0.05)
    assert metadata[0].channels == 1 and metadata[0].request_id == call.finals[0].metadata.request_id
    assert door_streams("OK") == streams_before + 1  # the core's metrics, labelled with this door


async def test_two_channel_call_each_channel_on_its_own(server: ServerThread) -> None:
    """An agent and a customer on two channels of 16 kHz linear16 (Deepgram's default encoding), with
    multichannel=true, sent faster than real time: each channel's finals carry its own words."""
    agent, _ = make_conversation(AGENT, pause_s=0.8, lead_s=0.3)
    customer, _ = make_conversation(CUSTOMER, pause_s=0.8, lead_s=0.0)
    audio = stereo(agent, np.concatenate([silence(len(agent) / RATE), customer]))
    call = Call()
    async with live(
        server,
        call,
        encoding="linear16",
        sample_rate=16000,
        channels=2,
        multichannel="true",
        punctuate="true",
    ) as sock:
        await send_paced(sock, to_linear16_bytes(audio), 6400, 4 * 64000)
        await sock.send_close_stream()
    assert call.close_code == 1000, call
    assert {tuple(f.channel_index) for f in call.finals} == {(0, 2), (1, 2)}
    assert wer(normalize(AGENT[0]), normalize(call.text(0))) < 0.2, call.text(0)
    assert wer(normalize(CUSTOMER[0]), normalize(call.text(1))) < 0.2, call.text(1)
    agent_end = max(
        w.end for f in call.finals if f.channel_index[0] == 0 for w in f.channel.alternatives[0].words
    )
    customer_start = min(
        w.start for f in call.finals if f.channel_index[0] == 1 for w in f.channel.alternatives[0].words
    )
    assert agent_end <= customer_start  # the customer speaks once the agent is done, on the same clock
    assert call.of(ListenV1Metadata)[0].channels == 2


async def live_words(server: ServerThread, audio: np.ndarray, **options: Any) -> tuple[Call, list[Any]]:
    """A mono 8 kHz mu-law call sent 4x real time, then a second of silence and CloseStream."""
    call = Call()
    async with live(server, call, encoding="mulaw", sample_rate=8000, channels=1, **options) as sock:
        await send_paced(sock, to_mulaw_8k_bytes(audio) + to_mulaw_8k_bytes(silence(1.0)), 800, 4 * 8000)
        await sock.send_close_stream()
    assert call.close_code == 1000, call
    return call, [w for f in call.finals for w in f.channel.alternatives[0].words]


async def test_live_diarize_labels_two_speakers_consistently_and_one_as_one(server: ServerThread) -> None:
    """diarize=true on a live mono call: every word of every final carries a 0-based speaker, as
    Deepgram's do; two LibriSpeech speakers taking turns (A B A B, a second apart) get 0 and 1, each
    speaker's second turn (a later final) its first turn's label; one speaker's two turns stay 0."""
    two = two_speaker_call("1188", "1995", gap_s=1.0, overlap_s=-1.0)
    call, words = await live_words(server, two.audio, diarize="true")
    assert len(words) >= 20 and all(w.speaker is not None for w in words)
    assert {w.speaker for w in words} == {0, 1} and words[0].speaker == 0
    assert word_accuracy(two, [(w.start, w.end, w.speaker) for w in words]) >= 0.85
    per_final = [{w.speaker for w in f.channel.alternatives[0].words} for f in call.finals]
    assert per_final == [{0}, {1}, {0}, {1}], per_final
    _, words = await live_words(server, one_speaker_call("1188").audio, diarize="true")
    assert len(words) >= 10 and {w.speaker for w in words} == {0}


async def test_live_without_diarize_words_carry_no_speaker(server: ServerThread) -> None:
    _, words = await live_words(server, two_speaker_call("1188", "1995", gap_s=1.0, overlap_s=-1.0).audio)
    assert words and all(w.speaker is None for w in words)


async def test_finalize_flushes_at_once_and_keepalive_holds_the_stream(server: ServerThread) -> None:
    """A sentence with no pause after it, then Finalize: its final comes back marked from_finalize while
    the client sends nothing but KeepAlive; the stream then goes on."""
    sentence = speak("Please hold while I check your account.")
    call = Call()
    async with live(server, call, encoding="linear16", sample_rate=16000, endpointing=2000) as sock:
        await send_paced(sock, to_linear16_bytes(sentence), 3200, None)
        await sock.send_finalize()
        deadline = time.monotonic() + 60
        while not call.finals:
            assert time.monotonic() < deadline, "no final after Finalize"
            await sock.send_keep_alive()
            await asyncio.sleep(0.2)
        flushed = call.finals[0]
        await send_paced(sock, to_linear16_bytes(silence(0.5)), 3200, None)
        await sock.send_close_stream()
    assert flushed.from_finalize and not flushed.speech_final
    assert "check your account" in normalize(flushed.channel.alternatives[0].transcript)
    assert call.close_code == 1000 and call.of(ListenV1Metadata)


async def test_finalize_with_nothing_open_answers_an_empty_final(server: ServerThread) -> None:
    call = Call()
    async with live(server, call, encoding="linear16", sample_rate=16000) as sock:
        await sock.send_media(to_linear16_bytes(silence(0.3)))
        await sock.send_finalize()
        deadline = time.monotonic() + 30
        while not call.finals:
            assert time.monotonic() < deadline, "Finalize was not answered"
            await asyncio.sleep(0.05)
        await sock.send_close_stream()
    assert call.finals[0].from_finalize and call.finals[0].channel.alternatives[0].transcript == ""


async def test_endpointing_false_finals_only_on_finalize(server: ServerThread) -> None:
    """endpointing=false: two sentences with a long pause between are one utterance until Finalize."""
    audio, _ = make_conversation(["The first part of my question.", "And the second part."], pause_s=1.5)
    call = Call()
    async with live(server, call, encoding="linear16", sample_rate=16000, endpointing="false") as sock:
        await send_paced(sock, to_linear16_bytes(audio), 3200, 4 * 32000)
        await asyncio.sleep(1.0)  # the server's endpointing would have ended both by now
        assert not call.finals, "a final with endpointing=false before Finalize"
        await sock.send_finalize()
        await sock.send_close_stream()
    assert len(call.finals) == 1 and call.finals[0].from_finalize
    text = normalize(call.text())
    assert normalize("the first part") in text and normalize("the second part") in text, text


async def test_redact_pci_masks_a_card_number(server: ServerThread) -> None:
    audio, _ = make_conversation(["My card number is 4111 1111 1111 1111."], pause_s=1.0)
    call = Call()
    async with live(server, call, encoding="mulaw", sample_rate=8000, redact="pci", punctuate="true") as sock:
        await send_paced(sock, to_mulaw_8k_bytes(audio), 1600, None)
        await sock.send_close_stream()
    text = call.text()
    assert "[PCI]" in text and not any(c.isdigit() for c in text), text
    assert "[PCI]" in [w.word for f in call.finals for w in f.channel.alternatives[0].words]


async def test_configure_replaces_keyterms_and_refuses_past_the_limit(server: ServerThread) -> None:
    call = Call()
    async with live(server, call, encoding="linear16", sample_rate=16000, keyterm=["Kestoria"]) as sock:
        await sock.send_media(to_linear16_bytes(silence(0.2)))
        await sock.send_configure(ListenV1Configure(type="Configure", keyterms=["Moxilar", "Zentrix"]))
        await sock.send_configure(
            ListenV1Configure(type="Configure", keyterms=[f"term{i}" for i in range(500)])
        )
        deadline = time.monotonic() + 30
        while len(call.of(ListenV1ConfigureSuccess)) + len(call.of(ListenV1ConfigureFailure)) < 2:
            assert time.monotonic() < deadline, "Configure was not answered"
            await asyncio.sleep(0.05)
        await sock.send_close_stream()
    ok = call.of(ListenV1ConfigureSuccess)
    failed = call.of(ListenV1ConfigureFailure)
    assert [m.keyterms for m in ok] == [["Moxilar", "Zentrix"]]
    assert [m.code for m in failed] == ["CONFIGURE_KEYTERM_LIMIT_EXCEEDED"] and "100" in failed[0].description
    assert call.close_code == 1000


# --- bad input, each in Deepgram's own terms --------------------------------------------------------


def handshake_refusal(
    server: ServerThread, query: str, token: str | None = TOKEN
) -> tuple[int, dict[str, Any], str]:
    """A plain HTTP GET of /v1/listen (no upgrade): the status, body and dg-error header a refused
    handshake gets, which the SDK folds into ApiError(status_code)."""
    request = urllib.request.Request(f"{server.http_url}/v1/listen?{query}")
    if token:
        request.add_header("Authorization", f"Token {token}")
    try:
        urllib.request.urlopen(request, timeout=30)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers.get("dg-error", "")
    raise AssertionError("the handshake was not refused")


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"encoding": "opus", "sample_rate": 48000}, "encoding"),
        ({"encoding": "mulaw", "sample_rate": 4000}, "sample_rate"),
        ({"encoding": "mulaw"}, "sample_rate"),
        ({"channels": 9}, "channels"),
        ({"diarize_model": "latest"}, "diarize_model"),
        ({"redact": "pii"}, "redact"),
        ({"language": "fr"}, "language"),
        ({"endpointing": "soon"}, "endpointing"),
        ({"detect_entities": "true"}, "detect_entities"),
        ({"keyterm": ["x" * 60]}, "keyterm"),
        ({"extra": [f"k{i}:{'v' * 1000}" for i in range(3)]}, "extra"),
    ],
)
async def test_bad_options_are_refused_at_the_handshake(
    server: ServerThread, options: dict[str, Any], named: str
) -> None:
    with pytest.raises(ApiError) as e:
        async with live(server, Call(), **options):
            pass
    assert e.value.status_code == 400
    query = "&".join(f"{k}={x}" for k, v in options.items() for x in (v if isinstance(v, list) else [v]))
    status, body, header = handshake_refusal(server, query)
    assert status == 400 and body["err_code"] == "Bad Request" and body["request_id"]
    assert named in body["err_msg"] and named in header


async def test_container_audio_in_a_stream_is_refused_data_0000(server: ServerThread, tmp_path: Path) -> None:
    """No encoding and a WAV file's bytes: Deepgram would read the header; this server decodes raw audio
    only, so it says so (Error DATA-0000, close 1008) instead of transcribing a header as noise."""
    wav = tmp_path / "call.wav"
    sf.write(wav, speak("Hello there."), RATE, subtype="PCM_16")
    call = Call()
    async with live(server, call) as sock:
        await sock.send_media(wav.read_bytes())
    assert call.close_code == 1008 and call.close_reason == "DATA-0000"
    errors = call.of(ListenV1Error)
    assert len(errors) == 1 and errors[0].variant == "DATA-0000" and "encoding" in errors[0].description


async def test_a_frame_over_the_chunk_limit_is_refused(server: ServerThread) -> None:
    call = Call()
    limit = server.config.max_chunk_bytes
    async with live(server, call, encoding="linear16", sample_rate=16000) as sock:
        await sock.send_media(b"\x00" * (limit + 2))
    assert call.close_code == 1009, call
    errors = call.of(ListenV1Error)
    assert errors and str(limit) in errors[0].description


async def test_an_unreadable_text_message_is_a_schema_error_and_the_stream_goes_on(
    server: ServerThread,
) -> None:
    speech = speak("Thank you for waiting.")
    call = Call()
    async with live(server, call, encoding="linear16", sample_rate=16000) as sock:
        await sock.send_finalize(ListenV1Finalize(type="Shout"))  # the type is typed Any: no control message
        await send_paced(sock, to_linear16_bytes(np.concatenate([speech, silence(1.0)])), 3200, None)
        await sock.send_close_stream()
    errors = call.of(ListenV1Error)
    assert [e.variant for e in errors] == ["SchemaError"] and errors[0].message == '{"type": "Shout"}'
    assert "thank you for waiting" in normalize(call.text()) and call.close_code == 1000


# --- auth ---------------------------------------------------------------------------------------------


async def test_auth_refused_without_or_with_a_wrong_token(server: ServerThread) -> None:
    for token in ("wrong-token", ""):
        with pytest.raises(ApiError) as e:
            async with live(server, Call(), token=token):
                pass
        assert e.value.status_code == 401
    status, body, _ = handshake_refusal(server, "model=nova-3", token=None)
    assert status == 401 and body["err_code"] == "INVALID_AUTH"


async def test_auth_accepted_as_token_bearer_or_websocket_subprotocol(server: ServerThread) -> None:
    call = Call()  # Authorization: Token (the SDK's api_key)
    async with live(server, call, encoding="linear16", sample_rate=16000) as sock:
        await sock.send_close_stream()
    assert call.close_code == 1000
    bearer = AsyncDeepgramClient(access_token=TOKEN, environment=environment(server))  # Authorization: Bearer
    async with asyncio.timeout(CALL_DEADLINE_S):
        async with bearer.listen.v1.connect(model="nova-3") as sock:
            await sock.send_close_stream()
            assert isinstance(strict(await sock.recv()), ListenV1Metadata)
    # A browser cannot set headers: Sec-WebSocket-Protocol: token, KEY (the SDK has no browser side; the
    # websockets library it uses speaks for the browser here).
    url = server.http_url.replace("http://", "ws://") + "/v1/listen?model=nova-3"
    async with asyncio.timeout(CALL_DEADLINE_S):
        async with websockets.connect(url, subprotocols=["token", TOKEN]) as ws:  # type: ignore[list-item]
            assert ws.subprotocol == "token"
            await ws.send(json.dumps({"type": "CloseStream"}))
            assert json.loads(await ws.recv())["type"] == "Metadata"


# --- a recorded file: POST /v1/listen ---------------------------------------------------------------


async def test_prerecorded_file_with_the_sdk(server: ServerThread) -> None:
    response = await client(server).listen.v1.media.transcribe_file(
        request=JFK_FLAC.read_bytes(), model="nova-3", punctuate=True, utterances=True, smart_format=True
    )
    assert isinstance(response, ListenV1Response)
    body = ListenV1Response.model_validate(response.model_dump(by_alias=True))
    assert len(body.results.channels) == 1 and body.metadata.channels == 1
    alt = body.results.channels[0].alternatives[0]
    assert wer(normalize(JFK_TEXT), normalize(alt.transcript)) < 0.15, alt.transcript
    assert alt.words and all(0 <= w.start <= w.end <= 11.1 for w in alt.words)
    assert body.metadata.duration == pytest.approx(11.0, abs=0.1)
    assert body.results.utterances and all(u.channel == 0 for u in body.results.utterances)


async def test_prerecorded_two_channel_raw_mulaw(server: ServerThread) -> None:
    agent, _ = make_conversation(AGENT, pause_s=0.5, lead_s=0.3)
    customer, _ = make_conversation(CUSTOMER, pause_s=0.5, lead_s=0.3)
    left, right = to_mulaw_8k_bytes(agent), to_mulaw_8k_bytes(customer)
    n = max(len(left), len(right))
    left, right = left.ljust(n, b"\xff"), right.ljust(n, b"\xff")  # 0xff: mu-law silence
    interleaved = bytes(b for pair in zip(left, right, strict=True) for b in pair)
    response = await client(server).listen.v1.media.transcribe_file(
        request=interleaved, model="nova-3", encoding="mulaw", request_options={
            "additional_query_parameters": {"sample_rate": 8000, "channels": 2, "multichannel": "true"}
        },
    )  # fmt: skip
    assert isinstance(response, ListenV1Response)
    texts = [c.alternatives[0].transcript for c in response.results.channels]
    # tiny.en hears espeak's "today" at 8 kHz as "from may": 2 of 10 words; a swapped or mixed channel
    # scores far worse against its own line than against the other
    for own, other, text in ((AGENT[0], CUSTOMER[0], texts[0]), (CUSTOMER[0], AGENT[0], texts[1])):
        assert wer(own, text) <= 0.25 and wer(own, text) < wer(other, text), texts


@pytest.mark.parametrize("option", ["smart_format", "numerals"])
async def test_smart_format_and_numerals_write_spoken_digits_as_digits(
    server: ServerThread, option: str
) -> None:
    """tiny.en spells this order number out; either option makes it digits (the core's SMART formatting),
    the merged word spanning the spoken ones; without it the words stay as spoken."""
    # the clip tests/test_client_cli.py formats too: tiny.en spells this one out at 8 kHz
    speech, _ = make_conversation(
        ["The order number is one two three four five six."], pause_s=1.0, voice="en-gb", speed=160
    )
    audio = to_mulaw_8k_bytes(speech)
    options = {"sample_rate": 8000}

    async def transcribe(**flags: bool) -> Any:
        return await client(server).listen.v1.media.transcribe_file(
            request=audio, model="nova-3", encoding="mulaw",
            request_options={"additional_query_parameters": options}, **flags,
        )  # fmt: skip

    plain = (await transcribe()).results.channels[0].alternatives[0]
    assert "123456" not in plain.transcript, plain.transcript
    smart = (await transcribe(**{option: True})).results.channels[0].alternatives[0]
    assert "123456" in smart.transcript, smart.transcript
    merged = next(w for w in smart.words if "123456" in w.word)
    assert merged.end - merged.start > 1.0, merged  # it spans the six spoken digits


async def test_prerecorded_diarize_labels_the_speakers_of_a_mono_call(server: ServerThread) -> None:
    """Two real LibriSpeech speakers taking turns (one overlap) on one 8 kHz mu-law channel: diarize=true
    gives every word and utterance a 0-based speaker, two of them, right for most words."""
    call = two_speaker_call()
    response = await client(server).listen.v1.media.transcribe_file(
        request=to_mulaw_8k_bytes(call.audio), model="nova-3", encoding="mulaw", diarize=True,
        utterances=True, request_options={"additional_query_parameters": {"sample_rate": 8000}},
    )  # fmt: skip
    words = response.results.channels[0].alternatives[0].words
    assert len(words) >= 20 and all(isinstance(w.speaker, int) for w in words), words
    assert {w.speaker for w in words} == {0, 1}
    assert word_accuracy(call, [(w.start, w.end, w.speaker) for w in words]) >= 0.85
    utterances = response.results.utterances
    assert utterances and all(u.speaker in (0, 1) for u in utterances)
    assert all(w.speaker is not None for u in utterances for w in u.words)
    assert utterances[0].speaker == words[0].speaker  # numbered in order of first speech: 0 speaks first
    assert words[0].speaker == 0


async def test_prerecorded_without_diarize_has_no_speakers(server: ServerThread) -> None:
    response = await client(server).listen.v1.media.transcribe_file(
        request=JFK_FLAC.read_bytes(), utterances=True
    )
    words = response.results.channels[0].alternatives[0].words
    assert words and all(w.speaker is None for w in words)
    assert response.results.utterances and all(u.speaker is None for u in response.results.utterances)


async def test_prerecorded_refusals(server: ServerThread) -> None:
    with pytest.raises(ApiError) as e:
        await client(server).listen.v1.media.transcribe_file(
            request=JFK_FLAC.read_bytes(), detect_entities=True
        )
    assert e.value.status_code == 400 and "detect_entities" in e.value.body["err_msg"]
    with pytest.raises(ApiError) as e:
        await client(server).listen.v1.media.transcribe_file(request=b"not audio at all" * 100)
    assert e.value.status_code == 400 and e.value.body["err_code"] == "Bad Request"
    with pytest.raises(ApiError) as e:
        await client(server, token="wrong").listen.v1.media.transcribe_file(request=JFK_FLAC.read_bytes())
    assert e.value.status_code == 401 and e.value.body["err_code"] == "INVALID_AUTH"


# --- limits of their own: idle audio, drain ---------------------------------------------------------


SHORT_MAX_RECOGNIZE_BYTES = 256 << 10
SHORT_MAX_STREAM_SECONDS = 10.0
SHORT_MAX_DIARIZATION_SECONDS = 5.0


@pytest.fixture
def short_server(service_engine: Engine, tokens_file: Path) -> Iterator[ServerThread]:
    """A server of its own, for what leaves it draining or needs short limits (idle audio, sizes)."""
    s = ServerThread(
        ServerConfig(
            auth_tokens_file=str(tokens_file),
            idle_audio_timeout=1.5,
            max_recognize_bytes=SHORT_MAX_RECOGNIZE_BYTES,
            max_stream_seconds=SHORT_MAX_STREAM_SECONDS,
            max_diarization_seconds=SHORT_MAX_DIARIZATION_SECONDS,
        ),
        service_engine,
        http=True,
    ).start()
    yield s
    s.stop()


async def test_a_diarized_recording_over_the_limit_is_refused_naming_the_flag(
    short_server: ServerThread,
) -> None:
    """A 10 s call over --max-diarization-seconds 5: 413 at once naming diarize and the flag; the same call
    without diarize is transcribed."""
    audio = to_mulaw_8k_bytes(two_speaker_call().audio)
    extra = {"additional_query_parameters": {"sample_rate": 8000}}
    with pytest.raises(ApiError) as e:
        await client(short_server).listen.v1.media.transcribe_file(
            request=audio, encoding="mulaw", diarize=True, request_options=extra
        )
    assert e.value.status_code == 413, e.value.body
    assert "diarize" in e.value.body["err_msg"] and "max_diarization_seconds" in e.value.body["err_msg"]
    plain = await client(short_server).listen.v1.media.transcribe_file(
        request=audio, encoding="mulaw", request_options=extra
    )
    assert plain.results.channels[0].alternatives[0].words


async def test_prerecorded_over_the_size_limit_is_413_naming_it(short_server: ServerThread) -> None:
    with pytest.raises(ApiError) as e:
        await client(short_server).listen.v1.media.transcribe_file(
            request=b"\x00" * (SHORT_MAX_RECOGNIZE_BYTES + 2), encoding="linear16", model="nova-3"
        )
    assert e.value.status_code == 413 and "max_recognize_bytes" in e.value.body["err_msg"]
    assert str(SHORT_MAX_RECOGNIZE_BYTES) in e.value.body["err_msg"]


async def test_keepalive_holds_an_idle_stream_then_silence_ends_it_net_0001(
    short_server: ServerThread,
) -> None:
    call = Call()
    async with live(short_server, call, encoding="linear16", sample_rate=16000) as sock:
        await sock.send_media(to_linear16_bytes(silence(0.2)))
        for _ in range(8):  # 4 s of KeepAlive alone: past the 1.5 s idle limit
            await sock.send_keep_alive()
            await asyncio.sleep(0.5)
        assert call.close_code is None, "KeepAlive did not hold the stream"
    assert call.close_code == 1011 and call.close_reason == "NET-0001", call
    assert call.of(ListenV1Error)[0].variant == "NET-0001"
    assert call.of(ListenV1Metadata), "what was received is accounted for before the close"


async def test_a_stream_past_its_length_limit_is_data_0000_not_net_0001(short_server: ServerThread) -> None:
    """Both limits are the core's OUT_OF_RANGE; the door tells them apart: too long is the client's data."""
    call = Call()
    async with live(short_server, call, encoding="linear16", sample_rate=16000) as sock:
        await send_paced(sock, to_linear16_bytes(silence(SHORT_MAX_STREAM_SECONDS + 1)), 32000, None)
    assert call.close_code == 1008 and call.close_reason == "DATA-0000", call
    errors = call.of(ListenV1Error)
    assert len(errors) == 1 and "max_stream_seconds" in errors[0].description
    assert call.of(ListenV1Metadata)[0].duration <= SHORT_MAX_STREAM_SECONDS


async def test_a_drain_gives_the_call_finals_then_goes_away(
    service_engine: Engine, tokens_file: Path
) -> None:
    """A drain (what SIGTERM starts): the utterance in progress (its speech sent, its pause not long enough
    yet to end it) gets its final, then Metadata and close 1001 (go elsewhere), while the client goes on
    sending; the drain then completes. A server of its own: this one drains (the signal and the exit
    status: test_server_processes.py)."""
    sentence = speak("I will call you back tomorrow morning.")
    call = Call()
    config = ServerConfig(auth_tokens_file=str(tokens_file), drain_seconds=30)
    server = await asyncio.to_thread(ServerThread(config, service_engine, http=True).start)
    try:
        async with live(server, call, encoding="linear16", sample_rate=16000) as sock:
            audio = to_linear16_bytes(np.concatenate([sentence, silence(0.2)]))
            await send_paced(sock, audio, 3200, 2 * 32000)
            await asyncio.sleep(1.0)  # the server reads what is in flight; no audio: no endpoint either
            assert not call.finals, "the utterance ended before the drain"
            drained = asyncio.wrap_future(server.drain())
            deadline = time.monotonic() + 60
            while call.close_code is None:
                assert time.monotonic() < deadline, "the drain did not close the stream"
                try:
                    await sock.send_media(to_linear16_bytes(silence(0.1)))  # the live call keeps sending
                except websockets.exceptions.ConnectionClosed:
                    break  # the close reached the sender before the receiver task recorded it
                await asyncio.sleep(0.1)
        await asyncio.wait_for(drained, 60)
    finally:
        await asyncio.to_thread(server.stop)
    assert call.close_code == 1001, call
    assert "call you back tomorrow" in normalize(call.text())
    assert call.of(ListenV1Metadata)
    assert call.messages.index(call.finals[-1]) < call.messages.index(call.of(ListenV1Metadata)[0])


async def test_a_draining_server_refuses_a_new_call_with_503(short_server: ServerThread) -> None:
    async def drain_the_core() -> None:
        short_server.server.recognizer.drain()  # what SIGTERM's drain does first

    await asyncio.get_running_loop().run_in_executor(None, short_server.call, drain_the_core())
    with pytest.raises(ApiError) as e:
        async with live(short_server, Call(), encoding="linear16", sample_rate=16000):
            pass
    assert e.value.status_code == 503
    status, body, header = handshake_refusal(short_server, "model=nova-3")
    assert status == 503 and "draining" in body["err_msg"] and "draining" in header
