"""service.pipeline.call_metrics: exact figures on laid-out timelines, the incremental tracker against a plain
reference on random calls, and a real stereo call (two espeak voices) cut by the real Endpointer."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np
import pytest
from asr.v1 import asr_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.pipeline.audio import StreamDecoder
from service.pipeline.call_metrics import CallMetricsTracker
from service.pipeline.endpointing import Endpointer, Utterance
from service.vocabulary.call_metrics import (
    CallMetrics,
    CallMetricsError,
    CallMetricsSettings,
    ChannelMetrics,
    validate_interval,
)
from tests.support.audio import RATE, silence, speak, speech_bounds, stereo, to_mulaw_8k_bytes

Timeline = dict[int, list[tuple[float, float]]]


def feed_in_report_order(tracker: CallMetricsTracker, timeline: Timeline, delay_s: float = 0.5) -> None:
    """As a stream reports them: each segment once its end plus the endpointer's silence has passed."""
    reports = sorted(
        (end + delay_s, tag, start, end) for tag, segs in timeline.items() for start, end in segs
    )
    for at, tag, start, end in reports:
        tracker.advance(at)
        tracker.speech(tag, start, end)


def channel(m: CallMetrics, tag: int) -> ChannelMetrics:
    return next(c for c in m.channels if c.channel_tag == tag)


# ch1 speaks 1-5, 9-12, 16-17; ch2 4.5-7 (0.5 s under ch1: no interruption), 10-14 (2 s under ch1:
# an interruption by ch2). Silences: 0-1 (1 s, under 2 s), 7-9 (2 s), 14-16 (2 s), 17-20 (3 s).
CALL: Timeline = {1: [(1.0, 5.0), (9.0, 12.0), (16.0, 17.0)], 2: [(4.5, 7.0), (10.0, 14.0)]}


def test_laid_out_call_is_exact() -> None:
    tracker = CallMetricsTracker([1, 2])
    feed_in_report_order(tracker, CALL)
    tracker.advance(20.0)
    m = tracker.snapshot()
    assert m.total_s == 20.0
    assert channel(m, 1).talk_s == pytest.approx(8.0)
    assert channel(m, 2).talk_s == pytest.approx(6.5)
    assert m.overlap_s == pytest.approx(2.5)
    assert m.non_talk_s == pytest.approx(7.0)
    assert [c.interruptions for c in m.channels] == [0, 1]
    assert m.non_talk_share == pytest.approx(7.0 / 20.0)
    assert m.talk_share(1) == pytest.approx(8.0 / 20.0)


def test_snapshots_while_the_call_runs() -> None:
    tracker = CallMetricsTracker([1, 2])
    tracker.advance(3.0)
    tracker.speech_started(1, 1.0)  # ch1 is speaking: counts up to the clock
    m = tracker.snapshot()
    assert (channel(m, 1).talk_s, m.total_s, m.non_talk_s) == (pytest.approx(2.0), 3.0, 0.0)
    tracker.advance(5.5)
    tracker.speech(1, 1.0, 5.0)
    tracker.speech_started(2, 4.5)
    tracker.advance(6.0)
    m = tracker.snapshot()  # ch2 under ch1 for 0.5 s only: no interruption
    assert (channel(m, 2).talk_s, m.overlap_s, channel(m, 2).interruptions) == (pytest.approx(1.5), 0.5, 0)
    tracker.advance(8.5)
    tracker.speech(2, 4.5, 7.0)
    m = tracker.snapshot()  # a silence going on counts once it is 2 s long: 7-8.5 is not yet
    assert m.non_talk_s == 0.0
    tracker.advance(9.5)
    assert tracker.snapshot().non_talk_s == pytest.approx(2.5)


