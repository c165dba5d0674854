"""Voice-activity endpointing: cuts one channel's 16 kHz audio into utterances with silero-vad.

The model is service/pipeline/vad.py's, one per process (`load_vad()`); each stream/channel owns a
small `VadState` (the model's LSTM state and the last samples of context) and an `Endpointer` that turns speech probabilities per 32 ms
window into SpeechStarted / SpeechEnded / Utterance events (and, with `speculative=True`,
SpeculativeEnd / SpeculationCancelled: the utterance offered as soon as its audio is known, before the
silence is long enough to confirm it).

Who computes the probabilities is separate from what the state machine does with them: `feed()` scores
one channel on its own (tools, Recognize, tests), while a stream server pushes audio
(`push()`), lets service/pipeline/vad_batch.py score the `windows()` of every channel of every stream in one
batched call per event-loop tick, and hands the probabilities back (`advance()`). Telephone audio is
scored on its 16 kHz resampling, the engine's audio: silero's 8 kHz model on the call's own audio cost
about a fifth less VAD CPU but cut real speech into utterances the engine transcribed worse (WER 9.7 vs
7.0 % through the server at 16 real-time calls; docs/benchmarks.md "Endpointing cost: batched VAD").
A channel's line noise is not scored at all once the model has called it non-speech
(service/pipeline/noise_gate.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from service.pipeline.noise_gate import MARGIN_DB
from service.pipeline.vad import MAX_WINDOWS_PER_CALL, RATE, WINDOW, SileroVad, VadState, load_vad
from service.vocabulary.endpointing import EndpointSettings


@dataclass(frozen=True)
class SpeechStarted:
    offset_s: float


@dataclass(frozen=True)
class SpeechEnded:
    offset_s: float


@dataclass(frozen=True)
class Utterance:
    """One utterance; start_s/end_s are the detected speech bounds, seconds from the stream start.

    `audio` (float32 16 kHz mono) begins `lead_s` before start_s (the pad) and runs to end_s plus pad,
    or exactly to end_s after a forced cut.
    """

    audio: np.ndarray = field(repr=False)
    start_s: float
    end_s: float
    index: int
    forced_cut: bool
    lead_s: float = 0.0

    @property
    def audio_start_s(self) -> float:
        """Where audio[0] lies in the stream (Whisper's timestamps count from here)."""
        return self.start_s - self.lead_s


@dataclass(frozen=True)
class SpeculativeEnd:
    """Speech has stopped and the audio the utterance would have if the silence lasts is all here.

    `utterance` is the very object the confirming `Utterance` event will carry (same audio, bounds and
    index) unless speech resumes, a forced cut intervenes or the stream ends elsewhere: then a
    `SpeculationCancelled` comes first. Only from an Endpointer made with `speculative=True`.
    """

    utterance: Utterance


@dataclass(frozen=True)
class SpeculationCancelled:
    """The last SpeculativeEnd will not be confirmed (speech resumed, or the utterance was cut elsewhere)."""

    index: int


Event = SpeechStarted | SpeechEnded | SpeculativeEnd | SpeculationCancelled | Utterance


@dataclass(frozen=True)
class TurnJudging:
    """A semantic end of turn (service/pipeline/turn_model.py): when the silence reaches min_silence_s the
    turn model is asked; P(complete) >= threshold ends the turn there, else the turn waits for speech to
    resume, up to max_silence_s of silence (then it ends as silence-only endpointing would)."""

    threshold: float = 0.5
    max_silence_s: float = 2.0


_TURN_AUDIO = 8 * RATE  # the turn model hears a turn's last 8 s (service/pipeline/turn_model.py)


class Endpointer:
    """Finds utterances in one channel. Feed any number of samples; events come out in order.

    Memory stays bounded: only the current utterance (at most max_utterance_s) plus the pad is kept.
    """

    def __init__(
        self,
        settings: EndpointSettings | None = None,
        vad: SileroVad | None = None,
        *,
        speculative: bool = False,
        gate_margin_db: float = MARGIN_DB,
        turn: TurnJudging | None = None,
    ) -> None:
        """`gate_margin_db`: this channel's VAD noise gate (service/pipeline/noise_gate.py; 0: off);
        `turn`: ask the turn model before a silence ends an utterance (None: silence alone ends it)."""
        self.settings = s = settings or EndpointSettings()
        s.validate()
        self._vad = vad or load_vad()
        self.vad_state = self._vad.new_state(gate_margin_db)
        self._pad = round(s.speech_pad_s * RATE)
        self._max_len = round(s.max_utterance_s * RATE)
        self._min_silence = round(s.min_silence_s * RATE)
        self._min_speech = round(s.min_speech_s * RATE)
        # audio kept: samples [_buf_start, _buf_start + _buf_len) of the stream
        self._buf = np.zeros(RATE, dtype=np.float32)
        self._buf_start = 0
        self._buf_len = 0
        self._scored = 0  # samples already scored by the VAD (a multiple of WINDOW)
        self._win_probs: list[float] = []  # per window of the current utterance, for choosing a cut
        self._win_rms: list[float] = []
        self._win0 = 0  # stream window index of _win_probs[0]
        self._speaking = False  # VAD says speech (hysteresis between start and end thresholds)
        self._confirmed = False  # speech lasted min_speech_s: SpeechStarted was sent
        self._speech_start = 0  # sample where the current speech began
        self._last_speech = 0  # end of the last window at or above the end threshold
        self._audio_start = 0  # sample where the current utterance's audio begins
        self._kept_from = 0  # audio before this went out with the previous utterance
        self._index = 0
        self._speculative = speculative
        # the SpeculativeEnd in flight: (audio_start, audio_end, speech_start, speech_end) and its utterance
        self._spec: tuple[tuple[int, int, int, int], Utterance] | None = None
        # samples from the last speech window's end to the end of the window that confirms the end of the
        # utterance (min silence rounded up to whole windows, as _step counts it)
        self._confirm_after = -(-self._min_silence // WINDOW) * WINDOW
        self._turn = turn
        self._max_silence = round(turn.max_silence_s * RATE) if turn else 0
        self._asked = -1  # _last_speech of the pause the turn model was last asked about
        self._question: np.ndarray | None = None  # a turn's audio waiting to be asked about

    @property
    def in_speech(self) -> bool:
        """An utterance is in progress (SpeechStarted sent, its end not yet)."""
        return self._confirmed

    @property
    def buffered_s(self) -> float:
        """Seconds of audio held (bounded by max_utterance_s plus a pad and one feed slice)."""
        return self._buf_len / RATE

    def partial(self) -> np.ndarray | None:
        """Audio of the utterance in progress (for interim results), or None."""
        if not self._confirmed:
            return None
        return self._slice(self._audio_start, self._buf_start + self._buf_len)

    @property
    def scored_s(self) -> float:
        """Seconds of audio the VAD has scored (from the stream's start)."""
        return self._scored / RATE

    @property
    def unscored_s(self) -> float:
        """Seconds of audio pushed and not yet scored."""
        return (self._buf_start + self._buf_len - self._scored) / RATE

    def feed(self, samples: np.ndarray) -> list[Event]:
        """16 kHz samples in, scored here on their own; events out."""
        events: list[Event] = []
        step = MAX_WINDOWS_PER_CALL * WINDOW
        for k in range(-(-len(samples) // step)):  # bounded slices keep the buffer bounded
            self.push(samples[k * step : (k + 1) * step])
            events += self.advance(self._vad(self.vad_state, self.windows()))
        return events

    def push(self, samples: np.ndarray) -> None:
        """Append 16 kHz audio to be scored later (`windows()`, then `advance()` with their probabilities)."""
        self._append(np.asarray(samples, dtype=np.float32))

    def windows(self) -> np.ndarray:
        """The windows ready to score, [n, WINDOW]: a view, valid until the next push() or advance()."""
        n = (self._buf_start + self._buf_len - self._scored) // WINDOW
        start = self._scored - self._buf_start
        return self._buf[start : start + n * WINDOW].reshape(n, WINDOW)

    def advance(self, probs: np.ndarray) -> list[Event]:
        """Run the state machine over the next len(probs) windows (the probabilities of `windows()`)."""
        events: list[Event] = []
        n = len(probs)
        if n:
            start = self._scored - self._buf_start
            windows = self._buf[start : start + n * WINDOW].reshape(n, WINDOW)
            rms = np.sqrt(np.einsum("ij,ij->i", windows, windows) / WINDOW)  # half the cost of mean(w**2)
            for p, r in zip(np.asarray(probs).tolist(), rms.tolist(), strict=True):
                self._scored += WINDOW
                self._step(p, r, events)
            if not self._speaking:
                self._trim_idle()
        return events

    def catch_up(self) -> list[Event]:
        """Score what was pushed and not yet scored, here and now (end of stream, drain)."""
        return self.advance(self._vad(self.vad_state, self.windows()))

    def flush(self) -> list[Event]:
        """End of stream: the utterance in progress (if it is speech) is emitted, not lost."""
        events: list[Event] = []
        total = self._buf_start + self._buf_len
        if self._speaking:
            # still speaking at the last scored window: speech runs to the last sample received
            end = total if self._last_speech == self._scored else self._last_speech
            if self._confirmed or end - self._speech_start >= self._min_speech:
                self._end_utterance(end, min(end + self._pad, total), events)
        self._cancel_speculation(events)  # (none is left after an end; kept for safety)
        self._question = None
        self._speaking = self._confirmed = False
        self._kept_from = total
        self._trim_idle()
        return events

    def clear(self) -> list[Event]:
        """Drop the utterance in progress and everything scored so far, as if it was never heard; the
        channel goes on from the next audio. Its index is not reused (an interim of it may be out)."""
        events: list[Event] = []
        self._cancel_speculation(events)
        self._question = None
        if self._confirmed:
            self._index += 1
        self._speaking = self._confirmed = False
        self._kept_from = self._scored
        self._trim_idle()
        return events

    @property
    def next_index(self) -> int:
        """The index the next utterance will get."""
        return self._index

    # --- state machine, one 32 ms window at a time ---

    def _step(self, prob: float, rms: float, events: list[Event]) -> None:
        s, end = self.settings, self._scored
        self._win_probs.append(prob)
        self._win_rms.append(rms)
        if not self._speaking:
            if prob >= s.speech_start_threshold:
                self._speaking = True
                self._speech_start = end - WINDOW
                self._last_speech = end
                # never reuse audio that went out with the previous utterance
                self._audio_start = min(
                    self._speech_start, max(self._speech_start - self._pad, self._kept_from)
                )
            else:
                return
        if prob >= s.speech_end_threshold:
            self._last_speech = end
        if not self._confirmed and self._last_speech - self._speech_start >= self._min_speech:
            self._confirmed = True
            events.append(SpeechStarted(self._speech_start / RATE))
        if self._spec is not None and self._last_speech != self._spec[0][3]:
            self._cancel_speculation(events)  # speech resumed before the silence was long enough
        silence = end - self._last_speech
        # with the turn model, a confirmed utterance's silence is judged, not final, until max_silence_s
        judging = (
            self._turn is not None and self._confirmed and self._min_silence <= silence < self._max_silence
        )
        if silence >= self._min_silence and not judging:
            if self._confirmed:
                self._end_utterance(self._last_speech, min(self._last_speech + self._pad, end), events)
            self._speaking = self._confirmed = False  # a burst shorter than min_speech_s: dropped
        elif end - self._audio_start >= self._max_len:
            self._forced_cut(events)
        elif judging:
            if self._asked != self._last_speech:  # one question per pause: its first min_silence_s
                self._asked = self._last_speech
                self._question = self._slice(max(self._audio_start, end - _TURN_AUDIO), end)
        elif self._speculative and self._confirmed and self._spec is None and end > self._last_speech:
            self._maybe_speculate(events)

    def question(self) -> np.ndarray | None:
        """The turn's audio to ask the turn model about (once per pause), or None; taking it clears it."""
        q, self._question = self._question, None
        return q

    def judged(self, complete: float) -> list[Event]:
        """The turn model's P(complete) for the last question: a complete turn ends now, at its pause,
        unless speech resumed (or the utterance ended otherwise) meanwhile; an incomplete one waits."""
        events: list[Event] = []
        if self._turn is None or not self._confirmed or self._asked != self._last_speech:
            return events
        if complete >= self._turn.threshold:
            end = self._scored
            self._end_utterance(self._last_speech, min(self._last_speech + self._pad, end), events)
            self._speaking = self._confirmed = False
            self._trim_idle()
        return events

    def _maybe_speculate(self, events: list[Event]) -> None:
        """In the silence after speech: once the audio the end would be cut with is all here and scored
        silent, offer the utterance early. The cut is the one _step will make if no speech comes back
        before the silence reaches min_silence_s: audio to min(last speech + pad, the confirming window's
        end). Waiting for the pad to be scored (not merely received) keeps one silent window between
        words from costing an engine request when audio comes faster than real time; in a live call the
        pad is the last audio received anyway."""
        confirm_at = self._last_speech + self._confirm_after
        audio_end = min(self._last_speech + self._pad, confirm_at)
        if audio_end > self._scored:
            return  # the trailing pad has not been heard (as silence) yet
        # a forced cut would come first (the utterance hits max_utterance_s within the silence): the cut
        # it makes is elsewhere, so there is nothing to offer
        forced_at = -(-(self._audio_start + self._max_len) // WINDOW) * WINDOW
        if forced_at < confirm_at:
            return
        key = (self._audio_start, audio_end, self._speech_start, self._last_speech)
        utterance = self._utterance(self._last_speech, audio_end, forced=False)
        self._spec = (key, utterance)
        events.append(SpeculativeEnd(utterance))

    def _cancel_speculation(self, events: list[Event]) -> None:
        if self._spec is not None:
            events.append(SpeculationCancelled(self._spec[1].index))
            self._spec = None

    def _end_utterance(
        self, speech_end: int, audio_end: int, events: list[Event], forced: bool = False
    ) -> None:
        utterance = None
        if self._spec is not None:
            key, offered = self._spec
            if not forced and key == (self._audio_start, audio_end, self._speech_start, speech_end):
                utterance = offered  # the speculation holds: the very same utterance is confirmed
                self._spec = None
            else:
                self._cancel_speculation(events)
        if not forced:
            events.append(SpeechEnded(speech_end / RATE))
        if utterance is None:
            utterance = self._utterance(speech_end, audio_end, forced)
        events.append(utterance)
        self._index += 1
        self._kept_from = audio_end

    def _utterance(self, speech_end: int, audio_end: int, forced: bool) -> Utterance:
        return Utterance(
            audio=self._slice(self._audio_start, audio_end),
            start_s=self._speech_start / RATE,
            end_s=speech_end / RATE,
            index=self._index,
            forced_cut=forced,
            lead_s=(self._speech_start - self._audio_start) / RATE,
        )

    def _forced_cut(self, events: list[Event]) -> None:
        """Cut at the quietest window in the last 30% of the allowed span; the rest goes on."""
        if not self._confirmed:  # only when min_speech_s is close to max_utterance_s
            self._confirmed = True
            events.append(SpeechStarted(self._speech_start / RATE))
        first = (self._audio_start + int(0.7 * self._max_len)) // WINDOW - self._win0
        probs = np.array(self._win_probs[first:])
        rms = np.array(self._win_rms[first:])
        # The VAD probability finds pauses between words; energy over ±1 window prefers the middle of the
        # pause over a one-window stop closure inside a word.
        rms3 = np.convolve(np.pad(rms, 1, mode="edge"), np.ones(3) / 3, mode="valid")
        best = int(np.argmin(probs + rms3 / max(float(rms3.max()), 1e-9)))
        cut = (self._win0 + first + best) * WINDOW + WINDOW // 2
        if self._last_speech <= cut:  # the speech had in fact ended: a normal end
            self._end_utterance(self._last_speech, cut, events)
            self._speaking = self._confirmed = False
        else:
            self._end_utterance(cut, cut, events, forced=True)
            self._speech_start = self._audio_start = cut
        self._drop_before(cut)

    # --- audio buffer ---

    def _append(self, x: np.ndarray) -> None:
        need = self._buf_len + len(x)
        if need > len(self._buf):
            grown = np.zeros(max(need, 2 * len(self._buf)), dtype=np.float32)
            grown[: self._buf_len] = self._buf[: self._buf_len]
            self._buf = grown
        self._buf[self._buf_len : need] = x
        self._buf_len = need

    def _slice(self, start: int, end: int) -> np.ndarray:
        return self._buf[start - self._buf_start : end - self._buf_start].copy()

    def _trim_idle(self) -> None:
        """Not in speech: keep just the pad before the unscored tail (the pre-roll of the next utterance)."""
        self._drop_before(max(self._scored - self._pad, self._kept_from))

    def _drop_before(self, sample: int) -> None:
        k = min(sample, self._scored) - self._buf_start
        if k <= 0:
            return
        self._buf[: self._buf_len - k] = self._buf[k : self._buf_len]
        self._buf_len -= k
        self._buf_start += k
        drop_windows = max(0, sample // WINDOW - self._win0)
        del self._win_probs[:drop_windows], self._win_rms[:drop_windows]
        self._win0 += drop_windows


# The shortest turn a client's flush cuts: a shorter sliver holds no word, and a client flushing every few
# milliseconds would otherwise cost one engine decode per sliver. Below OpenAI's least commit (100 ms, which
# the Realtime door checks on the bytes it received) so that a resampler's delay never splits the two.
MIN_FLUSHED_TURN_S = 0.05


class ManualTurns:
    """A channel the client cuts itself (StreamSettings.endpointing None: OpenAI Realtime without turn
    detection): everything since the last cut is one utterance, which `flush()` (the client's commit, or
    the end of the stream) ends; no speech events. It offers the VAD no windows, so it rides a stream's VAD
    pass at no cost; what it holds is bounded by the stream's --max-buffer-seconds (pipeline/intake.py)."""

    def __init__(self) -> None:
        self.vad_state = VadState()  # never advanced: there is nothing to score
        self._buf = np.zeros(RATE, dtype=np.float32)
        self._len = 0
        self._start = 0  # stream sample where the turn in progress began
        self._index = 0

    @property
    def in_speech(self) -> bool:
        return self._len > 0

    @property
    def unscored_s(self) -> float:
        return 0.0

    @property
    def held_from_s(self) -> float:
        """Where the turn in progress began (seconds from the stream's start)."""
        return self._start / RATE

    @property
    def next_index(self) -> int:
        return self._index

    def partial(self) -> np.ndarray | None:
        return self._buf[: self._len].copy() if self._len else None

    def push(self, samples: np.ndarray) -> None:
        need = self._len + len(samples)
        if need > len(self._buf):
            grown = np.zeros(max(need, 2 * len(self._buf)), dtype=np.float32)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : need] = samples
        self._len = need

    def windows(self) -> np.ndarray:
        return self._buf[:0].reshape(0, WINDOW)

    def advance(self, probs: np.ndarray) -> list[Event]:
        return []

    def cut(self) -> list[Event]:
        """The client's flush: the turn so far as one utterance, unless it is shorter than
        MIN_FLUSHED_TURN_S (then it goes on, and its audio starts the next turn)."""
        if self._len < MIN_FLUSHED_TURN_S * RATE:
            return []
        return self.flush()

    def flush(self) -> list[Event]:
        """The turn so far as one utterance (none when no audio came since the last cut)."""
        if not self._len:
            return []
        end = self._start + self._len
        audio = self._buf[: self._len].copy()
        utterance = Utterance(audio, self._start / RATE, end / RATE, self._index, forced_cut=False)
        self._index += 1
        self._start, self._len = end, 0
        return [utterance]

    def clear(self) -> list[Event]:
        """Drop the turn so far; its index is not reused."""
        if self._len:
            self._index += 1
        self._start, self._len = self._start + self._len, 0
        return []
