"""The OpenAI Realtime transcription door (`/v1/realtime`), end to end: OpenAI's own `openai` client
(`client.realtime.connect(extra_query={"intent": "transcription"})`, unmodified) at a real server on
loopback, real tiny.en, real speech. Every event the server sends is read back through the vendor's
pydantic type for its `type` (required fields present, literals right), and every event the test sends is
first checked against the vendor's client-event type."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import openai
import pytest
import soundfile as sf
import soxr
import websockets
from openai.types.realtime import (
    ConversationItemInputAudioTranscriptionCompletedEvent,
    ConversationItemInputAudioTranscriptionDeltaEvent,
    ConversationItemInputAudioTranscriptionFailedEvent,
    InputAudioBufferAppendEvent,
    InputAudioBufferClearedEvent,
    InputAudioBufferClearEvent,
    InputAudioBufferCommitEvent,
    InputAudioBufferCommittedEvent,
    InputAudioBufferSpeechStartedEvent,
    InputAudioBufferSpeechStoppedEvent,
    RealtimeErrorEvent,
    RealtimeTranscriptionSessionCreateRequest,
    SessionCreatedEvent,
    SessionUpdatedEvent,
    SessionUpdateEvent,
)
from openai.types.websocket_reconnection import ReconnectingEvent, ReconnectingOverrides
from prometheus_client import REGISTRY

from clients.scoring import corpus_wer, normalize
from engine import Engine, EngineConfig
from engine.hooks import EngineHooks
from scripts.real_speech import real_clips
from service.config import ServerConfig
from service.doors.openai_realtime.protocol import TurnText
from tests.support.audio import (
    RATE,
    make_conversation,
    silence,
    to_alaw_8k_bytes,
    to_linear16_bytes,
    to_mulaw_8k_bytes,
)
from tests.support.server import DOOR_TOKEN, ServerThread

pytestmark = pytest.mark.slow
TOKEN = DOOR_TOKEN
STEP_S = 60.0  # the longest the server may take to answer anything here (2 shared cores, real tiny.en)

SERVER_EVENTS: dict[str, type[openai.BaseModel]] = {
    "session.created": SessionCreatedEvent,
    "session.updated": SessionUpdatedEvent,
    "input_audio_buffer.speech_started": InputAudioBufferSpeechStartedEvent,
    "input_audio_buffer.speech_stopped": InputAudioBufferSpeechStoppedEvent,
    "input_audio_buffer.committed": InputAudioBufferCommittedEvent,
    "input_audio_buffer.cleared": InputAudioBufferClearedEvent,
    "conversation.item.input_audio_transcription.delta": ConversationItemInputAudioTranscriptionDeltaEvent,
    "conversation.item.input_audio_transcription.completed": ConversationItemInputAudioTranscriptionCompletedEvent,
    "conversation.item.input_audio_transcription.failed": ConversationItemInputAudioTranscriptionFailedEvent,
    "error": RealtimeErrorEvent,
}


# --- the server and the client ---


@pytest.fixture(scope="session")
def rt_server(door_server: ServerThread) -> ServerThread:
    return door_server


def client_for(server: ServerThread, token: str = TOKEN) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key=token, max_retries=0)


def connect(
    server: ServerThread,
    token: str = TOKEN,
    on_reconnecting: Callable[[ReconnectingEvent], ReconnectingOverrides | None] | None = None,
) -> Any:
    """The official client's transcription connection (open and close bounded by websockets' timeouts)."""
    return client_for(server, token).realtime.connect(
        extra_query={"intent": "transcription"},
        websocket_connection_options={"open_timeout": STEP_S, "close_timeout": 10},
        on_reconnecting=on_reconnecting,
        max_retries=1,
    )


def wer(reference: str, hypothesis: str) -> float:
    return corpus_wer([reference], [hypothesis])


def checked(raw: bytes) -> dict[str, Any]:
    """A server event as JSON, after the vendor's type for its `type` has validated it."""
    data = json.loads(raw)
    kind = data.get("type")
    assert kind in SERVER_EVENTS, f"unexpected server event {kind!r}: {data}"
    SERVER_EVENTS[kind].model_validate_json(raw)
    assert isinstance(data["event_id"], str) and data["event_id"], data
    return data


async def recv(conn: Any) -> dict[str, Any]:
    raw = await asyncio.wait_for(conn.recv_bytes(), STEP_S)
    event = conn.parse_event(raw)  # what the client itself makes of it
    data = checked(raw)
    assert event.type == data["type"]
    return data


async def send_session_update(conn: Any, session: dict[str, Any], event_id: str | None = None) -> None:
    """A session.update, checked first against the vendor's client-event type."""
    message: dict[str, Any] = {"type": "session.update", "session": session}
    if event_id:
        message["event_id"] = event_id
    SessionUpdateEvent.model_validate(message)
    RealtimeTranscriptionSessionCreateRequest.model_validate(session)
    if event_id:
        await conn.session.update(session=session, event_id=event_id)
    else:
        await conn.session.update(session=session)