def test_interruption_threshold_and_who_interrupts() -> None:
    def interruptions(a: tuple[float, float], b: tuple[float, float], **kw: float) -> list[int]:
        tracker = CallMetricsTracker([1, 2], CallMetricsSettings(**kw))
        feed_in_report_order(tracker, {1: [a], 2: [b]})
        return [c.interruptions for c in tracker.snapshot().channels]

    assert interruptions((0.0, 5.0), (2.0, 3.0)) == [0, 1]  # exactly 1 s together: counts
    assert interruptions((0.0, 5.0), (2.0, 2.99)) == [0, 0]  # a backchannel under ch1
    assert interruptions((0.0, 2.5), (2.0, 6.0)) == [0, 0]  # ch1 stopped half a second in
    assert interruptions((3.0, 6.0), (1.0, 4.5)) == [1, 0]  # ch1 starts second: ch1 interrupts
    assert interruptions((1.0, 4.0), (1.0, 4.0)) == [0, 0]  # both at once: nobody interrupts
    assert interruptions((0.0, 5.0), (2.0, 2.6), min_interruption_overlap_s=0.5) == [0, 1]


def test_three_channels_overlap_counts_once() -> None:
    tracker = CallMetricsTracker([1, 2, 3], CallMetricsSettings(min_non_talk_s=0.5))
    feed_in_report_order(tracker, {1: [(0.0, 4.0)], 2: [(1.0, 3.0)], 3: [(2.0, 6.0)]})
    tracker.advance(7.0)
    m = tracker.snapshot()
    assert m.overlap_s == pytest.approx(3.0)  # 1-4: two or three speak
    assert m.non_talk_s == pytest.approx(1.0)  # 6-7
    assert [c.interruptions for c in m.channels] == [0, 1, 1]  # ch3 started under ch1 and ch2


def test_forced_cut_continuation_is_no_new_start() -> None:
    """ch1's long turn is cut at 15 s by the endpointer and goes on; ch2 speaks 14.9-17 under it: the
    overlap runs across the cut (2.1 s), and ch1's continuation at 15 s is no interruption of ch2."""
    tracker = CallMetricsTracker([1, 2])
    tracker.advance(15.0)
    tracker.speech(1, 0.0, 15.0)  # the forced cut...
    tracker.speech_started(1, 15.0)  # ...and the speech goes on
    tracker.advance(17.5)
    tracker.speech(2, 14.9, 17.0)
    tracker.advance(25.0)
    assert [c.interruptions for c in tracker.snapshot().channels] == [0, 1]
    tracker.speech(1, 15.0, 24.0)
    tracker.advance(30.0)
    m = tracker.snapshot()
    assert [c.interruptions for c in m.channels] == [0, 1]
    assert channel(m, 1).talk_s == pytest.approx(24.0)
    assert m.overlap_s == pytest.approx(2.1)


def test_continuation_reported_later_still_decides_the_interruption() -> None:
    """Without speech_started after the cut: ch2's start at 14.9 overlaps ch1 by only 0.1 s until ch1's
    continuation arrives, so it waits undecided instead of being counted out."""
    tracker = CallMetricsTracker([1, 2])
    tracker.advance(15.5)
    tracker.speech(1, 0.0, 15.0)
    tracker.advance(17.5)
    tracker.speech(2, 14.9, 17.0)
    tracker.advance(24.5)
    tracker.speech(1, 15.0, 24.0)
    tracker.advance(100.0)  # far past the report lag: everything settled
    m = tracker.snapshot()
    assert [c.interruptions for c in m.channels] == [0, 1]
    assert m.non_talk_s == pytest.approx(76.0)


def test_words_per_minute_over_the_talk_its_finals_cover() -> None:
    tracker = CallMetricsTracker([1, 2])
    tracker.speech(1, 0.0, 6.0)
    tracker.final(1, 0.0, 6.0, words=15)
    tracker.speech_started(1, 8.0)  # being recognised: not in the words per minute yet
    tracker.advance(20.0)
    m = tracker.snapshot()
    assert channel(m, 1).words_per_minute == pytest.approx(150.0)
    assert (channel(m, 1).words, channel(m, 1).talk_s) == (15, pytest.approx(18.0))
    assert channel(m, 2).words_per_minute == 0.0
    tracker.speech(1, 8.0, 11.0)
    tracker.final(1, 8.0, 11.0, words=0)  # noise the engine dropped: its talk still counts
    assert channel(tracker.snapshot(), 1).words_per_minute == pytest.approx(100.0)


