"""Call metrics for quality monitoring, per stream, from the endpointer's speech segments (pure logic).

Fed as the call runs, one `CallMetricsTracker` per stream: each channel's speech segments (the
Endpointer's Utterance bounds start_s..end_s: the detected speech, without its pad), the word count of
each final, and the speech samples for loudness. `snapshot()` gives the metrics so far at any time (the
periodic message, the last one); `advance()` moves the call's clock and says when a periodic one is due.

Definitions (in call audio seconds; exact on laid-out timelines):

- talk time of a channel: the sum of its speech segments (one still going on counts up to now).
- overlap time: time in which two channels or more speak at once.
- non-talk time: time in which no channel speaks, counted only in silences of at least `min_non_talk_s`
  (2 s by default); the silence before the first speech and after the last count too. While the call
  runs, a silence still going on counts once it is that long.
- interruptions of a channel: times it started speaking while another channel was speaking (that one
  started strictly earlier and has not stopped) and both went on speaking together for at least
  `min_interruption_overlap_s` (1 s by default: a "mm-hm" or "yes" under the other party is no
  interruption). The one who starts second interrupts. A segment that continues its channel's previous one
  without a gap (the endpointer's forced cut of a long utterance) is the same speech, not a new start.
- words per minute of a channel: words of its finals per minute of the talk time those finals cover (each
  final's utterance bounds), so that a snapshot taken while an utterance is still being recognised is not
  diluted by talk whose words are not in yet. Count words as the model wrote them, before formatting and
  redaction merge them ("four five" -> "45" was two spoken words).
- mean loudness of a channel: RMS-based, 10 * log10 of the mean squared speech sample (full scale 1.0)
  over every speech sample of the channel (an energy mean, not a mean of per-window dB values): a
  full-scale square wave is 0 dBFS, a full-scale sine -3.01 dBFS. None while the channel has no speech.

Incremental: the timeline before a horizon is settled once nothing can still be reported that starts
there (no channel has a segment going on before it, and a silent channel's next segment cannot start
more than `report_lag_s` before the clock), and is folded into running totals; a snapshot sweeps only the
segments after it. An interruption whose overlap may still grow (a segment that may be continued) waits
until it is decided. The endpointer reports a segment at most max_utterance_s + min_silence_s (35 s at
the widest settings) after it starts, hence the default report lag of 40 s. Segments of one channel come
in order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from service.pipeline.endpointing import Utterance
from service.pipeline.vad import RATE
from service.vocabulary.call_metrics import (
    CallMetrics,
    CallMetricsSettings,
    ChannelMetrics,
    validate_interval,
)
from service.vocabulary.types import Result

REPORT_LAG_S = 40.0
_EPS_S = 1e-9  # thresholds compare durations computed in floating point: 2.3 - 0.3 is 2 s
_SAME_TIME_S = 1e-6  # a segment starting this close to its channel's last end continues it
_FLOOR_DBFS = -200.0  # digital silence inside speech (never from a VAD, but defined)


@dataclass(frozen=True)
class _Segment:
    channel: int  # index into the tracker's channels
    start: float
    end: float


@dataclass(frozen=True)
class _Coverage:
    """[0, t) of the timeline folded into totals."""

    t: float = 0.0
    gap_start: float | None = 0.0  # where the silence going on at t began; None: someone speaks at t
    non_talk: float = 0.0
    overlap: float = 0.0


def _cover(state: _Coverage, segments: Sequence[_Segment], until: float, min_non_talk_s: float) -> _Coverage:
    """Fold [state.t, until) into the totals; `segments` holds every segment that reaches past state.t."""
    t0 = state.t
    if until <= t0:
        return state
    changes: dict[float, int] = {}  # speakers: +1 at each start, -1 at each end, clipped to [t0, until)
    for seg in segments:
        a, b = max(seg.start, t0), min(seg.end, until)
        if b > a:
            changes[a] = changes.get(a, 0) + 1
            changes[b] = changes.get(b, 0) - 1
    speaking = 0
    gap_start, non_talk, overlap = state.gap_start, state.non_talk, state.overlap
    points = sorted({t0, until, *changes})
    for a, b in itertools.pairwise(points):
        speaking += changes.get(a, 0)
        if speaking >= 2:
            overlap += b - a
        if speaking == 0:
            if gap_start is None:
                gap_start = a
        elif gap_start is not None:
            if a - gap_start >= min_non_talk_s - _EPS_S:
                non_talk += a - gap_start
            gap_start = None
    return _Coverage(until, gap_start, non_talk, overlap)


def _together(start: _Segment, segments: Sequence[_Segment]) -> float | None:
    """How long `start`'s channel and another spoke together from its start on (the longest over the
    others speaking at that moment), or None when no other was speaking then."""
    runs = [
        min(start.end, o.end) - start.start
        for o in segments
        if o.channel != start.channel and o.start < start.start < o.end
    ]
    return max(runs) if runs else None


@dataclass
class _Channel:
    tag: int
    segments: list[_Segment] = field(default_factory=list)  # the unsettled ones, and always the last
    open_start: float | None = None  # speech going on (SpeechStarted, or after a forced cut)
    last_end: float = 0.0
    talk: float = 0.0
    words: int = 0
    words_talk: float = 0.0  # talk time covered by the finals counted
    square_sum: float = 0.0
    samples: int = 0

    def continues(self, start: float) -> bool:
        """Speech starting here continues the last segment (it starts where that one ended)."""
        return (
            bool(self.segments)
            and self.segments[-1].end == self.last_end
            and abs(start - self.last_end) < _SAME_TIME_S
        )

    def mean_loudness_dbfs(self) -> float | None:
        if not self.samples:
            return None
        mean_square = self.square_sum / self.samples
        return max(10.0 * math.log10(mean_square), _FLOOR_DBFS) if mean_square > 0 else _FLOOR_DBFS


class CallMetricsTracker:
    """One stream's call metrics. Channels are named by their channel_tag (0 for a mixed-down stream,
    1..N with separate recognition per channel)."""

    def __init__(
        self,
        channel_tags: Sequence[int],
        settings: CallMetricsSettings | None = None,
        *,
        interval_s: float = 0.0,
        report_lag_s: float = REPORT_LAG_S,
    ) -> None:
        if not channel_tags or len(set(channel_tags)) != len(channel_tags):
            raise ValueError(f"channel tags must be distinct and at least one, got {list(channel_tags)}")
        self.settings = settings or CallMetricsSettings()
        self.settings.validate()
        validate_interval(interval_s)
        self._channels = [_Channel(tag) for tag in channel_tags]
        self._index = {tag: i for i, tag in enumerate(channel_tags)}
        self._coverage = _Coverage()
        self._interruptions = [0] * len(channel_tags)
        self._undecided: list[tuple[int, float]] = []  # (channel, start) of settled starts to decide
        self._now = 0.0
        self._interval = interval_s
        self._next_due = interval_s
        self._lag = report_lag_s

    # --- feeding ---

    def speech_started(self, channel_tag: int, start_s: float) -> None:
        """Speech of a channel began (the Endpointer's SpeechStarted); it counts as it goes on, until
        `speech()` brings the whole segment."""
        ch = self._channel(channel_tag)
        ch.open_start = max(start_s, ch.last_end)

    def speech(self, channel_tag: int, start_s: float, end_s: float) -> None:
        """A finished speech segment of a channel. One reaching back before the channel's previous end
        is cut to start there (and so continues it)."""
        ch = self._channel(channel_tag)
        start = max(start_s, ch.last_end)
        ch.open_start = None
        if end_s <= start:
            return
        ch.talk += end_s - start
        i = self._index[channel_tag]
        if ch.continues(start):
            ch.segments[-1] = _Segment(i, ch.segments[-1].start, end_s)
        elif end_s > self._coverage.t:
            # A segment reported later than report_lag_s (never with the endpointer's events) starts at
            # the settled time for overlap, non-talk and interruptions: those totals before it are final.
            ch.segments.append(_Segment(i, max(start, self._coverage.t), end_s))
        ch.last_end = end_s
        self._settle()

    def utterance(self, channel_tag: int, utterance: Utterance) -> None:
        """An Endpointer Utterance: its speech segment and the loudness of its speech samples. After a
        forced cut the speech goes on: the next segment continues this one."""
        self.speech(channel_tag, utterance.start_s, utterance.end_s)
        if utterance.forced_cut:
            self.speech_started(channel_tag, utterance.end_s)
        lead = round(utterance.lead_s * RATE)
        n = round((utterance.end_s - utterance.start_s) * RATE)
        self.loudness(channel_tag, utterance.audio[lead : lead + n])

    def loudness(self, channel_tag: int, speech_samples: np.ndarray) -> None:
        """Speech samples of a channel (float, full scale 1.0) for its mean loudness."""
        x = np.asarray(speech_samples, dtype=np.float64)
        ch = self._channel(channel_tag)
        ch.square_sum += float(np.dot(x, x))
        ch.samples += len(x)

    def final(self, channel_tag: int, start_s: float, end_s: float, words: int) -> None:
        """A final of a channel: its utterance's bounds and its word count (before formatting and
        redaction). Call it for every finished utterance, with text or none, so that talk the engine
        dropped as noise does not count against the words per minute."""
        ch = self._channel(channel_tag)
        ch.words += words
        ch.words_talk += max(0.0, end_s - start_s)

    def advance(self, now_s: float) -> CallMetrics | None:
        """The call's audio clock moved to `now_s` (audio received on every channel). Returns the metrics
        so far when a periodic message is due (every interval_s of audio; one at most per call however far
        the clock jumps), else None."""
        self._now = max(self._now, now_s)
        self._settle()
        if self._interval and self._now >= self._next_due:
            self._next_due = (math.floor(self._now / self._interval) + 1) * self._interval
            return self.snapshot()
        return None

    # --- reading ---

    def snapshot(self) -> CallMetrics:
        """The metrics of the call so far, up to the clock (or the last speech reported, if later);
        changes nothing."""
        until = max(self._now, *(c.last_end for c in self._channels))
        segments = self._segments(until)
        coverage = _cover(self._coverage, segments, until, self.settings.min_non_talk_s)
        non_talk = coverage.non_talk
        if (
            coverage.gap_start is not None
            and until - coverage.gap_start >= self.settings.min_non_talk_s - _EPS_S
        ):
            non_talk += until - coverage.gap_start
        interruptions = list(self._interruptions)
        starts = self._undecided + [
            (s.channel, s.start) for s in segments if self._coverage.t <= s.start < until
        ]
        for seg in self._starting(starts, segments):
            together = _together(seg, segments)
            if together is not None and together >= self._min_overlap:
                interruptions[seg.channel] += 1
        channels = tuple(
            ChannelMetrics(
                channel_tag=c.tag,
                talk_s=c.talk + (max(0.0, until - c.open_start) if c.open_start is not None else 0.0),
                interruptions=interruptions[i],
                words_per_minute=60.0 * c.words / c.words_talk if c.words_talk > 0 else 0.0,
                mean_loudness_dbfs=c.mean_loudness_dbfs(),
                words=c.words,
            )
            for i, c in enumerate(self._channels)
        )
        return CallMetrics(channels, non_talk_s=non_talk, overlap_s=coverage.overlap, total_s=until)

    # --- internals ---

    @property
    def _min_overlap(self) -> float:
        return self.settings.min_interruption_overlap_s - _EPS_S

    def _channel(self, channel_tag: int) -> _Channel:
        try:
            return self._channels[self._index[channel_tag]]
        except KeyError:
            raise ValueError(
                f"channel_tag {channel_tag} is not one of this stream's {sorted(self._index)}"
            ) from None

    def _segments(self, until: float | None = None) -> list[_Segment]:
        """Every segment kept; with `until`, speech going on counts as a segment up to it (continuing
        the channel's last one when it does)."""
        out = []
        for i, c in enumerate(self._channels):
            segs = list(c.segments)
            if until is not None and c.open_start is not None and until > c.open_start:
                if c.continues(c.open_start):
                    segs[-1] = _Segment(i, segs[-1].start, until)
                else:
                    segs.append(_Segment(i, max(c.open_start, self._coverage.t), until))
            out += segs
        return out

    @staticmethod
    def _starting(starts: Sequence[tuple[int, float]], segments: Sequence[_Segment]) -> list[_Segment]:
        by_start = {(s.channel, s.start): s for s in segments}
        return [by_start[key] for key in starts if key in by_start]

    def _known_until(self, ch: _Channel) -> float:
        """Nothing of this channel can still be reported that starts before this time."""
        if ch.open_start is not None:
            return ch.open_start
        return max(ch.last_end, self._now - self._lag)

    def _may_grow(self, seg: _Segment) -> bool:
        """The segment is its channel's last and may still be continued: speech goes on from its end,
        or speech starting there can still be reported."""
        ch = self._channels[seg.channel]
        return seg.end == ch.last_end and (ch.open_start is not None or self._now - self._lag <= ch.last_end)

    def _settle(self) -> None:
        horizon = min(self._known_until(c) for c in self._channels)
        t0 = self._coverage.t
        if horizon <= t0:
            return
        segments = self._segments()
        self._coverage = _cover(self._coverage, segments, horizon, self.settings.min_non_talk_s)
        # every segment starting before the horizon is known now, and so are those it overlaps
        starts = self._undecided + [(s.channel, s.start) for s in segments if t0 <= s.start < horizon]
        self._undecided = []
        for seg in self._starting(starts, segments):
            together = _together(seg, segments)
            if together is None:
                continue
            if together >= self._min_overlap:
                self._interruptions[seg.channel] += 1
            elif any(
                self._may_grow(s)
                for s in segments
                if s is seg or (s.channel != seg.channel and s.start < seg.start < s.end)
            ):
                self._undecided.append((seg.channel, seg.start))
        keep_from = min([horizon] + [start for _, start in self._undecided])
        for c in self._channels:
            c.segments = [s for s in c.segments[:-1] if s.end > keep_from] + c.segments[-1:]


class SpeakerMetrics:
    """A diarized mono (or mixed-down) call's figures per speaker, from its finals' words: each run of one
    speaker's timed words is a speech segment of that speaker and a final of its word count. A speaker
    can first appear with speech from before what a tracker has settled, so the runs are kept (a few
    numbers each) and a tracker over every speaker is replayed at each snapshot, in the order the runs
    end, as a recording's utterances are (recording_call_metrics). Loudness is not known per speaker."""

    def __init__(self, settings: CallMetricsSettings | None = None) -> None:
        self._settings = settings
        self._runs: list[tuple[int, float, float, int]] = []  # speaker, start, end, words

    def words(self, words: Sequence[tuple[int, float, float]]) -> None:
        """A final's words: (speaker, start_s, end_s), in order."""
        runs: list[tuple[int, float, float, int]] = []
        for who, start, end in words:
            if runs and runs[-1][0] == who:
                runs[-1] = (who, runs[-1][1], end, runs[-1][3] + 1)
            else:
                runs.append((who, start, end, 1))
        self._runs += runs

    def snapshot(self, now_s: float) -> tuple[ChannelMetrics, ...]:
        """Each speaker's figures so far, by speaker."""
        if not self._runs:
            return ()
        tracker = CallMetricsTracker(sorted({who for who, *_ in self._runs}), self._settings)
        for who, start, end, n in sorted(self._runs, key=lambda r: r[2]):
            tracker.speech(who, start, end)
            tracker.final(who, start, end, n)
        tracker.advance(now_s)
        return tracker.snapshot().channels


def speaker_words(result: Result) -> list[tuple[int, float, float]]:
    """A final's timed words that carry a speaker, as SpeakerMetrics.words takes them."""
    return [
        (w.speaker, w.start_s, w.end_s)
        for w in result.words
        if w.speaker is not None and w.start_s is not None and w.end_s is not None
    ]