async def append(conn: Any, audio: bytes) -> None:
    b64 = base64.b64encode(audio).decode()
    InputAudioBufferAppendEvent.model_validate({"type": "input_audio_buffer.append", "audio": b64})
    await conn.input_audio_buffer.append(audio=b64)


async def commit(conn: Any, event_id: str | None = None) -> None:
    InputAudioBufferCommitEvent.model_validate({"type": "input_audio_buffer.commit", "event_id": event_id})
    await (
        conn.input_audio_buffer.commit(event_id=event_id) if event_id else conn.input_audio_buffer.commit()
    )


async def open_session(conn: Any, session: dict[str, Any]) -> dict[str, Any]:
    """session.created (the first event, before the client says anything), then the update and its
    session.updated; returns the effective session."""
    created = await recv(conn)
    assert created["type"] == "session.created", created
    await send_session_update(conn, session)
    updated = await recv(conn)
    assert updated["type"] == "session.updated", updated
    return updated["session"]


def session_config(
    fmt: dict[str, Any], turn_detection: dict[str, Any] | None, **transcription: Any
) -> dict[str, Any]:
    return {
        "type": "transcription",
        "audio": {
            "input": {
                "format": fmt,
                "transcription": {"model": "gpt-4o-transcribe", "language": "en", **transcription},
                "turn_detection": turn_detection,
            }
        },
    }


PCMU = {"type": "audio/pcmu"}
PCMA = {"type": "audio/pcma"}
PCM = {"type": "audio/pcm", "rate": 24000}
SERVER_VAD = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}


def pcm24k(audio: np.ndarray, rate: int = RATE) -> bytes:
    """audio/pcm: 16-bit little-endian mono at 24 kHz."""
    return to_linear16_bytes(soxr.resample(audio, rate, 24000).astype(np.float32))


async def send_audio(conn: Any, data: bytes, chunk: int, pace_s: float = 0.0) -> None:
    for i in range(0, len(data), chunk):
        await append(conn, data[i : i + chunk])
        if pace_s:
            await asyncio.sleep(pace_s)


@dataclass
class Turn:
    """Everything the server said about one item."""

    item_id: str
    events: list[dict[str, Any]] = field(default_factory=list)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    @property
    def completed(self) -> dict[str, Any]:
        (done,) = self.of("conversation.item.input_audio_transcription.completed")
        return done

    @property
    def deltas(self) -> str:
        return "".join(e["delta"] or "" for e in self.of("conversation.item.input_audio_transcription.delta"))


async def turns_until(
    conn: Any, done: Callable[[dict[str, Turn]], bool], sender: asyncio.Task[None] | None = None
) -> tuple[dict[str, Turn], list[str]]:
    """Events grouped by item_id (in the order items appeared) until `done`; also every event type seen.
    `done` is asked again when `sender` (the task appending the audio) ends, not only at each event."""
    turns: dict[str, Turn] = {}
    kinds: list[str] = []
    while not done(turns):
        if sender is not None and not sender.done():
            next_event = asyncio.ensure_future(recv(conn))
            await asyncio.wait({next_event, sender}, return_when=asyncio.FIRST_COMPLETED)
            if not next_event.done():
                next_event.cancel()  # websockets' recv may be cancelled: the event stays queued
                with contextlib.suppress(asyncio.CancelledError):
                    await next_event
                continue
            e = next_event.result()
        else:
            e = await recv(conn)
        kinds.append(e["type"])
        assert e["type"] != "error", (e, kinds)
        if "item_id" in e:
            turns.setdefault(e["item_id"], Turn(e["item_id"])).events.append(e)
    return turns, kinds


def completed_count(n: int) -> Callable[[dict[str, Turn]], bool]:
    return lambda turns: sum(1 for t in turns.values() if t.of(
        "conversation.item.input_audio_transcription.completed")) >= n  # fmt: skip


def librivox_call() -> tuple[np.ndarray, str]:
    """Three sentences of real human speech (pocketsphinx's librivox clips), a second apart, after 0.4 s
    of silence: one leg of a call, and what was said."""
    parts, said = [silence(0.4)], []
    for wav, reference in real_clips()[2:5]:
        audio, rate = sf.read(wav, dtype="float32")
        assert rate == RATE
        parts += [audio, silence(1.0)]
        said.append(reference)
    return np.concatenate(parts), " ".join(said)


# --- the session ---


