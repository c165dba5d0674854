"""formatting: SMART through a real server (asr.v1 on loopback, the real tiny.en, espeak speech as 8 kHz
mu-law): spoken digits, amounts and dates come out as digits in the finals' transcripts and words, each
merged word spanning the words it was spoken as; redaction runs after it (a card read out as words comes
out [PCI], its span the card's time); Recognize formats the same; a bad value is refused."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from asr.v1 import asr_pb2
from grpc import aio

from tests.support.audio import RATE, silence, speak, speech_bounds, to_mulaw_8k_bytes
from tests.support.calls import Outcome, audio_requests, run_stream
from tests.support.server import ServerThread

pytestmark = pytest.mark.slow

Request = asr_pb2.StreamingRecognizeRequest
PAUSE_S = 1.2
# (sentence, voice, words per minute, what tiny.en spells out, what SMART writes): clips of
# tests/test_formatting.py's ENGINE_CASES where tiny.en spells the number out (None: nothing to rewrite).
CASES = [
    ("The order number is one two three four five six.", "en-gb", 160, "one two three four five six", "123456"),
    ("I paid one hundred dollars.", "en-us", 120, "one hundred dollars", "$100"),
    ("It expired on the third of March.", "en-us", 120, "third", "3rd"),
    ("One of the agents will call you.", "en-gb-x-rp", 160, None, None),
]  # fmt: skip
# a card's 16 digits read out; tiny.en writes this one as words (most it writes as digits itself)
CARD = ("The number is one two three four five six, four five three two, zero one five one.", "en-gb", 160)


def seconds(d: object) -> float:
    return d.seconds + d.nanos / 1e9  # type: ignore[attr-defined]


def call_audio(clips: list[tuple[str, str, int]]) -> bytes:
    parts = [silence(0.3)]
    for text, voice, speed in clips:
        audio = speak(text, voice=voice, speed=speed)
        start, end = speech_bounds(audio)
        parts += [audio[round(start * RATE) : round(end * RATE)], silence(PAUSE_S)]
    return to_mulaw_8k_bytes(np.concatenate(parts))


def config(formatting: int, redact: tuple[int, ...] = ()) -> asr_pb2.RecognitionConfig:
    return asr_pb2.RecognitionConfig(
        encoding=asr_pb2.MULAW,
        sample_rate_hertz=8000,
        enable_word_time_offsets=True,
        enable_word_confidence=True,
        formatting=formatting,  # type: ignore[arg-type]
        redact=redact,  # type: ignore[arg-type]
    )


async def stream(target: str, data: bytes, formatting: int, redact: tuple[int, ...] = ()) -> Outcome:
    first = Request(streaming_config=asr_pb2.StreamingRecognitionConfig(config=config(formatting, redact)))
    async with aio.insecure_channel(target) as channel:
        outcome = await run_stream(channel, [first, *audio_requests(data, 1600)], deadline_s=600)
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    return outcome


@pytest.fixture(scope="module")
def calls(asr_server: ServerThread) -> dict[str, Outcome]:
    import asyncio

    data = call_audio([c[:3] for c in CASES])

    async def both() -> dict[str, Outcome]:
        return {
            "verbatim": await stream(asr_server.target, data, asr_pb2.VERBATIM),
            "smart": await stream(asr_server.target, data, asr_pb2.SMART),
        }

    return asyncio.run(both())


def test_smart_writes_spoken_numbers_as_digits_in_finals(calls: dict[str, Outcome]) -> None:
    verbatim = [r.alternatives[0] for r in calls["verbatim"].finals]
    smart = [r.alternatives[0] for r in calls["smart"].finals]
    print([a.transcript for a in verbatim], [a.transcript for a in smart], sep="\n")
    assert len(verbatim) == len(smart) == len(CASES)
    for (_, _, _, spelled, digits), plain, formatted in zip(CASES, verbatim, smart, strict=True):
        if spelled is None or digits is None:
            assert formatted.transcript == plain.transcript
            assert [w.word for w in formatted.words] == [w.word for w in plain.words]
            continue
        assert spelled in plain.transcript, f"tiny.en no longer spells this out: {plain.transcript!r}"
        assert formatted.transcript == plain.transcript.replace(spelled, digits, 1)
        # the words spell the transcript, and the merged one spans the words it was spoken as
        assert " ".join(w.word for w in formatted.words) == formatted.transcript
        first = len(plain.transcript[: plain.transcript.index(spelled)].split())
        span = plain.words[first : first + len(spelled.split())]
        merged = formatted.words[first]
        assert digits in merged.word
        assert seconds(merged.start_offset) == seconds(span[0].start_offset)
        assert seconds(merged.end_offset) == seconds(span[-1].end_offset)
        assert merged.confidence == pytest.approx(min(w.confidence for w in span))
        after = len(span) - 1  # the words after the number keep their times
        assert [seconds(w.start_offset) for w in formatted.words[first + 1 :]] == [
            seconds(w.start_offset) for w in plain.words[first + 1 + after :]
        ]


async def test_redaction_after_smart_masks_a_card_read_out_as_words(asr_server: ServerThread) -> None:
    data = call_audio([CARD])
    plain = (await stream(asr_server.target, data, asr_pb2.VERBATIM)).finals
    smart = (await stream(asr_server.target, data, asr_pb2.SMART, (asr_pb2.PCI,))).finals
    print(plain[0].alternatives[0].transcript, smart[0].alternatives[0].transcript)
    assert len(plain) == len(smart) == 1
    words, masked = plain[0].alternatives[0].words, smart[0].alternatives[0]
    assert "[PCI]" in masked.transcript and not any(c.isdigit() for c in masked.transcript), masked.transcript
    print([w.word for w in words], [w.word for w in masked.words])
    pci = next(w for w in masked.words if w.word.startswith("[PCI]"))
    # the card's words in the unformatted final: those after "number", to the end
    assert "one two three" in plain[0].alternatives[0].transcript, "tiny.en no longer spells the card out"
    card = words[next(i for i, w in enumerate(words) if w.word == "number") + 1 :]
    assert seconds(pci.start_offset) == seconds(card[0].start_offset)
    assert seconds(pci.end_offset) == seconds(card[-1].end_offset)


async def test_recognize_formats_too(asr_server: ServerThread) -> None:
    text, voice, speed, _, digits = CASES[0]
    data = call_audio([(text, voice, speed)])
    async with aio.insecure_channel(asr_server.target) as channel:
        from asr.v1 import asr_pb2_grpc

        stub = asr_pb2_grpc.RecognizerStub(channel)
        response = await stub.Recognize(
            asr_pb2.RecognizeRequest(config=config(asr_pb2.SMART), audio_content=data), timeout=300
        )
    assert digits is not None and digits in response.results[0].alternatives[0].transcript, response


async def test_an_unknown_formatting_is_refused(asr_server: ServerThread) -> None:
    first = Request(streaming_config=asr_pb2.StreamingRecognitionConfig(config=config(7)))
    async with aio.insecure_channel(asr_server.target) as channel:
        outcome = await run_stream(channel, [first])
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert "config.formatting" in outcome.details, outcome.details
