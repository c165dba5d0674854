"""Keyterms through a real server (asr.v1 on loopback, the real tiny.en): RecognitionConfig.keyterms
recalls invented names tiny.en cannot spell, inserts none where nobody says them, leaves real speech
unchanged under an unrelated list; a mid-stream keyterms_update applies from the next utterance, not the
one under way; bad lists are refused INVALID_ARGUMENT naming the field, before any audio (also by a
frontend process, whose engine is in another process)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio

from engine.parameters import MAX_KEYTERM_CHARS, MAX_KEYTERMS
from scripts.keyterm_clips import KEYTERMS, Clip, control_clips, name_clips, real_clips, said, telephone_audio
from tests.support.audio import RATE, silence, speak, speech_bounds, to_linear16_bytes, to_mulaw_8k_bytes
from tests.support.calls import Outcome, audio_requests, run_stream
from tests.support.server import ServerProcess, ServerThread

pytestmark = pytest.mark.slow

Request = asr_pb2.StreamingRecognizeRequest
PAUSE_S = 1.2  # between clips: each is an utterance of its own (500 ms of silence ends one)
# Held-out name clips the bias recovers through the server, and ones it does not (tiny.en alone spells
# none of them); the recall bound below is half of them.
NAMED = [c for c in name_clips("test") if c.term in ("Tavrenko", "Moxilar", "Brenwick", "Kestoria")]
CONTROLS = control_clips()[:3]


def config(keyterms: tuple[str, ...] = (), encoding: int = asr_pb2.MULAW, rate: int = 8000) -> Request:
    return Request(
        streaming_config=asr_pb2.StreamingRecognitionConfig(
            config=asr_pb2.RecognitionConfig(
                encoding=encoding,  # type: ignore[arg-type]
                sample_rate_hertz=rate,
                keyterms=keyterms,
            )
        )
    )


@functools.cache
def espeak_clip(clip: Clip) -> np.ndarray:
    """The clip's sentence, espeak's own silences trimmed (16 kHz float)."""
    audio = speak(clip.text, voice=clip.voice, speed=160)
    start, end = speech_bounds(audio)
    return audio[round(start * RATE) : round(end * RATE)]


def laid_out(parts: list[np.ndarray]) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """The parts one after another with PAUSE_S of silence around each, and where each lies."""
    out, spans, t = [silence(0.3)], [], 0.3
    for p in parts:
        spans.append((t, t + len(p) / RATE))
        out += [p, silence(PAUSE_S)]
        t += len(p) / RATE + PAUSE_S
    return np.concatenate(out), spans


def per_clip(outcome: Outcome, spans: list[tuple[float, float]]) -> list[str]:
    """The finals' text of each clip (finals that start inside its span, padding included)."""
    texts: list[list[str]] = [[] for _ in spans]
    for r in outcome.finals:
        start = r.start_offset.seconds + r.start_offset.nanos / 1e9
        for i, (a, b) in enumerate(spans):
            if a - 0.5 <= start < b:
                texts[i].append(r.alternatives[0].transcript)
    return [" ".join(t) for t in texts]


async def stream(target: str, requests: list[Request]) -> Outcome:
    async with aio.insecure_channel(target) as channel:
        outcome = await run_stream(channel, requests, deadline_s=600)
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    return outcome


@pytest.fixture(scope="module")
def espeak_calls(asr_server: ServerThread) -> dict[str, list[str]]:
    """The name clips and the controls as one telephone call (8 kHz mu-law), with and without the list."""
    audio, spans = laid_out([espeak_clip(c) for c in [*NAMED, *CONTROLS]])
    data = to_mulaw_8k_bytes(audio)

    async def both() -> dict[str, list[str]]:
        plain = await stream(asr_server.target, [config(), *audio_requests(data, 1600)])
        listed = await stream(asr_server.target, [config(KEYTERMS), *audio_requests(data, 1600)])
        return {"plain": per_clip(plain, spans), "listed": per_clip(listed, spans)}

    return asyncio.run(both())


def test_keyterms_recall_invented_names_through_the_server(espeak_calls: dict[str, list[str]]) -> None:
    plain, listed = espeak_calls["plain"][: len(NAMED)], espeak_calls["listed"][: len(NAMED)]
    print("plain", plain, "listed", listed, sep="\n")
    assert not [c.term for c, t in zip(NAMED, plain, strict=True) if said(c.term or "", t)], plain
    recalled = [c.name for c, t in zip(NAMED, listed, strict=True) if said(c.term or "", t)]
    assert len(recalled) >= len(NAMED) // 2, (recalled, listed)


def test_keyterms_insert_no_name_nobody_said(espeak_calls: dict[str, list[str]]) -> None:
    listed = espeak_calls["listed"]
    clips = [*NAMED, *CONTROLS]
    inserted = [
        (c.name, t)
        for c, t in zip(clips, listed, strict=True)
        for k in KEYTERMS
        if said(k, t) and k != c.term
    ]
    assert inserted == [], inserted
    assert all(t.strip() for t in listed), listed  # every clip was heard


async def test_an_unrelated_list_leaves_real_speech_unchanged(asr_server: ServerThread) -> None:
    clips = [real_clips()[0], *real_clips()[6:8]]
    audio, spans = laid_out([telephone_audio(c) for c in clips])
    data = to_linear16_bytes(audio)
    plain = await stream(
        asr_server.target, [config(encoding=asr_pb2.LINEAR16, rate=RATE), *audio_requests(data, 3200)]
    )
    listed = await stream(
        asr_server.target,
        [config(KEYTERMS, encoding=asr_pb2.LINEAR16, rate=RATE), *audio_requests(data, 3200)],
    )
    print(per_clip(plain, spans))
    assert plain.finals and [r.alternatives[0].transcript for r in listed.finals] == [
        r.alternatives[0].transcript for r in plain.finals
    ]