async def test_session_created_first_then_update_answered_with_the_effective_session(
    rt_server: ServerThread,
) -> None:
    async with connect(rt_server) as conn:
        created = await recv(conn)
        assert created["type"] == "session.created"
        session = created["session"]
        # the protocol's defaults: audio/pcm at 24 kHz, server_vad
        assert session["type"] == "transcription"
        assert session["audio"]["input"]["format"] == PCM
        assert session["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        await send_session_update(
            conn,
            session_config(
                PCMU,
                {"type": "semantic_vad", "eagerness": "low"},
                prompt="Acme Telecom",
                keywords=["Acme", "Zorblax"],
            )
            | {"include": ["item.input_audio_transcription.logprobs"]},
        )
        updated = await recv(conn)
        assert updated["type"] == "session.updated", updated
        effective = updated["session"]["audio"]["input"]
        assert effective["format"] == PCMU
        # the model that serves it, whatever the client's model name selected
        assert effective["transcription"]["model"] == rt_server.engine.info.name
        assert effective["transcription"]["prompt"] == "Acme Telecom"
        assert effective["transcription"]["keywords"] == ["Acme", "Zorblax"]
        # semantic_vad is served by server_vad's endpointing, and the session says so
        assert effective["turn_detection"]["type"] == "server_vad"
        assert effective["noise_reduction"] is None
        assert updated["session"]["include"] == ["item.input_audio_transcription.logprobs"]
        # an update changes only the fields it carries
        await send_session_update(
            conn, {"type": "transcription", "audio": {"input": {"turn_detection": None}}}
        )
        again = (await recv(conn))["session"]["audio"]["input"]
        assert again["turn_detection"] is None
        assert again["format"] == PCMU and again["transcription"]["prompt"] == "Acme Telecom"


# --- calls ---


async def test_real_speech_mulaw_call_with_deltas_turn_times_and_word_offsets(
    rt_server: ServerThread,
) -> None:
    """Real speech as a phone leg sends it (8 kHz G.711 mu-law, 100 ms appends, in real time): each turn
    gets speech_started / speech_stopped (its times in the call), committed (chained by previous_item_id),
    deltas and completed with the transcript, its duration and its words' times."""
    audio, reference = librivox_call()
    ulaw = to_mulaw_8k_bytes(audio)
    revisions = REGISTRY.get_sample_value("asr_realtime_delta_revisions_total") or 0.0
    async with connect(rt_server) as conn:
        await open_session(
            conn, session_config(PCMU, SERVER_VAD) | {"include": ["item.input_audio_transcription.logprobs"]}
        )
        sender = asyncio.create_task(send_audio(conn, ulaw, 800, pace_s=0.1))
        turns, kinds = await turns_until(
            conn, lambda t: sender.done() and completed_count(len(t))(t) and len(t) >= 3, sender
        )
        await sender
    assert kinds.count("input_audio_buffer.speech_started") == len(turns) >= 3, kinds
    text = " ".join(t.completed["transcript"] for t in turns.values())
    assert "ill disposed" in normalize(text), text
    assert wer(reference, text) < 0.3, text
    previous: str | None = None
    last_end = 0
    for turn in turns.values():
        (started,) = turn.of("input_audio_buffer.speech_started")
        (stopped,) = turn.of("input_audio_buffer.speech_stopped")
        (committed,) = turn.of("input_audio_buffer.committed")
        done = turn.completed
        kinds_in_turn = [e["type"] for e in turn.events]
        # the protocol's order within a turn; deltas may come as early as the speech itself
        assert kinds_in_turn.index("input_audio_buffer.speech_started") == 0
        assert (
            kinds_in_turn.index("input_audio_buffer.speech_stopped")
            < kinds_in_turn.index("input_audio_buffer.committed")
            < kinds_in_turn.index("conversation.item.input_audio_transcription.completed")
        )
        assert kinds_in_turn[-1] == "conversation.item.input_audio_transcription.completed"
        assert committed["previous_item_id"] == previous
        previous = turn.item_id
        assert last_end <= started["audio_start_ms"] < stopped["audio_end_ms"] <= len(audio) / RATE * 1000 + 1
        last_end = stopped["audio_end_ms"]
        # usage: the turn's audio
        assert done["usage"]["type"] == "duration"
        assert (
            0 < done["usage"]["seconds"] <= (stopped["audio_end_ms"] - started["audio_start_ms"]) / 1000 + 0.5
        )
        # word offsets (this server's extension: the protocol has no place for them) within the turn
        words = done["words"]
        # Whisper's words, which split some of the transcript's ("ill-disposed": "ill", "-disposed")
        assert "".join(w["word"] for w in words) == done["transcript"].replace(" ", ""), done
        assert all(
            started["audio_start_ms"] / 1000 - 0.1
            <= w["start"]
            <= w["end"]
            <= stopped["audio_end_ms"] / 1000 + 0.1
            for w in words
        ), (words, started, stopped)
        assert all(a["start"] <= b["start"] for a, b in itertools.pairwise(words))
        # logprobs, one per word, as asked with include
        assert [lp["token"].strip() for lp in done["logprobs"]] == [w["word"] for w in words]
        assert all(lp["logprob"] <= 0 for lp in done["logprobs"])
    # the first sentence starts 0.4 s in: its speech_started is within the prefix padding of it
    first = next(iter(turns.values())).of("input_audio_buffer.speech_started")[0]
    assert 0 <= first["audio_start_ms"] <= 800, first
    # deltas: increments whose concatenation is the transcript (unless a final revised text the interims
    # had agreed on, which the server counts)
    revised = (REGISTRY.get_sample_value("asr_realtime_delta_revisions_total") or 0.0) - revisions
    for turn in turns.values():
        if not revised:
            assert turn.deltas == turn.completed["transcript"], turn.events
    # interim results became deltas before their turn was over (real-time pacing, interims every 0.5 s)
    early = [
        t
        for t in turns.values()
        if [e["type"] for e in t.events].index("conversation.item.input_audio_transcription.delta")
        < [e["type"] for e in t.events].index("input_audio_buffer.committed")
    ]
    assert early, [[e["type"] for e in t.events] for t in turns.values()]


