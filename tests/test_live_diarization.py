"""LiveSpeakers' placement rules (service/pipeline/live_diarization.py) on hand-made unit embeddings, and the
per-speaker call metrics (SpeakerMetrics): pure logic, no audio."""

from __future__ import annotations

import numpy as np

from service.pipeline.call_metrics import SpeakerMetrics
from service.pipeline.live_diarization import Embedded, LiveSpeakers


def unit(*xs: float) -> np.ndarray:
    v = np.array(xs, dtype=np.float32)
    return v / np.linalg.norm(v)


def one(v: np.ndarray, start: float, seconds: float = 2.0) -> Embedded:
    return Embedded(((start, start + seconds),), v[None], (seconds,))


A, B, C = unit(1, 0, 0), unit(0, 1, 0), unit(0, 0, 1)


def test_speakers_are_numbered_in_order_of_appearance_and_never_renumbered() -> None:
    live = LiveSpeakers(max_speakers=10)
    labels = [live.assign(one(v, i * 3.0))(i * 3.0, i * 3.0 + 1) for i, v in enumerate([B, A, B, C, A])]
    assert labels == [0, 1, 0, 2, 1] and live.speakers == 3


def test_past_the_cap_an_utterance_joins_the_nearest_speaker() -> None:
    live = LiveSpeakers(max_speakers=2)
    assert [live.assign(one(v, 0.0))(0.0, 1.0) for v in (A, B, unit(0.2, 1, 0.9))] == [0, 1, 1]
    assert live.speakers == 2


def test_a_short_utterance_never_opens_a_speaker() -> None:
    live = LiveSpeakers(max_speakers=10)
    live.assign(one(A, 0.0))
    assert live.assign(one(B, 3.0, seconds=0.6))(3.0, 3.5) == 0 and live.speakers == 1


def test_words_take_the_speaker_of_the_window_holding_their_midpoint() -> None:
    live = LiveSpeakers(max_speakers=10)
    speaker_of = live.assign(Embedded(((0.0, 1.5), (1.5, 3.0)), np.stack([A, B]), (1.5, 1.5)))
    assert [speaker_of(0.2, 0.6), speaker_of(1.2, 1.7), speaker_of(1.4, 2.0), speaker_of(3.1, 3.3)] == [
        0,
        0,
        1,
        1,
    ]


def test_speaker_metrics_count_each_run_of_words_and_interruptions_between_speakers() -> None:
    m = SpeakerMetrics()
    m.words([(0, 0.0, 1.0), (0, 1.0, 2.0), (0, 2.0, 4.0)])
    m.words([(1, 2.5, 3.5), (1, 3.5, 5.0)])  # speaker 1 starts under speaker 0 and both go on 1.5 s
    s0, s1 = m.snapshot(6.0)
    assert (s0.channel_tag, s0.talk_s, s0.words, s0.interruptions) == (0, 4.0, 3, 0)
    assert (s1.channel_tag, s1.talk_s, s1.words, s1.interruptions) == (1, 2.5, 2, 1)
    assert s1.mean_loudness_dbfs is None