async def test_keyterms_update_applies_from_the_next_utterance(asr_server: ServerThread) -> None:
    """The same name clip twice; the update comes while the first is spoken: the first keeps the list it
    started with (none), the second gets the name."""
    clip = NAMED[RECALLED_INDEX]
    speech = to_mulaw_8k_bytes(espeak_clip(clip))
    pause = to_mulaw_8k_bytes(silence(PAUSE_S))
    half = len(speech) // 2
    requests = [
        config(),
        *audio_requests(pause + speech[:half], 1600),
        Request(keyterms_update=asr_pb2.KeytermsUpdate(keyterms=KEYTERMS)),
        *audio_requests(speech[half:] + pause + speech + pause, 1600),
    ]
    outcome = await stream(asr_server.target, requests)
    finals = [r.alternatives[0].transcript for r in outcome.finals]
    print(finals)
    assert len(finals) == 2, finals
    assert not said(clip.term or "", finals[0]) and said(clip.term or "", finals[1]), finals


async def test_an_empty_update_clears_the_list(asr_server: ServerThread) -> None:
    clip = NAMED[RECALLED_INDEX]
    speech = to_mulaw_8k_bytes(espeak_clip(clip))
    pause = to_mulaw_8k_bytes(silence(PAUSE_S))
    requests = [
        config(KEYTERMS),
        *audio_requests(pause + speech + pause, 1600),
        Request(keyterms_update=asr_pb2.KeytermsUpdate(keyterms=[])),
        *audio_requests(speech + pause, 1600),
    ]
    finals = [r.alternatives[0].transcript for r in (await stream(asr_server.target, requests)).finals]
    print(finals)
    assert len(finals) == 2, finals
    assert said(clip.term or "", finals[0]) and not said(clip.term or "", finals[1]), finals


# The first of NAMED that the list recalls in test_keyterms_recall_invented_names_through_the_server.
RECALLED_INDEX = 0

BAD_LISTS: list[tuple[Any, str]] = [
    ([f"Name{i}" for i in range(MAX_KEYTERMS + 1)], f"at most {MAX_KEYTERMS}"),
    (["Kestoria", ""], r"keyterms[1] is empty"),
    (["x" * (MAX_KEYTERM_CHARS + 1)], f"at most {MAX_KEYTERM_CHARS} per keyterm"),
    (["a.b.c.d.e.f.g.h.i"], "tokens per keyterm"),
]


@pytest.mark.parametrize(("keyterms", "message"), BAD_LISTS)
async def test_bad_keyterm_lists_are_refused_naming_config_keyterms(
    asr_server: ServerThread, keyterms: list[str], message: str
) -> None:
    async with aio.insecure_channel(asr_server.target) as channel:
        outcome = await run_stream(channel, [config(tuple(keyterms))])
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert "config.keyterms" in outcome.details and message in outcome.details, outcome.details


async def test_a_frontend_process_refuses_a_term_too_many_tokens_before_any_audio(
    server_process: ServerProcess,
) -> None:
    """The token bound needs the tokenizer; a frontend's engine is in another process, so the frontend
    checks it itself (with ModelInfo.prompts): refused at once, not at the first utterance."""
    async with aio.insecure_channel(server_process.target) as channel:
        outcome = await run_stream(channel, [config(("a.b.c.d.e.f.g.h.i",))])
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert "config.keyterms[0]" in outcome.details and "tokens per keyterm" in outcome.details, (
        outcome.details
    )


@pytest.mark.parametrize(("keyterms", "message"), BAD_LISTS[:2])
async def test_a_bad_update_is_refused_naming_keyterms_update(
    asr_server: ServerThread, keyterms: list[str], message: str
) -> None:
    async def requests() -> AsyncIterator[Request]:
        yield config(KEYTERMS)
        for r in audio_requests(to_mulaw_8k_bytes(silence(0.5)), 1600):
            yield r
        yield Request(keyterms_update=asr_pb2.KeytermsUpdate(keyterms=keyterms))

    async with aio.insecure_channel(asr_server.target) as channel:
        outcome = await run_stream(channel, requests())
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert "keyterms_update.keyterms" in outcome.details and message in outcome.details, outcome.details


async def test_recognize_takes_keyterms_too(asr_server: ServerThread) -> None:
    clip = NAMED[RECALLED_INDEX]
    pause = to_mulaw_8k_bytes(silence(PAUSE_S))
    data = pause + to_mulaw_8k_bytes(espeak_clip(clip)) + pause

    async def text(keyterms: tuple[str, ...]) -> str:
        config = asr_pb2.RecognitionConfig(encoding=asr_pb2.MULAW, sample_rate_hertz=8000, keyterms=keyterms)
        async with aio.insecure_channel(asr_server.target) as channel:
            response = await asr_pb2_grpc.RecognizerStub(channel).Recognize(
                asr_pb2.RecognizeRequest(config=config, audio_content=data), timeout=300
            )
        return " ".join(r.alternatives[0].transcript for r in response.results)

    plain, listed = await text(()), await text(KEYTERMS)
    assert not said(clip.term or "", plain) and said(clip.term or "", listed), (plain, listed)