CUSTOMER = ["My phone stopped working yesterday.", "I need help with my bill."]
AGENT = ["Thank you for calling, how can I help you today?", "Let me look that up for you."]


async def test_two_channel_call_is_one_session_per_leg(rt_server: ServerThread) -> None:
    """A two-channel call: the protocol's audio is mono, so each leg is its own session (the agent's as
    audio/pcm at 24 kHz, the customer's as A-law), both at once; each gets its own sentences at their times."""
    agent, agent_bounds = make_conversation(AGENT, pause_s=1.0, lead_s=0.3)
    customer, customer_bounds = make_conversation(CUSTOMER, pause_s=1.0, lead_s=agent_bounds[0][1] + 0.5)

    async def leg(fmt: dict[str, Any], data: bytes, chunk: int, n: int) -> list[Turn]:
        async with connect(rt_server) as conn:
            await open_session(conn, session_config(fmt, SERVER_VAD))
            sender = asyncio.create_task(send_audio(conn, data, chunk))
            turns, _ = await turns_until(conn, completed_count(n))
            await sender
            return list(turns.values())

    agent_turns, customer_turns = await asyncio.gather(
        leg(PCM, pcm24k(np.concatenate([agent, silence(1.0)])), 4800, len(AGENT)),
        leg(PCMA, to_alaw_8k_bytes(np.concatenate([customer, silence(1.0)])), 800, len(CUSTOMER)),
    )
    for turns, sentences, bounds, other in (
        (agent_turns, AGENT, agent_bounds, CUSTOMER),
        (customer_turns, CUSTOMER, customer_bounds, AGENT),
    ):
        assert len(turns) == len(sentences), [t.events for t in turns]
        for turn, sentence, (start_s, end_s) in zip(turns, sentences, bounds, strict=True):
            said = normalize(turn.completed["transcript"])
            assert wer(sentence, said) < 0.34, (sentence, said)
            assert not any(normalize(o) in said for o in other)
            (started,) = turn.of("input_audio_buffer.speech_started")
            (stopped,) = turn.of("input_audio_buffer.speech_stopped")
            assert abs(started["audio_start_ms"] / 1000 - start_s) < 0.6, (started, start_s)
            assert abs(stopped["audio_end_ms"] / 1000 - end_s) < 1.2, (stopped, end_s)


async def test_recorded_file_committed_by_the_client_without_server_vad(rt_server: ServerThread) -> None:
    """A recorded sentence sent as fast as the socket takes it with turn detection off: no speech events;
    the client's commit makes one item, transcribed whole."""
    wav, reference = real_clips()[1]  # the first librivox sentence (jfk.flac is the first clip)
    audio, rate = sf.read(wav, dtype="float32")
    async with connect(rt_server) as conn:
        await open_session(conn, session_config(PCM, None))
        await send_audio(conn, pcm24k(audio, rate), 48000)
        await commit(conn, event_id="commit-1")
        turns, kinds = await turns_until(conn, completed_count(1))
    assert "input_audio_buffer.speech_started" not in kinds
    (turn,) = turns.values()
    assert turn.events[0]["type"] == "input_audio_buffer.committed"
    assert turn.of("input_audio_buffer.committed")[0]["previous_item_id"] is None
    done = turn.completed
    assert wer(reference, done["transcript"]) < 0.2, (reference, done["transcript"])
    assert math.isclose(done["usage"]["seconds"], len(audio) / rate, abs_tol=0.1), done["usage"]


async def test_clear_drops_the_uncommitted_audio(rt_server: ServerThread) -> None:
    """input_audio_buffer.clear (the core's clear): what was appended and not committed is never
    transcribed; what comes after is."""
    said, _ = make_conversation(["Please cancel my subscription."], pause_s=0.3)
    kept, _ = make_conversation(["Thank you very much for your help."], pause_s=0.3)
    async with connect(rt_server) as conn:
        await open_session(conn, session_config(PCMU, None))
        await send_audio(conn, to_mulaw_8k_bytes(said), 8000)
        clear = {"type": "input_audio_buffer.clear", "event_id": "clear-1"}
        InputAudioBufferClearEvent.model_validate(clear)
        await conn.input_audio_buffer.clear(event_id="clear-1")
        assert (await recv(conn))["type"] == "input_audio_buffer.cleared"
        await send_audio(conn, to_mulaw_8k_bytes(kept), 8000)
        # once audio is being recognized, its format can no longer change; keywords can (next turn on)
        await conn.send_raw(
            json.dumps({"type": "session.update", "session": session_config(PCMA, None), "event_id": "u1"})
        )
        await expect_error(conn, "invalid_value", "session.audio.input.format", "u1")
        await send_session_update(conn, session_config(PCMU, None, keywords=["Zorblax"]))
        updated = await recv(conn)
        assert updated["session"]["audio"]["input"]["transcription"]["keywords"] == ["Zorblax"], updated
        await commit(conn)
        turns, _ = await turns_until(conn, completed_count(1))
    (turn,) = turns.values()
    text = normalize(turn.completed["transcript"])
    assert "help" in text and "cancel" not in text and "subscription" not in text, text


