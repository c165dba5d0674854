"""A two-channel call whose one channel is refused still gets every final of the other (issue 19,
scenario 10), through asr-server with its engine in its own process (where a refusal arrives on the
utterance's future, after the stream has moved on)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc
import numpy as np
import pytest
from asr.v1 import asr_pb2
from grpc import aio

from tests.support.audio import make_conversation, silence, stereo, to_linear16_bytes
from tests.support.calls import Outcome, Request, audio_requests, config_request, run_stream
from tests.support.server import ServerProcess

pytestmark = pytest.mark.slow

# Each ends in a digit run: a redacting channel holds such a final back until its next one (or the end).
CUSTOMER = ["My account number is four one one.", "The code is five five five."]
AGENT = ["Thank you, one moment please."]
FIRST_TAKEN_S = 1.5  # well within the first utterance's 5 s encoder pass


@pytest.fixture(scope="module")
def slow_server() -> Iterator[ServerProcess]:
    """Every encoder pass 5 s longer and room for one live final waiting: while the first utterance is
    encoded, the second waits and the third is refused."""
    server = ServerProcess(
        *("--max-queue", "1", "--debug-slow-encoder-s", "5", "--frontends", "1"),
        *("--speculative-endpointing", "off"),
    ).wait_serving()
    yield server
    server.stop()


def test_a_refusal_on_one_channel_sends_every_final_of_the_other_first(slow_server: ServerProcess) -> None:
    """Customer (channel 2) speaks twice, then the agent (channel 1) once, sent at once: the customer's
    first is encoded, the second waits, the agent's is refused. Both customer finals (each held back by
    PCI redaction, as they end in digits) are sent, then the stream ends RESOURCE_EXHAUSTED."""
    customer, bounds = make_conversation(CUSTOMER, pause_s=0.8, lead_s=0.3)
    agent, _ = make_conversation(AGENT, pause_s=0.8, lead_s=0.0)
    agent_lead = silence(bounds[-1][1] + 1.5)  # the agent speaks once the customer is done
    audio = stereo(np.concatenate([agent_lead, agent]), customer)
    config = config_request(
        audio_channel_count=2, enable_separate_recognition_per_channel=True, redact=[asr_pb2.PCI]
    )

    data = to_linear16_bytes(audio)
    # Up to where the customer's second sentence starts (the first's pause, past --min-silence, is in it),
    # then a wait: the engine takes the first utterance out of its one-place queue before the rest comes.
    # Sent in one burst, the first two can reach a loaded engine together, and the second is refused.
    split = round(bounds[1][0] * 16000) * 4  # 16-bit stereo frames

    async def requests() -> AsyncIterator[Request]:
        yield config
        for r in audio_requests(data[:split], 6400):
            yield r
        await asyncio.sleep(FIRST_TAKEN_S)
        for r in audio_requests(data[split:], 6400):
            yield r

    async def call() -> Outcome:
        async with aio.insecure_channel(slow_server.target) as channel:
            return await run_stream(channel, requests())

    outcome = asyncio.run(call())
    assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, outcome
    assert "--max-queue" in outcome.details
    finals = [(r.channel_tag, r.utterance_index) for r in outcome.finals]
    said = [(r.channel_tag, r.utterance_index, r.alternatives[0].transcript) for r in outcome.finals]
    assert finals == [(2, 0), (2, 1)], (said, outcome.details)
