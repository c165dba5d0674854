"""Deepgram's `UtteranceEnd`, from word timings (pure): a gap of `utterance_end_ms` after the last
finalized word.

Deepgram defines it on the results it sent: once the audio reaches the end of the last finalized word plus
the gap, with no word since, it sends `UtteranceEnd {last_word_end}`, once per such gap. Here, per channel:
words of an interim mean speech not finalized yet (no UtteranceEnd until their final); speech the voice
activity detector heard starting inside the gap means the gap is none (no UtteranceEnd until that
utterance's final, whose words then move the mark). A final that arrives when the audio has already passed
the gap sends it at once, after that final.
"""

from __future__ import annotations


class UtteranceEndTracker:
    """One channel's gap detector; times are seconds from the stream's start."""

    def __init__(self, gap_s: float) -> None:
        self.gap_s = gap_s
        self.last_word_end: float | None = None  # of the finalized words
        self._armed = False  # a finalized word whose gap has not been announced yet
        self._unsettled = False  # words of an interim, or speech heard, since the last final

    def on_result(self, words_end: float | None, is_final: bool) -> None:
        """A Results message sent: `words_end` is its last word's end (None: no words)."""
        if not is_final:
            if words_end is not None:
                self._unsettled = True
            return
        self._unsettled = False
        if words_end is not None and (self.last_word_end is None or words_end > self.last_word_end):
            self.last_word_end = words_end
            self._armed = True

    def on_speech_started(self, at_s: float) -> None:
        if self.last_word_end is not None and at_s < self.last_word_end + self.gap_s:
            self._unsettled = True

    def advance(self, audio_s: float) -> float | None:
        """The audio received so far reaches `audio_s`: the last word's end to announce, or None."""
        if (
            self._armed
            and not self._unsettled
            and self.last_word_end is not None
            and audio_s >= self.last_word_end + self.gap_s
        ):
            self._armed = False
            return self.last_word_end
        return None