def test_mean_loudness_is_rms_dbfs_over_speech_samples() -> None:
    t = np.arange(RATE) / RATE
    tracker = CallMetricsTracker([1, 2])
    tracker.loudness(1, np.sin(2 * np.pi * 440 * t))  # full-scale sine
    tracker.loudness(2, np.where(np.sin(2 * np.pi * 50 * t) >= 0, 0.1, -0.1))  # a 0.1 square wave
    m = tracker.snapshot()
    assert channel(m, 1).mean_loudness_dbfs == pytest.approx(-3.0103, abs=1e-3)
    assert channel(m, 2).mean_loudness_dbfs == pytest.approx(-20.0, abs=0.01)
    # an energy mean: one second at -3 dBFS and one at -23 dBFS is -6.0 dBFS, not their mean of -13
    tracker.loudness(1, 0.1 * np.sin(2 * np.pi * 440 * t))
    expected = 10 * math.log10((0.5 + 0.005) / 2)
    assert channel(tracker.snapshot(), 1).mean_loudness_dbfs == pytest.approx(expected, abs=1e-3)
    assert channel(CallMetricsTracker([0]).snapshot(), 0).mean_loudness_dbfs is None


def test_periodic_messages_every_interval_of_audio() -> None:
    tracker = CallMetricsTracker([0], interval_s=10.0)
    due = [t for t in np.arange(0.5, 35.0, 0.5) if tracker.advance(float(t)) is not None]
    assert due == [10.0, 20.0, 30.0]
    assert tracker.advance(75.0) is not None  # a jump over several intervals: one message
    assert tracker.advance(79.0) is None
    assert tracker.advance(80.0) is not None
    assert CallMetricsTracker([0]).advance(1000.0) is None  # no interval: only the last message


def test_settings_defaults_and_bounds_name_the_field() -> None:
    assert CallMetricsSettings.from_overrides() == CallMetricsSettings(2.0, 1.0)
    assert CallMetricsSettings.from_overrides(5.0, 0.5) == CallMetricsSettings(5.0, 0.5)
    cases = [
        ({"min_non_talk_s": 0.05}, "config.call_metrics.min_non_talk_duration"),
        ({"min_non_talk_s": 61.0}, "config.call_metrics.min_non_talk_duration"),
        ({"min_non_talk_s": math.nan}, "config.call_metrics.min_non_talk_duration"),
        ({"min_interruption_overlap_s": 11.0}, "config.call_metrics.min_interruption_overlap"),
        ({"min_interruption_overlap_s": -1.0}, "config.call_metrics.min_interruption_overlap"),
    ]
    for kwargs, name in cases:
        with pytest.raises(CallMetricsError) as err:
            CallMetricsSettings.from_overrides(**kwargs)
        assert err.value.field == name and name in str(err.value)
    validate_interval(0.0)
    validate_interval(1.0)
    for bad in (0.5, 3601.0, math.nan):
        with pytest.raises(CallMetricsError, match="call_metrics_interval must be between 1 s and 3600 s"):
            validate_interval(bad)
    with pytest.raises(ValueError, match="channel_tag 3 is not one of"):
        CallMetricsTracker([1, 2]).speech(3, 0.0, 1.0)
    with pytest.raises(ValueError, match="distinct"):
        CallMetricsTracker([1, 1])


