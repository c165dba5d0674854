"""Context carried across a channel's utterances (service/pipeline/context.py): what a final adds, the
safeguards that keep a looping or doubtful final out, and, through a real server, that a channel's text
reaches only that channel's later utterances of the same call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
from asr.v1 import asr_pb2
from grpc import aio

from engine.api import Transcript
from engine.hooks import EngineHooks
from engine.outputs import UtteranceStats
from engine.scheduling.request import Request as EngineRequest
from service.pipeline.context import ChannelContext, compression_ratio
from tests.support.audio import make_conversation, silence, stereo, to_linear16_bytes
from tests.support.calls import Outcome, Request, audio_requests, config_request, run_stream
from tests.support.server import ServerThread


def final(text: str, avg_logprob: float = -0.2, no_speech_prob: float = 0.01) -> Transcript:
    stats = UtteranceStats(audio_s=1.0, queue_wait_s=0.0, encoder_batch_size=1, decode_steps=5, latency_s=0.1)
    return Transcript(text, (1, 2), avg_logprob, no_speech_prob, "en", (), True, stats)


def words_tail(text: str, n: int) -> str:
    """A tokenizer stand-in: one token per word."""
    return " ".join(text.split()[-n:])


def test_finals_join_the_context_and_only_the_newest_tokens_are_kept() -> None:
    ctx = ChannelContext(6, words_tail)
    assert ctx.value is None
    ctx.final(final(" Hello, this is Anna."))
    assert ctx.value == "Hello, this is Anna."
    ctx.final(final("I am calling about my order."))
    assert ctx.value == "Anna. I am calling about my order."[len("Anna. ") :]  # the last 6 words
    off = ChannelContext(0, words_tail)
    off.final(final("Hello."))
    assert off.value is None


@pytest.mark.parametrize(
    ("why", "doubtful"),
    [
        ("looped", final("I can't hear you. " + "I can't hear you, " * 12)),
        ("unsure", final("Ballroom fan seat", avg_logprob=-1.4)),
        ("non-speech", final("Thank you.", no_speech_prob=0.8)),
    ],
)
def test_a_looping_or_doubtful_final_is_not_carried_and_clears_the_context(
    why: str, doubtful: Transcript
) -> None:
    ctx = ChannelContext(64, words_tail)
    ctx.final(final("I would like to pay my bill."))
    assert ctx.value == "I would like to pay my bill."
    ctx.final(doubtful)
    assert ctx.value is None, why  # Whisper resets its prompt after such a window
    ctx.final(final("My account number is seven."))
    assert ctx.value == "My account number is seven."


def test_an_utterance_that_continues_speech_cut_at_the_length_bound_gets_no_context() -> None:
    """Cut mid-speech (the endpointer's max utterance length), the next piece begins inside a word or a
    sentence: with the earlier text as prompt tiny.en made up words to join the two (docs/benchmarks.md
    "Context across a channel's utterances": 27.7% WER with it, 14.3% without it there, 22.3% with none
    carried at all)."""
    ctx = ChannelContext(64, words_tail)
    ctx.final(final("I would like to pay my bill."))
    ctx.submitted(forced_cut=True)  # this utterance was cut while speech went on
    assert ctx.value is None
    ctx.final(final("and the one from March"))  # its text is still carried past the next utterance
    ctx.submitted(forced_cut=False)
    assert ctx.value == "I would like to pay my bill. and the one from March"


def test_the_loop_measure_is_whispers_compression_ratio() -> None:
    assert compression_ratio("I can't hear you. " + "I can't hear you, " * 12) > 2.4
    assert compression_ratio("I would like to pay my bill, please, before Friday.") < 2.4


# --- through a real server ---

CUSTOMER = ["My parcel from Denver never arrived.", "The tracking number ends in seven."]
AGENT = ["I am sorry to hear that.", "Let me look it up for you."]


def _phases() -> tuple[bytes, bytes]:
    """A two-channel call in two phases: each side's first sentence, then each side's second; each
    sentence alone on its channel (the other silent), with room for its final between them."""
    first, second = [], []
    for turns, out in ((0, first), (1, second)):
        agent, _ = make_conversation([AGENT[turns]], pause_s=1.2, lead_s=0.3)
        customer, _ = make_conversation([CUSTOMER[turns]], pause_s=1.2, lead_s=0.3)
        out.append(
            stereo(
                np.concatenate([agent, silence(len(customer) / 16000)]),
                np.concatenate([silence(len(agent) / 16000), customer]),
            )
        )
    return to_linear16_bytes(first[0]), to_linear16_bytes(second[0])


async def _call(server: ServerThread, first: bytes, second: bytes, **config: object) -> Outcome:
    """Phase one, then phase two once phase one's two finals are back (so they can be carried)."""
    finals = asyncio.Event()
    seen: list[int] = []

    def on_response(response: asr_pb2.StreamingRecognizeResponse) -> None:
        seen.extend(1 for r in response.results if r.is_final)
        if len(seen) >= 2:
            finals.set()

    async def requests() -> AsyncIterator[Request]:
        yield config_request(audio_channel_count=2, enable_separate_recognition_per_channel=True, **config)
        for r in audio_requests(first, 6400):
            yield r
        await asyncio.wait_for(finals.wait(), 60)
        for r in audio_requests(second, 6400):
            yield r

    async with aio.insecure_channel(server.target) as channel:
        return await run_stream(channel, requests(), on_response=on_response)


def test_a_channels_context_reaches_only_its_own_later_utterances_of_the_same_call(
    asr_server: ServerThread, engine_hooks: EngineHooks
) -> None:
    """Two two-channel calls, one after the other, through asr.v1: each channel's second utterance is
    conditioned on its own first final and nothing else; no call's first utterances see the call
    before; a stream that leaves context_carry to the server (off by default) sends none."""
    first, second = _phases()
    submitted: list[EngineRequest] = []
    with engine_hooks.installed(enqueue=submitted.append):
        calls = [asyncio.run(_call(asr_server, first, second, context_carry=True)) for _ in range(2)]
        off = asyncio.run(_call(asr_server, first, second))
    for outcome in (*calls, off):
        assert outcome.code.name == "OK", outcome.details
        assert len(outcome.finals) == 4, [r.alternatives[0].transcript for r in outcome.finals]

    by_stream: dict[str, list[tuple[int, int, EngineRequest]]] = {}
    for r in submitted:
        parts = r.id.split("-")
        if parts[-1].startswith("spec"):  # a speculative offer: "<stream>-<tag>-<index>-spec<n>"
            parts = parts[:-1]
        by_stream.setdefault("-".join(parts[:-2]), []).append((int(parts[-2]), int(parts[-1]), r))
    assert len(by_stream) == 3, list(by_stream)
    carried = 0
    for reqs, outcome in zip(by_stream.values(), (*calls, off), strict=True):
        said = {
            (f.channel_tag, f.utterance_index): f.alternatives[0].transcript.strip() for f in outcome.finals
        }
        for tag, index, r in reqs:
            if index == 0 or outcome is off:
                assert r.options.context is None, (r.id, r.options.context)
                continue
            # its own channel's first final, never the other channel's
            assert r.options.context == said[(tag, 0)], (r.id, r.options.context, said)
            assert said[(3 - tag, 0)] not in r.options.context
            carried += 1
    assert carried >= 4  # each channel's second utterance, in each of the two carrying calls
