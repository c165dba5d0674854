"""Issue 26: one caller cannot harm another, whatever it sends. The engine here is small (2 KV slots, a live
queue of 12) so that an attack that could fill the queue every stream shares does so at once; the attack
runs beside a well-behaved call, which must end OK with its words."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from engine import Engine, EngineConfig
from service.config import ServerConfig
from service.core.errors import Code, RecognitionError
from service.core.recognizer import Recognizer, Stream
from service.core.types import AudioFormat, CallEvent, RecognitionSettings, Result, StreamSettings
from tests.support.audio import make_conversation, to_mulaw_8k_bytes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_engine() -> Iterator[Engine]:
    engine = Engine(EngineConfig(model="tiny.en", threads=2, kv_slots=2, max_queue=12))
    engine.start()
    engine.warmup()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def speech_chunks() -> list[bytes]:
    """A spoken sentence as 8 kHz mu-law in 3200-byte pieces (0.4 s): each flush has speech to decode."""
    audio, _ = make_conversation(["Please read me the balance of my savings account."], pause_s=0.0)
    data = to_mulaw_8k_bytes(audio)
    return [data[i : i + 3200] for i in range(0, len(data) - 3200, 3200)]


async def _events(stream: Stream, into: list[CallEvent]) -> RecognitionError | None:
    try:
        async for event in stream.events():
            into.append(event)
    except RecognitionError as e:
        return e
    return None


async def test_a_flush_flood_cannot_fill_the_live_queue_every_stream_shares(
    small_engine: Engine, speech_chunks: list[bytes]
) -> None:
    """#1: each flush (Deepgram Finalize, Realtime commit) submitted a live final with no bound per
    stream: 50 flushes in a row filled the engine's queue (12, shared) and the next final of any other
    call was refused RESOURCE_EXHAUSTED. Now a stream's flushes past --max-finals-in-flight (4) wait
    (`hold`, Deepgram) or are refused to that stream alone (Realtime), and the other call is served."""
    recognizer = Recognizer(ServerConfig(), small_engine)
    manual = StreamSettings(RecognitionSettings(AudioFormat("MULAW", 8000)), endpointing=None)
    flood, good, refused = (recognizer.open_stream(manual, door="test") for _ in range(3))
    flood_events: list[CallEvent] = []
    good_events: list[CallEvent] = []
    readers = [
        asyncio.create_task(_events(flood, flood_events)),
        asyncio.create_task(_events(good, good_events)),
    ]
    try:
        for i in range(50):
            flood.audio(speech_chunks[i % len(speech_chunks)])
            flood.finalize(hold=True)
        for chunk in speech_chunks:
            good.audio(chunk)
        good.finalize()
        good.finish()
        refused.audio(speech_chunks[0])
        refused.finalize()
        refusal: RecognitionError | None = None
        try:  # past the bound, without hold: refused, and the audio stays in the utterance in progress
            for chunk in speech_chunks[1:6]:
                refused.audio(chunk)
                refused.finalize()
        except RecognitionError as e:
            refusal = e
        flood.finish()
        good_end, flood_end = await asyncio.wait_for(asyncio.gather(*readers), 120)
    finally:
        for stream in (flood, good, refused):
            await stream.close()
    assert good_end is None, f"the good call was harmed: {good_end}"
    good_text = " ".join(e.transcript for e in good_events if isinstance(e, Result) and e.is_final)
    assert "read me" in good_text.lower(), good_text
    assert flood_end is None and sum(isinstance(e, Result) and e.is_final for e in flood_events) >= 2
    assert refusal is not None and refusal.code is Code.RESOURCE_EXHAUSTED
    assert "--max-finals-in-flight" in refusal.message