async def test_with_server_vad_a_commit_ends_the_speech_in_progress_or_commits_silence(
    rt_server: ServerThread,
) -> None:
    """A manual commit with server VAD on: over silence it makes an item of silence (completed, empty);
    during speech it ends the turn there (speech_stopped, committed, completed) without waiting for
    silence_duration_ms of silence."""
    said, _ = make_conversation(["Thank you very much for your help."], pause_s=0.2)
    async with connect(rt_server) as conn:
        await open_session(conn, session_config(PCMU, SERVER_VAD))
        await send_audio(conn, to_mulaw_8k_bytes(silence(0.5)), 8000)
        await commit(conn)
        quiet, _ = await turns_until(conn, completed_count(1))
        await send_audio(conn, to_mulaw_8k_bytes(said), 8000)
        await commit(conn)
        turns, _ = await turns_until(conn, completed_count(1))
    (silent,) = quiet.values()
    assert [e["type"] for e in silent.events] == [
        "input_audio_buffer.committed",
        "conversation.item.input_audio_transcription.completed",
    ]
    assert silent.completed["transcript"] == ""
    (spoken,) = turns.values()
    kinds = [e["type"] for e in spoken.events]
    assert kinds[0] == "input_audio_buffer.speech_started", kinds
    assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index("input_audio_buffer.committed")
    assert spoken.of("input_audio_buffer.committed")[0]["previous_item_id"] == silent.item_id
    assert "help" in normalize(spoken.completed["transcript"]), spoken.completed


# --- bad input ---


async def expect_error(
    conn: Any, code: str, param: str | None, event_id: str | None = None
) -> dict[str, Any]:
    e = await recv(conn)
    assert e["type"] == "error", e
    error = e["error"]
    assert (error["code"], error["param"], error["event_id"]) == (code, param, event_id), error
    assert error["type"] == "invalid_request_error" and error["message"], error
    return error


async def test_bad_client_events_get_error_events_and_the_session_goes_on(rt_server: ServerThread) -> None:
    """Each bad event is answered by an `error` naming the parameter (and the client's event_id), and the
    socket stays open: the session still transcribes afterwards."""
    async with connect(rt_server) as conn:
        assert (await recv(conn))["type"] == "session.created"
        raw = conn.send_raw  # what a client with a bug sends, below the typed API
        await raw("{not json")
        await expect_error(conn, "invalid_json", None)
        await raw("[" * 100_000)  # nested past the parser's depth (issue 26 #10): the same answer
        await expect_error(conn, "invalid_json", None)
        await raw(json.dumps({"type": "input_audio_buffer.bogus", "event_id": "e1"}))
        error = await expect_error(conn, "invalid_value", "type", "e1")
        assert "input_audio_buffer.append" in error["message"]  # lists what is supported
        await raw(json.dumps({"type": "response.create", "event_id": "e2"}))
        error = await expect_error(conn, "invalid_value", "type", "e2")
        assert "transcription session" in error["message"]
        await raw(json.dumps({"type": "input_audio_buffer.append", "event_id": "e3"}))
        await expect_error(conn, "missing_required_parameter", "audio", "e3")
        await raw(
            json.dumps({"type": "input_audio_buffer.append", "audio": "%%%not base64", "event_id": "e4"})
        )
        await expect_error(conn, "invalid_value", "audio", "e4")
        limit = rt_server.config.max_chunk_bytes
        await raw(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(limit + 2)).decode(),
                              "event_id": "e5"}))  # fmt: skip
        error = await expect_error(conn, "invalid_value", "audio", "e5")
        assert str(limit) in error["message"] and "max_chunk_bytes" in error["message"], error
        await commit(conn, event_id="e6")
        error = await expect_error(conn, "input_audio_buffer_commit_empty", None, "e6")
        assert "100" in error["message"], error  # the least a commit needs, in ms
        for session, code, param in [
            ({"type": "realtime"}, "invalid_value", "session.type"),
            ({"type": "transcription", "input_audio_format": "g711_ulaw"}, "unknown_parameter",
             "session.input_audio_format"),  # the beta shape inside a GA session.update
            (session_config({"type": "audio/pcm", "rate": 16000}, SERVER_VAD), "invalid_value",
             "session.audio.input.format.rate"),
            (session_config({"type": "audio/opus"}, SERVER_VAD), "invalid_value", "session.audio.input.format.type"),
            (session_config(PCMU, SERVER_VAD | {"threshold": 2.0}), "invalid_value",
             "session.audio.input.turn_detection.threshold"),
            (session_config(PCMU, SERVER_VAD | {"silence_duration_ms": "long"}), "invalid_type",
             "session.audio.input.turn_detection.silence_duration_ms"),
            (session_config(PCMU, SERVER_VAD | {"idle_timeout_ms": 5000}), "invalid_value",
             "session.audio.input.turn_detection.idle_timeout_ms"),
            (session_config(PCMU, SERVER_VAD, model="gpt-4o-transcribe-diarize"), "invalid_value",
             "session.audio.input.transcription.model"),
            (session_config(PCMU, SERVER_VAD, language="fr"), "invalid_value",
             "session.audio.input.transcription.language"),  # tiny.en is English-only
            (session_config(PCMU, SERVER_VAD, prompt="x" * 5000), "invalid_value",
             "session.audio.input.transcription.prompt"),
        ]:  # fmt: skip
            await raw(json.dumps({"type": "session.update", "session": session, "event_id": "bad-update"}))
            error = await expect_error(conn, code, param, "bad-update")
            if param.endswith("prompt"):
                assert "2048" in error["message"], error
        # binary frames carry no event
        await conn._connection.send(b"\x00\x01")
        await expect_error(conn, "invalid_value", None)
        # still serving, and none of the refused updates took effect: still audio/pcm, server_vad
        await send_session_update(conn, {"type": "transcription", "include": []})
        session = (await recv(conn))["session"]["audio"]["input"]
        assert session["format"] == PCM and session["turn_detection"]["type"] == "server_vad"


