"""The core's voice activity timeouts (StreamSettings.speech_start_timeout_s / speech_end_timeout_s, the
SpeechTimeout event), driven as a door drives the core, on the real tiny.en: the clock is the audio the
VAD has scored, every channel must be quiet, and the finals of what ended still come. The Google door's
suite (tests/test_door_google.py) proves them through SpeechClient."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine import Engine
from service.config import ServerConfig
from service.recognizer.recognizer import Recognizer
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import (
    AudioFormat,
    CallEvent,
    RecognitionSettings,
    Result,
    SpeechEnded,
    SpeechTimeout,
    StreamSettings,
)
from tests.support.audio import RATE, silence, speak, speech_bounds, stereo, to_linear16_bytes

pytestmark = pytest.mark.slow


async def test_end_timeout_waits_for_every_channel_to_be_quiet(service_engine: Engine) -> None:
    """Channel 2 answers 0.6 s after channel 1's speech ends: a 1 s end timeout runs from channel 2's
    end, not channel 1's, and both channels' finals come before the stream ends."""
    agent, customer = speak("Thank you for calling."), speak("I would like to check my order.")
    _, agent_end = speech_bounds(agent)
    left = np.concatenate([silence(0.5), agent])
    right = np.concatenate([silence(0.5 + agent_end + 0.6), customer, silence(4.0)])
    data = to_linear16_bytes(stereo(left, right))
    settings = StreamSettings(
        RecognitionSettings(AudioFormat("LINEAR16", RATE, 2), separate_channels=True),
        speech_end_timeout_s=1.0,
    )
    stream = Recognizer(ServerConfig(), service_engine).open_stream(settings, door="test")
    events: list[CallEvent] = []
    try:
        for i in range(0, len(data), 1280):  # 20 ms of two channels
            stream.audio(data[i : i + 1280])
        async with asyncio.timeout(120):
            async for event in stream.events():  # ends without a finish(): the timeout ended the input
                events.append(event)
    finally:
        await stream.close()
    (timeout,) = [e for e in events if isinstance(e, SpeechTimeout)]
    last_end = max(e.offset_s for e in events if isinstance(e, SpeechEnded) and e.channel == 2)
    assert timeout.offset_s == pytest.approx(last_end + 1.0)
    assert timeout.offset_s < len(right) / RATE - 2.0, "the rest of the audio was not waited for"
    assert {e.channel for e in events if isinstance(e, Result) and e.is_final} == {1, 2}


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        (StreamSettings(endpointing=None, speech_start_timeout_s=1.0), "speech_start_timeout"),
        (StreamSettings(speech_end_timeout_s=0.0), "speech_end_timeout"),
    ],
)
def test_a_timeout_without_endpointing_or_not_positive_is_refused_naming_it(
    service_engine: Engine, settings: StreamSettings, field: str
) -> None:
    format_ = RecognitionSettings(AudioFormat("LINEAR16", RATE))
    settings = StreamSettings(
        format_,
        endpointing=settings.endpointing,
        speech_start_timeout_s=settings.speech_start_timeout_s,
        speech_end_timeout_s=settings.speech_end_timeout_s,
    )
    with pytest.raises(RecognitionError) as refused:
        Recognizer(ServerConfig(), service_engine).open_stream(settings, door="test")
    assert (refused.value.code, refused.value.field) == (Code.INVALID_ARGUMENT, field)
    assert field in refused.value.message