def test_the_proto_carries_every_figure() -> None:
    """The lead maps snapshots onto asr.v1: every figure has its field, times as Durations."""
    fields = {
        "channel_tag": "channel_tag",
        "talk_s": "talk_time",
        "interruptions": "interruptions",
        "words_per_minute": "words_per_minute",
        "mean_loudness_dbfs": "mean_loudness_dbfs",
    }
    proto = asr_pb2.ChannelMetrics.DESCRIPTOR.fields_by_name
    for f in dataclasses.fields(ChannelMetrics):
        if f.name != "words":  # the count behind words_per_minute, for the pipeline's own use
            assert fields[f.name] in proto
    assert proto["talk_time"].message_type.full_name == "google.protobuf.Duration"
    assert proto["mean_loudness_dbfs"].has_presence  # unset while a channel has no speech
    call = asr_pb2.CallMetrics.DESCRIPTOR.fields_by_name
    assert {"channels", "non_talk_time", "overlap_time", "total_time"} <= set(call)
    for owner in (asr_pb2.StreamingRecognizeResponse, asr_pb2.RecognizeResponse):
        assert owner.DESCRIPTOR.fields_by_name["call_metrics"].message_type.name == "CallMetrics"
    request = asr_pb2.StreamingRecognizeRequest(keyterms_update=asr_pb2.KeytermsUpdate(keyterms=["Zorvex"]))
    assert request.WhichOneof("streaming_request") == "keyterms_update"
    assert asr_pb2.FORMATTING_UNSPECIFIED == 0 and asr_pb2.Formatting.Name(2) == "SMART"


# --- the incremental tracker against a plain reference, on random calls (times on a 0.1 s grid) ---


def reference(
    timeline: dict[int, list[tuple[int, int]]], until: int, min_non_talk: int, min_overlap: int
) -> dict[str, Any]:
    """The figures of a finished call of `until` tenths of a second, computed in one pass over 0.1 s
    cells: a plain restatement of the definitions, sharing no code with the tracker."""
    merged: dict[int, list[list[int]]] = {}
    for tag, segs in timeline.items():
        out: list[list[int]] = []
        for s, e in segs:
            if out and s == out[-1][1]:
                out[-1][1] = e
            elif e > s:
                out.append([s, e])
        merged[tag] = out
    speaking = np.zeros(until, dtype=int)
    for segs in merged.values():
        for s, e in segs:
            speaking[s:e] += 1
    runs, run = [], 0
    for v in [*speaking.tolist(), 1]:  # a speaker after the end closes the last run
        if v == 0:
            run += 1
        else:
            runs.append(run)
            run = 0
    interruptions = {}
    for tag, segs in merged.items():
        n = 0
        for s, e in segs:
            together = [
                min(e, oe) - s
                for other, osegs in merged.items()
                if other != tag
                for os_, oe in osegs
                if os_ < s < oe
            ]
            n += bool(together) and max(together) >= min_overlap
        interruptions[tag] = n
    return {
        "talk": {tag: sum(e - s for s, e in segs) for tag, segs in merged.items()},
        "overlap": int((speaking >= 2).sum()),
        "non_talk": sum(r for r in runs if r >= min_non_talk),
        "interruptions": interruptions,
    }


Event = tuple[int, int, str, int, int]  # (time, order, kind, channel tag, segment index)