async def test_a_message_over_the_size_limit_closes_with_1009(rt_server: ServerThread) -> None:
    async with connect(rt_server) as conn:
        assert (await recv(conn))["type"] == "session.created"
        big = base64.b64encode(bytes(4 * rt_server.config.max_chunk_bytes)).decode()
        with pytest.raises(websockets.ConnectionClosed) as closed:  # the send itself, or the next read
            await conn.send_raw(json.dumps({"type": "input_audio_buffer.append", "audio": big}))
            while True:
                await asyncio.wait_for(conn.recv_bytes(), STEP_S)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


async def test_connect_without_the_transcription_intent_is_refused(rt_server: ServerThread) -> None:
    manager = client_for(rt_server).realtime.connect(
        model="gpt-realtime", websocket_connection_options={"open_timeout": STEP_S}
    )
    with pytest.raises(websockets.InvalidStatus) as refused:
        await manager.__aenter__()
    response = refused.value.response
    assert response.status_code == 400
    error = json.loads(response.body)["error"]
    assert error["param"] == "intent" and "transcription" in error["message"], error


async def test_the_beta_protocol_is_refused_by_name(rt_server: ServerThread) -> None:
    """openai's deprecated beta client (transcription_session.update, other fields) says so in its
    `OpenAI-Beta: realtime=v1` header: refused before the upgrade, naming it and what to use instead."""
    client = openai.AsyncOpenAI(  # the beta client takes wss:// unless told the socket's own URL
        base_url=rt_server.http_url + "/v1",
        websocket_base_url=rt_server.http_url.replace("http", "ws", 1) + "/v1",
        api_key=TOKEN,
        max_retries=0,
    )
    manager = client.beta.realtime.connect(
        model="gpt-4o-transcribe",
        extra_query={"intent": "transcription"},
        websocket_connection_options={"open_timeout": STEP_S},
    )
    with pytest.raises(websockets.InvalidStatus) as refused:
        await manager.__aenter__()
    assert refused.value.response.status_code == 400
    error = json.loads(refused.value.response.body)["error"]
    assert error["param"] == "OpenAI-Beta" and "session.update" in error["message"], error


# --- auth ---


async def test_auth_bearer_header_refused_then_accepted(rt_server: ServerThread) -> None:
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with connect(rt_server, token="wrong-token"):
            pass
    response = refused.value.response
    assert response.status_code == 401
    error = json.loads(response.body)["error"]
    assert error["code"] == "invalid_api_key" and "invalid" in error["message"], error
    # no key at all (the official client will not connect without one)
    url = rt_server.http_url.replace("http", "ws", 1) + "/v1/realtime?intent=transcription"
    with pytest.raises(websockets.InvalidStatus) as missing:
        async with websockets.connect(url, open_timeout=STEP_S):
            pass
    assert missing.value.response.status_code == 401
    assert "Authorization: Bearer" in json.loads(missing.value.response.body)["error"]["message"]
    async with connect(rt_server) as conn:
        assert (await recv(conn))["type"] == "session.created"


