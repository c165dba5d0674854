"""Call metrics through a real server (asr.v1 on loopback, the real tiny.en and silero VAD): a stereo call
laid out with known talk, silence and overlap (two espeak voices, one per channel, 8 kHz mu-law), streamed
and recognized whole; the last response carries the call's metrics after every final, periodic ones come
every call_metrics_interval of audio, Prometheus gets the shares, bad thresholds are refused.

Tolerances (against the exact metrics of the laid-out speech bounds, as tests/test_call_metrics.py
states them for the endpointer alone): talk 0.3 s per channel, overlap 0.25 s, non-talk 0.4 s,
loudness 1 dB; interruptions exact."""

from __future__ import annotations

import asyncio
import functools
import math
from typing import Any

import grpc
import pytest
from asr.v1 import asr_pb2, asr_pb2_grpc
from google.protobuf.duration_pb2 import Duration
from grpc import aio
from prometheus_client import REGISTRY

from service.pipeline.call_metrics import CallMetricsTracker
from service.vocabulary.call_metrics import CallMetrics
from tests.support.audio import stereo, to_mulaw_8k_bytes
from tests.support.calls import Outcome, audio_requests, run_stream
from tests.support.server import ServerThread
from tests.test_call_metrics import feed_in_report_order
from tests.test_call_metrics import laid_out_call as call_layout

pytestmark = pytest.mark.slow

Request = asr_pb2.StreamingRecognizeRequest
INTERVAL_S = 5


def s(d: Any) -> float:
    return d.seconds + d.nanos / 1e9


@functools.cache
def laid_out_call() -> tuple[bytes, CallMetrics, dict[int, float]]:
    """test_call_metrics' laid out call as stereo mu-law, its exact metrics, and each channel's true
    loudness."""
    laid = call_layout()
    exact = CallMetricsTracker([1, 2])
    feed_in_report_order(exact, laid.truth)
    exact.advance(laid.total_s)
    return to_mulaw_8k_bytes(stereo(laid.agent, laid.customer)), exact.snapshot(), laid.loudness_dbfs


def recognition_config(**fields: Any) -> asr_pb2.RecognitionConfig:
    return asr_pb2.RecognitionConfig(
        encoding=asr_pb2.MULAW,
        sample_rate_hertz=8000,
        audio_channel_count=2,
        enable_separate_recognition_per_channel=True,
        **fields,
    )


def check(m: asr_pb2.CallMetrics, finals: list[Any]) -> None:
    """`m` against the laid-out call's exact metrics; words per minute against the finals' own words."""
    _, exact, loud = laid_out_call()
    assert s(m.total_time) == pytest.approx(exact.total_s, abs=0.01)
    assert [c.channel_tag for c in m.channels] == [1, 2]
    for got, true in zip(m.channels, exact.channels, strict=True):
        assert s(got.talk_time) == pytest.approx(true.talk_s, abs=0.3)
        assert got.mean_loudness_dbfs == pytest.approx(loud[got.channel_tag], abs=1.0)
        # words of the channel's finals per minute of the talk those finals cover
        mine = [f for f in finals if f.channel_tag == got.channel_tag]
        words = sum(len(f.alternatives[0].transcript.split()) for f in mine)
        covered = sum(s(f.end_offset) - s(f.start_offset) for f in mine)
        assert words > 0 and got.words_per_minute == pytest.approx(60 * words / covered, rel=0.01)
    assert s(m.overlap_time) == pytest.approx(exact.overlap_s, abs=0.25)
    assert s(m.non_talk_time) == pytest.approx(exact.non_talk_s, abs=0.4)  # the two 3 s silences
    assert [c.interruptions for c in m.channels] == [0, 1]  # the customer cut in


def share_count(channel: str) -> float:
    return REGISTRY.get_sample_value("asr_call_talk_share_count", {"channel": channel}) or 0.0


@pytest.fixture(scope="module")
def streamed(asr_server: ServerThread) -> Outcome:
    data, _, _ = laid_out_call()
    first = Request(
        streaming_config=asr_pb2.StreamingRecognitionConfig(
            config=recognition_config(), call_metrics_interval=Duration(seconds=INTERVAL_S)
        )
    )

    async def run() -> Outcome:
        async with aio.insecure_channel(asr_server.target) as channel:
            return await run_stream(channel, [first, *audio_requests(data, 1600)], deadline_s=600)

    before = share_count("1"), share_count("2")
    outcome = asyncio.run(run())
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    assert (share_count("1"), share_count("2")) == (before[0] + 1, before[1] + 1), "one observation per call"
    return outcome


def test_the_last_response_carries_the_call_metrics_after_every_final(streamed: Outcome) -> None:
    last = streamed.responses[-1]
    assert last.HasField("call_metrics") and not last.results
    finals = streamed.finals
    assert [f.channel_tag for f in finals].count(1) == 2 and [f.channel_tag for f in finals].count(2) == 2
    print(last.call_metrics)
    check(last.call_metrics, finals)


def test_metrics_so_far_every_interval_while_the_call_runs(streamed: Outcome) -> None:
    _, exact, _ = laid_out_call()
    periodic = [r.call_metrics for r in streamed.responses[:-1] if r.HasField("call_metrics")]
    assert len(periodic) == math.floor(exact.total_s / INTERVAL_S)
    for k, m in enumerate(periodic, start=1):
        # sent once that much audio was heard (the VAD scores it a tick later: within 0.5 s)
        assert k * INTERVAL_S <= s(m.total_time) < k * INTERVAL_S + 0.5, m
        assert [c.channel_tag for c in m.channels] == [1, 2]
    talk = [sum(s(c.talk_time) for c in m.channels) for m in periodic]
    assert talk == sorted(talk) and talk[-1] > 0


async def test_recognize_carries_the_call_metrics(asr_server: ServerThread) -> None:
    data, _, _ = laid_out_call()
    async with aio.insecure_channel(asr_server.target) as channel:
        response = await asr_pb2_grpc.RecognizerStub(channel).Recognize(
            asr_pb2.RecognizeRequest(config=recognition_config(), audio_content=data), timeout=600
        )
    assert response.HasField("call_metrics")
    check(response.call_metrics, list(response.results))


@pytest.mark.parametrize(
    ("config", "interval", "field"),
    [
        (
            asr_pb2.CallMetricsConfig(min_non_talk_duration=Duration(nanos=50_000_000)),
            0,
            "config.call_metrics.min_non_talk_duration",
        ),
        (
            asr_pb2.CallMetricsConfig(min_interruption_overlap=Duration(seconds=11)),
            0,
            "config.call_metrics.min_interruption_overlap",
        ),
        (None, 3601, "call_metrics_interval"),
    ],
)
async def test_bad_thresholds_are_refused_naming_the_field(
    asr_server: ServerThread, config: asr_pb2.CallMetricsConfig | None, interval: int, field: str
) -> None:
    first = Request(
        streaming_config=asr_pb2.StreamingRecognitionConfig(
            config=recognition_config(call_metrics=config), call_metrics_interval=Duration(seconds=interval)
        )
    )
    async with aio.insecure_channel(asr_server.target) as channel:
        outcome = await run_stream(channel, [first])
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert field in outcome.details, outcome.details