@st.composite
def calls(draw: st.DrawFn) -> tuple[list[Event], dict[int, list[tuple[int, int]]]]:
    """A random call in tenths of a second: per channel, segments with gaps (0: a forced-cut
    continuation) reported in order within the report lag, some announced by speech_started first, and
    snapshots; events in the order they happen (a channel's own in its order)."""
    n_channels = draw(st.integers(1, 3))
    events: list[Event] = []
    segments: dict[int, list[tuple[int, int]]] = {}
    end = 0
    for tag in range(1, n_channels + 1):
        t, last_report, segs = 0, 0, []
        for k in range(draw(st.integers(0, 6))):
            t += draw(st.sampled_from([0, 0, 3, 10, 20, 25, 60]) if k else st.integers(0, 30))
            dur = draw(st.integers(1, 300))
            start, stop = t, t + dur
            report = max(last_report, stop + draw(st.integers(0, max(0, start + 400 - stop))))
            if draw(st.booleans()):
                at = draw(st.integers(max(start, last_report), report))
                events.append((at, len(events), "started", tag, k))
            events.append((report, len(events), "speech", tag, k))
            segs.append((start, stop))
            last_report, t = report, stop
        segments[tag] = segs
        end = max(end, last_report)
    end += draw(st.integers(0, 50))
    snaps = [*draw(st.lists(st.integers(0, end), max_size=6)), end]
    events += [(t, 1_000_000, "snapshot", 0, 0) for t in snaps]  # after the events of the same moment
    return sorted(events), segments


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls(), st.sampled_from([(20, 10), (5, 3), (1, 1)]))
def test_tracker_matches_reference_at_every_snapshot(
    call: tuple[list[Event], dict[int, list[tuple[int, int]]]], thresholds: tuple[int, int]
) -> None:
    events, segments = call
    min_non_talk, min_overlap = thresholds
    tags = sorted(segments)
    tracker = CallMetricsTracker(tags, CallMetricsSettings(min_non_talk / 10, min_overlap / 10))
    reported: dict[int, list[tuple[int, int]]] = {tag: [] for tag in tags}
    open_: dict[int, int] = {}
    for t, _, kind, tag, k in events:
        tracker.advance(t / 10)
        if kind == "started":
            open_[tag] = segments[tag][k][0]
            tracker.speech_started(tag, open_[tag] / 10)
        elif kind == "speech":
            open_.pop(tag, None)
            reported[tag].append(segments[tag][k])
            tracker.speech(tag, segments[tag][k][0] / 10, segments[tag][k][1] / 10)
        else:
            known = {tag: reported[tag] + ([(open_[tag], t)] if tag in open_ else []) for tag in tags}
            until = max([t] + [e for segs in known.values() for _, e in segs])
            want = reference(known, until, min_non_talk, min_overlap)
            m = tracker.snapshot()
            assert m.total_s == pytest.approx(until / 10)
            assert m.overlap_s == pytest.approx(want["overlap"] / 10)
            assert m.non_talk_s == pytest.approx(want["non_talk"] / 10)
            for c in m.channels:
                assert c.talk_s == pytest.approx(want["talk"][c.channel_tag] / 10)
                assert c.interruptions == want["interruptions"][c.channel_tag], (t, known)


# --- a real stereo call: two espeak voices, one per channel, cut by the real Endpointer ---

AGENT = [
    "Thank you for calling, how can I help you today?",
    "Let me look at your account for a moment please.",
]
CUSTOMER = [
    "Hello, I would like to change my address.",
    "Sorry, I already gave you my new address yesterday.",
]


def _speech(text: str, voice: str) -> np.ndarray:
    audio = speak(text, voice=voice)
    start, end = speech_bounds(audio)
    return audio[round(start * RATE) : round(end * RATE)]


def _place(track: np.ndarray, audio: np.ndarray, at_s: float) -> tuple[float, float]:
    i = round(at_s * RATE)
    track[i : i + len(audio)] += audio
    return at_s, at_s + len(audio) / RATE


def _utterances(audio: np.ndarray) -> list[Utterance]:
    ep = Endpointer()
    events = [e for i in range(0, len(audio), 1600) for e in ep.feed(audio[i : i + 1600])] + ep.flush()
    return [e for e in events if isinstance(e, Utterance)]


@dataclasses.dataclass(frozen=True)
class LaidOutCall:
    agent: np.ndarray  # each channel's track at RATE
    customer: np.ndarray
    total_s: float
    truth: Timeline  # where each sentence's speech lies, per channel (1: agent, 2: customer)
    loudness_dbfs: dict[int, float]  # each channel's true loudness over its speech