async def test_auth_browser_subprotocol(rt_server: ServerThread) -> None:
    """Browsers cannot set headers: the key rides in `Sec-WebSocket-Protocol` beside `realtime`, as
    OpenAI's own JavaScript client sends it."""
    url = rt_server.http_url.replace("http", "ws", 1) + "/v1/realtime?intent=transcription"
    async with websockets.connect(
        url, subprotocols=["realtime", f"openai-insecure-api-key.{TOKEN}"], open_timeout=STEP_S
    ) as ws:
        assert ws.subprotocol == "realtime"
        assert checked(await asyncio.wait_for(ws.recv(decode=False), STEP_S))["type"] == "session.created"
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(
            url, subprotocols=["realtime", "openai-insecure-api-key.guess"], open_timeout=STEP_S
        ):
            pass
    assert refused.value.response.status_code == 401


# --- metrics ---


async def test_streams_are_labelled_with_the_door(rt_server: ServerThread) -> None:
    def opened() -> float:
        labels = {"door": "openai-realtime", "kind": "stream", "code": "OK"}
        return REGISTRY.get_sample_value("asr_door_calls_total", labels) or 0.0

    before = opened()
    async with connect(rt_server) as conn:
        await open_session(conn, session_config(PCMU, None))
        said, _ = make_conversation(["Hello there."], pause_s=0.3)
        await send_audio(conn, to_mulaw_8k_bytes(said), 8000)
        await commit(conn)
        await turns_until(conn, completed_count(1))
    # counted once the server has seen the socket close (it closed normally: OK)
    deadline = time.monotonic() + STEP_S
    while opened() < before + 1:
        assert time.monotonic() < deadline, "the session was not counted"
        await asyncio.sleep(0.05)
    assert opened() == before + 1


# --- a stream that ends in an error ---


async def test_a_limit_ends_the_session_after_the_finals_with_an_error_and_close_1008(
    service_engine: Engine,
) -> None:
    """Past --max-stream-seconds the turn heard so far still completes (nothing the client sent is lost),
    then an `error` event names the limit and the socket closes 1008; a session that sends no audio for
    --idle-audio-timeout gets `idle_timeout` and 1008 too."""
    server = ServerThread(ServerConfig(max_stream_seconds=3, idle_audio_timeout=2), service_engine, http=True)
    server.start()
    said, _ = make_conversation(["Thank you very much for your help."], pause_s=0.3)
    try:
        async with connect(server) as conn:
            await open_session(conn, session_config(PCMU, None))
            ulaw = to_mulaw_8k_bytes(np.concatenate([said, silence(4.0)]))
            await send_audio(conn, ulaw[: 8000 * 3], 8000)  # the first 3 s, within the limit
            await send_audio(conn, ulaw[8000 * 3 :], 8000)  # past it
            events: list[dict[str, Any]] = []
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    events.append(await recv(conn))
        kinds = [e["type"] for e in events]
        assert kinds[:2] == [
            "input_audio_buffer.committed",
            "conversation.item.input_audio_transcription.delta",
        ], kinds
        done = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
        assert "help" in normalize(done["transcript"]), done
        error = events[-1]["error"]
        assert events[-1]["type"] == "error" and error["code"] == "out_of_range", events[-1]
        assert "max_stream_seconds" in error["message"], error
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        async with connect(server) as conn:
            assert (await recv(conn))["type"] == "session.created"
            with pytest.raises(websockets.ConnectionClosed) as idle:
                error = (await recv(conn))["error"]
                assert error["code"] == "idle_timeout" and "idle_audio_timeout" in error["message"], error
                await recv(conn)
        assert idle.value.rcvd is not None and idle.value.rcvd.code == 1008
    finally:
        server.stop()


async def test_a_session_that_sends_events_but_never_audio_ends_at_the_idle_timeout(
    service_engine: Engine,
) -> None:
    """Issue 26 #8: before its first audio a session holds no stream place, and each event it sent
    started its idle clock again, so session.update after session.update held it open for ever. The
    first audio is now due --idle-audio-timeout after the session opens, whatever else comes."""
    server = ServerThread(ServerConfig(idle_audio_timeout=1.5), service_engine, http=True).start()
    session = session_config(PCMU, None)
    events: list[dict[str, Any]] = []
    try:
        async with connect(server) as conn:
            await open_session(conn, session)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                for _ in range(20):  # 8 s of updates, 0.4 s apart
                    with contextlib.suppress(websockets.ConnectionClosed):  # the error event is read next
                        await send_session_update(conn, session)
                    events.append(await recv(conn))
                    await asyncio.sleep(0.4)
        assert events[-1]["type"] == "error", events[-1]
        assert events[-1]["error"]["code"] == "idle_timeout", events[-1]
        assert "idle_audio_timeout" in events[-1]["error"]["message"], events[-1]
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    finally:
        server.stop()


