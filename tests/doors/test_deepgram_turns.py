"""The end of turn through the Deepgram door (service/pipeline/turn_model.py): `endpointing` is the silence
at which the server judges a turn, `speech_final` its end. The official deepgram-sdk live client against a
real server on loopback, with real speech (pocketsphinx-testdata's librivox) given a mid-sentence pause."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from tests.doors.test_deepgram import Call, live
from tests.support.audio import to_mulaw_8k_bytes
from tests.support.server import ServerThread

pytestmark = pytest.mark.slow

# "and mister john dashwood had then leisure to consider how | much there might be prudently in his power
# to do for them": the model calls the turn incomplete after "how" (P 0.01 at 16 kHz) and complete at its
# end (P 0.99); 4.10 s is midway between "how" and "much" in the engine's word timings, and the last word
# ends at 6.9 s
DASHWOOD = "/usr/share/pocketsphinx/test/data/librivox/sense_and_sensibility_01_austen_64kb-0870.wav"
PAUSE_AT_S, LAST_WORD_END_S = 4.10, 6.9
LEAD_S, PAUSE_S, TAIL_S = 0.5, 0.7, 5.0
FRAME = 160  # 20 ms of 8 kHz mu-law


@pytest.fixture(scope="module")
def paused_call() -> bytes:
    """The sentence with a 0.7 s pause mid-sentence, over a quiet line, as 8 kHz mu-law."""
    audio, rate = sf.read(DASHWOOD, dtype="float32")
    assert rate == 16000
    rng = np.random.default_rng(0)

    def line(seconds: float) -> np.ndarray:
        return (rng.standard_normal(round(seconds * rate)) * 1e-3).astype(np.float32)

    cut = round(PAUSE_AT_S * rate)
    return to_mulaw_8k_bytes(
        np.concatenate([line(LEAD_S), audio[:cut], line(PAUSE_S), audio[cut:], line(TAIL_S)])
    )


async def call_paced(server: ServerThread, data: bytes, **query: str) -> tuple[Call, list[float]]:
    """One live call sent in 20 ms frames in real time, then CloseStream; and when each frame left."""
    call = Call()
    sent: list[float] = []
    options: dict[str, Any] = {"encoding": "mulaw", "sample_rate": 8000, "channels": 1, **query}
    async with live(server, call, request_options={"additional_query_parameters": options}) as sock:
        start = time.monotonic()
        for n, at in enumerate(range(0, len(data), FRAME)):
            await asyncio.sleep(max(0.0, start + (n + 1) * FRAME / 8000 - time.monotonic()))
            sent.append(time.monotonic())
            await sock.send_media(data[at : at + FRAME])
        await sock.send_close_stream()
    assert call.close_code == 1000, call
    return call, sent


def turn_ends(call: Call) -> list[Any]:
    return [r for r in call.finals if r.speech_final and r.channel.alternatives[0].transcript]


async def test_a_mid_sentence_pause_is_not_a_turn_end_with_endpointing_300(
    door_server: ServerThread, paused_call: bytes
) -> None:
    call, _ = await call_paced(door_server, paused_call, endpointing="300", turn_model="true")
    ends = turn_ends(call)
    assert len(ends) == 1, [(r.start, r.duration, r.channel.alternatives[0].transcript) for r in ends]
    assert ends[0].start + ends[0].duration > LEAD_S + PAUSE_AT_S + PAUSE_S  # the turn ran past the pause
    assert "how much" in call.text().lower(), call.text()


async def test_a_real_end_is_found_sooner_than_a_long_silence_timeout(
    door_server: ServerThread, paused_call: bytes
) -> None:
    """With a 10 s longest wait (Flux's eot_timeout_ms), the pause is held and the complete end is found
    well before it: a speech_final final for the whole sentence arrives while the client is still sending
    the 5 s of silence after it (the end of the audio would end the turn without speech_final)."""
    call, sent = await call_paced(
        door_server, paused_call, endpointing="300", turn_model="true", eot_timeout_ms="10000"
    )
    ends = turn_ends(call)
    assert len(ends) == 1, [(r.start, r.duration) for r in ends]
    true_end_s = LEAD_S + PAUSE_S + LAST_WORD_END_S
    assert ends[0].start + ends[0].duration > true_end_s - 0.3
    arrived = call.arrived[call.messages.index(ends[0])]
    assert arrived < sent[-1], (arrived - sent[int(true_end_s * 8000) // FRAME], "s after the true end")


async def test_turn_model_false_keeps_silence_only_endpointing(
    door_server: ServerThread, paused_call: bytes
) -> None:
    """As before the turn model: endpointing=300 alone ends the turn at the 0.7 s pause."""
    call, _ = await call_paced(door_server, paused_call, endpointing="300", turn_model="false")
    ends = turn_ends(call)
    assert len(ends) == 2, [(r.start, r.duration, r.channel.alternatives[0].transcript) for r in ends]
    assert ends[0].start + ends[0].duration < LEAD_S + PAUSE_AT_S + 0.2
