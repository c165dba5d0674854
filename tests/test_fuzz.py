"""Fuzzing the request stream (hypothesis) against a real loopback server and the real tiny.en.

Random orders of config and audio messages, random bytes, random configs (any enum number, rate, channel
count, language, prompt, endpointing value, NaN included), real speech cut at random places. Whatever
comes, the server answers a valid status (OK or a documented refusal, with a message), says OK when the
input was well-formed, lets go of every fuzzed stream, and keeps serving a live call that talks, at the
pace of speech, through the whole run on another connection.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterator

import grpc
import pytest
from asr.v1 import asr_pb2
from grpc import aio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine
from engine.decoding.prompt import PromptEncoder
from service.config import ServerConfig
from tests.support.audio import make_conversation, to_linear16_bytes
from tests.support.calls import GoodStreamThread, Outcome, Request, run_stream
from tests.support.server import ServerThread

pytestmark = pytest.mark.slow

MAX_CHUNK_BYTES = 4096  # small, so that random chunks cross it
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
EXAMPLES = 100


@functools.cache
def speech_pcm() -> bytes:
    audio, _ = make_conversation(
        ["Thank you for calling, how can I help you today?"], pause_s=0.6, lead_s=0.1
    )
    return to_linear16_bytes(audio)


@st.composite
def speech_chunks(draw: st.DrawFn) -> bytes:
    """A piece of real speech (LINEAR16 16 kHz), cut at a random place, maybe mid-sample."""
    data = speech_pcm()
    start = draw(st.integers(0, len(data) - 1))
    return data[start : start + draw(st.integers(1, 6000))]


durations = st.integers(-(10**10), 10**11)  # nanoseconds, negative to 100 s
thresholds = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def plain_configs(draw: st.DrawFn) -> Request:
    """Mostly valid configs (so that fuzzed audio gets deep into the stream), now and then one bad field."""
    rc = asr_pb2.RecognitionConfig(
        encoding=draw(st.sampled_from([1, 1, 1, 3, 4])),  # type: ignore[arg-type]
        sample_rate_hertz=draw(st.sampled_from([16000, 16000, 8000, 44100])),
        audio_channel_count=draw(st.sampled_from([0, 1, 1, 2])),
        enable_separate_recognition_per_channel=draw(st.booleans()),
        language_code=draw(st.sampled_from(["", "", "en", "en-US"])),
    )
    return Request(
        streaming_config=asr_pb2.StreamingRecognitionConfig(
            config=rc, single_utterance=draw(st.booleans()), interim_results=draw(st.booleans())
        )
    )


@st.composite
def wild_configs(draw: st.DrawFn) -> Request:
    rc = asr_pb2.RecognitionConfig(
        encoding=draw(st.sampled_from([0, 1, 2, 3, 4, 5]) | st.integers(-3, 10**6)),  # type: ignore[arg-type]
        sample_rate_hertz=draw(
            st.sampled_from([0, 8000, 16000, 44100, 48000, 7999, 48001]) | st.integers(-(2**31), 2**31 - 1)
        ),
        audio_channel_count=draw(st.sampled_from([0, 1, 2]) | st.integers(-(2**31), 2**31 - 1)),
        enable_separate_recognition_per_channel=draw(st.booleans()),
        language_code=draw(
            st.sampled_from(["", "en", "en-US", "EN_gb", "de", "xx-YY"]) | st.text(max_size=12)
        ),
        prompt=draw(st.just("") | st.text(max_size=300)),
        enable_segment_time_offsets=draw(st.booleans()),
    )
    sc = asr_pb2.StreamingRecognitionConfig(
        config=rc, single_utterance=draw(st.booleans()), interim_results=draw(st.booleans())
    )
    if draw(st.booleans()):
        ep = sc.endpointing
        ep.speech_start_threshold = draw(thresholds)
        ep.speech_end_threshold = draw(thresholds)
        for name in ("min_silence_duration", "max_utterance_duration", "min_speech_duration"):
            if draw(st.booleans()):
                getattr(ep, name).FromNanoseconds(draw(durations))
    return Request(streaming_config=sc)


audio_messages = st.builds(
    lambda data: Request(audio_content=data),
    st.binary(max_size=2500)
    | speech_chunks()
    | st.just(b"")
    | st.binary(min_size=MAX_CHUNK_BYTES + 1, max_size=MAX_CHUNK_BYTES + 50),
)
request_streams = st.one_of(
    # anything in any order (a config need not come first, may come twice, may never come)
    st.lists(st.one_of(plain_configs(), wild_configs(), audio_messages, st.just(Request())), max_size=10),
    # a config then audio: deeper into the stream
    st.builds(lambda c, a: [c, *a], plain_configs(), st.lists(audio_messages, max_size=10)),
    st.builds(lambda c, a: [c, *a], wild_configs(), st.lists(audio_messages, max_size=10)),
)


def well_formed(requests: list[Request], prompts: PromptEncoder) -> bool:
    """True when the server must answer OK: a plain valid config first, then whole LINEAR16 frames within
    the chunk limit (rate 16 kHz mono, no language the model lacks, default endpointing, a prompt within
    its bounds)."""
    if not requests or requests[0].WhichOneof("streaming_request") != "streaming_config":
        return False
    sc = requests[0].streaming_config
    c = sc.config
    if (
        c.encoding != asr_pb2.LINEAR16
        or c.sample_rate_hertz != 16000
        or c.audio_channel_count not in (0, 1)
        or c.language_code not in ("", "en", "en-US")
        or sc.HasField("endpointing")
    ):
        return False
    try:
        prompts.encode(c.prompt)
    except ValueError:
        return False  # longer than the prompt's bound (docs/operations.md)
    return all(
        r.WhichOneof("streaming_request") == "audio_content"
        and len(r.audio_content) % 2 == 0
        and len(r.audio_content) <= MAX_CHUNK_BYTES
        for r in requests[1:]
    )


@pytest.fixture(scope="module")
def fuzz_server(service_engine: Engine) -> Iterator[ServerThread]:
    server = ServerThread(
        ServerConfig(max_chunk_bytes=MAX_CHUNK_BYTES, max_streams=64), service_engine
    ).start()
    yield server
    server.stop()


def test_fuzzed_request_streams_get_valid_statuses_and_harm_no_one(
    fuzz_server: ServerThread, service_engine: Engine
) -> None:
    good = GoodStreamThread(fuzz_server.target)
    prompts = service_engine.info.prompts
    assert prompts is not None
    talking_done = good.talk()
    seen: dict[str, int] = {}
    started = time.monotonic()

    async def send(requests: list[Request]) -> Outcome:
        async with aio.insecure_channel(fuzz_server.target) as channel:
            return await run_stream(channel, requests, deadline_s=60)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,  # the same examples on every run: CI failures reproduce
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(request_streams)
    def one(requests: list[Request]) -> None:
        outcome = asyncio.run(send(requests))
        seen[outcome.code.name] = seen.get(outcome.code.name, 0) + 1
        assert outcome.code in DOCUMENTED, outcome
        if outcome.code != grpc.StatusCode.OK:
            assert outcome.details, outcome  # a refusal always says why
        if well_formed(requests, prompts):
            assert outcome.code == grpc.StatusCode.OK, (requests[0], outcome)
        # the good stream is the only one left on the server (poll: the fuzzed one's cleanup can trail
        # its status by a moment)
        deadline = time.monotonic() + 5
        while len(fuzz_server.server.recognizer.sessions) > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(fuzz_server.server.recognizer.sessions) == 1

    try:
        one()
        talking_done()
    finally:
        good.close()
    print(f"fuzz: {EXAMPLES} streams in {time.monotonic() - started:.0f} s, statuses {seen}")
    assert len(seen) >= 2, seen  # the examples did reach more than one outcome
    assert service_engine.alive
    deadline = time.monotonic() + 10
    while service_engine.stats()["slots_used"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service_engine.stats()["slots_used"] == 0
    assert not fuzz_server.server.recognizer.sessions