async def test_a_turn_that_fails_gets_failed_then_error_and_close_1011(
    rt_server: ServerThread, engine_hooks: EngineHooks
) -> None:
    """The engine fails the committed turn's recognition (an injected fault): the item gets `.failed`
    with the reason, then an `error` event, then close 1011 (internal error); no completed for it."""

    def fail(request: Any) -> None:
        raise RuntimeError("injected recognition failure")

    said, _ = make_conversation(["Thank you very much for your help."], pause_s=0.3)
    events: list[dict[str, Any]] = []
    async with connect(rt_server) as conn:
        await open_session(conn, session_config(PCMU, None))
        with engine_hooks.installed(fault=fail):
            await send_audio(conn, to_mulaw_8k_bytes(said), 8000)
            await commit(conn)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    events.append(await recv(conn))
    kinds = [e["type"] for e in events if e["type"] != "conversation.item.input_audio_transcription.delta"]
    assert kinds == [
        "input_audio_buffer.committed",
        "conversation.item.input_audio_transcription.failed",
        "error",
    ], kinds
    (committed,) = (e for e in events if e["type"] == "input_audio_buffer.committed")
    (failed,) = (e for e in events if e["type"] == "conversation.item.input_audio_transcription.failed")
    assert failed["item_id"] == committed["item_id"]
    assert failed["error"]["code"] == "internal" and "injected" in failed["error"]["message"], failed
    assert events[-1]["error"]["type"] == "server_error", events[-1]
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011


# --- drain ---


async def test_drain_sends_the_finals_then_closes_1012_so_the_client_reconnects() -> None:
    """The server drains with a turn ended and a session open: the turn's completed comes first, then an
    `error` server_draining saying how much of the session's audio was heard (audio_end_ms: what follows
    goes to a new session), then close 1012 (service restart), which the official client's reconnection
    policy treats as "go elsewhere".
    AsrServer.drain (what SIGTERM runs) stops its engine too: this server has its own."""
    engine = Engine(EngineConfig(model="tiny.en", threads=2))
    engine.start()
    server = ServerThread(ServerConfig(drain_seconds=10), engine, http=True).start()
    reconnects: list[ReconnectingEvent] = []

    def on_reconnecting(e: ReconnectingEvent) -> ReconnectingOverrides:
        reconnects.append(e)
        return {"abort": True}  # a real client would reconnect through its balancer

    said, _ = make_conversation(["Thank you for calling, how can I help you today?"], pause_s=1.0)
    try:
        async with connect(server, on_reconnecting=on_reconnecting) as conn:
            await open_session(conn, session_config(PCMU, SERVER_VAD))
            await send_audio(conn, to_mulaw_8k_bytes(said), 8000)
            started = await recv(conn)
            assert started["type"] == "input_audio_buffer.speech_started"
            drain = asyncio.get_running_loop().run_in_executor(None, server.call, server.server.drain(10.0))
            events: list[dict[str, Any]] = []
            async for event in _events(conn):
                events.append(event)
            await drain
        kinds = [e["type"] for e in events]
        assert "conversation.item.input_audio_transcription.completed" in kinds, kinds
        assert reconnects and reconnects[0].close_code == 1012, reconnects
        # Issue 26 #14: the client learns up to where its audio was heard, to send the rest elsewhere
        draining = events[-1]
        assert draining["type"] == "error" and draining["error"]["code"] == "server_draining", draining
        heard_ms = len(said) / 16000 * 1000
        assert f"audio_end_ms {heard_ms:.0f}" in draining["error"]["message"], draining
    finally:
        server.stop()
        engine.stop()


async def _events(conn: Any) -> AsyncIterator[dict[str, Any]]:
    """Every event until the socket closes (the client's own iteration, so its reconnection policy runs)."""
    iterator = conn.__aiter__()
    while True:
        try:
            event = await asyncio.wait_for(iterator.__anext__(), STEP_S)
        except (StopAsyncIteration, websockets.ConnectionClosed):
            return
        yield event.model_dump(mode="json", exclude_unset=True)


# --- the delta policy, on its own ---


def test_deltas_are_the_stable_prefix_and_add_up_to_the_transcript() -> None:
    turn = TurnText()
    # a word counts once two interims in a row agree on it and it is not the newest's last word
    assert turn.interim("And so my") is None
    assert turn.interim("And so my fellow Amer") == "And so my"
    assert turn.interim("And so my fellow Americans") == " fellow"
    assert turn.final("And so my fellow Americans, ask not.") == " Americans, ask not."
    assert turn.sent == turn.transcript == "And so my fellow Americans, ask not."
    assert not turn.revised
    # a turn of several utterances (no server VAD: one commit) is their finals joined
    assert turn.interim("what your") is None
    assert turn.interim("what your country can") == " what your"
    assert turn.final("what your country can do") == " country can do"
    assert turn.sent == turn.transcript == "And so my fellow Americans, ask not. what your country can do"


def test_a_final_that_revises_sent_text_stops_the_deltas() -> None:
    turn = TurnText()
    turn.interim("Ask not what")
    assert turn.interim("Ask not what your") == "Ask not what"
    assert (
        turn.final("Ask now what your country can do.") is None
    )  # "not" was sent; a delta cannot take it back
    assert turn.revised and turn.transcript == "Ask now what your country can do."
    assert turn.interim("anything more") is None and turn.final("more") is None