@functools.cache
def laid_out_call() -> LaidOutCall:
    """Agent (en-us) and customer (en-gb, 10 dB quieter): agent, 3 s of silence, customer, 1 s, agent, and
    the customer cuts in 1.5 s into the agent's second sentence; 3 s of silence at the end."""
    a1, a2 = _speech(AGENT[0], "en-us"), _speech(AGENT[1], "en-us")
    c1, c2 = (0.316 * _speech(t, "en-gb") for t in CUSTOMER)
    total = 0.5 + len(a1) / RATE + 3.0 + len(c1) / RATE + 1.0 + len(a2) / RATE + len(c2) / RATE + 3.0
    agent, customer = silence(total), silence(total)
    s_a1 = _place(agent, a1, 0.5)
    s_c1 = _place(customer, c1, s_a1[1] + 3.0)
    s_a2 = _place(agent, a2, s_c1[1] + 1.0)
    s_c2 = _place(customer, c2, s_a2[0] + 1.5)
    loud = {
        tag: 10 * math.log10(float(np.mean(np.concatenate(parts) ** 2)))
        for tag, parts in ((1, [a1, a2]), (2, [c1, c2]))
    }
    return LaidOutCall(agent, customer, total, {1: [s_a1, s_a2], 2: [s_c1, s_c2]}, loud)


def test_real_stereo_call_through_the_endpointer() -> None:
    """The laid out call (`laid_out_call`) on the two channels of a stereo 8 kHz mu-law call, decoded by
    the service's own decoder. Tolerances: 0.3 s of talk per channel, 0.25 s of overlap, 0.4 s of non-talk
    against the energy bounds of the speech laid out (silero's 32 ms windows and hysteresis; measured:
    every bound within 0.1 s), loudness within 1 dB."""
    laid = laid_out_call()
    total, truth = laid.total_s, laid.truth
    assert truth[2][1][0] < truth[1][1][1] - 1.0, "the customer must cut in for over a second"

    decoder = StreamDecoder("MULAW", 8000, 2)
    call = to_mulaw_8k_bytes(stereo(laid.agent, laid.customer))
    heard = np.concatenate([decoder.feed(call), decoder.flush()], axis=1)
    cut = {1: _utterances(heard[0]), 2: _utterances(heard[1])}
    assert [len(u) for u in cut.values()] == [2, 2], "each sentence is one utterance"
    tracker = CallMetricsTracker([1, 2])
    for tag, utterances in cut.items():  # in report order: all of a channel's, then the other's
        for u in utterances:
            tracker.utterance(tag, u)
            tracker.final(tag, u.start_s, u.end_s, len((AGENT if tag == 1 else CUSTOMER)[u.index].split()))
    tracker.advance(heard.shape[1] / RATE)
    m = tracker.snapshot()

    want = CallMetricsTracker([1, 2])
    feed_in_report_order(want, truth)
    want.advance(total)
    exact = want.snapshot()
    assert m.total_s == pytest.approx(total)
    for got, true in zip(m.channels, exact.channels, strict=True):
        assert got.talk_s == pytest.approx(true.talk_s, abs=0.3)
    assert m.overlap_s == pytest.approx(exact.overlap_s, abs=0.25)
    # the two 3 s silences count, the 0.5 s and 1 s ones do not
    assert m.non_talk_s == pytest.approx(exact.non_talk_s, abs=0.4)
    assert [c.interruptions for c in m.channels] == [0, 1]
    agent_wpm = 60 * sum(len(t.split()) for t in AGENT) / channel(exact, 1).talk_s
    assert channel(m, 1).words_per_minute == pytest.approx(agent_wpm, rel=0.15)
    loud = laid.loudness_dbfs
    for tag in (1, 2):
        assert channel(m, tag).mean_loudness_dbfs == pytest.approx(loud[tag], abs=1.0)
    db = channel(m, 1).mean_loudness_dbfs, channel(m, 2).mean_loudness_dbfs
    assert db[0] is not None and db[1] is not None
    assert db[0] - db[1] == pytest.approx(loud[1] - loud[2], abs=0.5)  # the quieter customer
