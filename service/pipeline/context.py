"""Context carried across a channel's utterances: the text each utterance of a stream's channel is
conditioned on (DecodeOptions.context), as Whisper's long-form transcription conditions each 30 s window on
the text before it (openai/whisper transcribe's condition_on_previous_text).

A channel's finals, in order, each append their text; the tail of at most --context-carry-tokens tokens is
kept. Never shared: one `ChannelContext` per channel of one stream, so a call's text never reaches another
channel or another call. Whisper's safeguards decide what is carried: a final that looped (gzip compression
ratio over 2.4, openai/whisper's compression_ratio_threshold) or that the model was unsure of (average
log-probability under -1.0, logprob_threshold) resets the context instead, as Whisper resets its prompt after
a fallback; so does a final the model called non-speech (no-speech probability over 0.6,
no_speech_threshold): carrying a hallucination would prime the next utterance with it. And an utterance
that continues speech the endpointer cut at its length bound (max_utterance_duration) is decoded without it:
beginning mid-word or mid-sentence, tiny.en with the earlier text as prompt made up words to join the two
(docs/benchmarks.md "Context across a channel's utterances"); its text is still carried after it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

from engine.api import Transcript

# openai/whisper transcribe()'s defaults
COMPRESSION_RATIO_THRESHOLD = 2.4
LOGPROB_THRESHOLD = -1.0
NO_SPEECH_THRESHOLD = 0.6


def compression_ratio(text: str) -> float:
    """openai/whisper's loop measure: how well the text's UTF-8 bytes compress."""
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0


def carried(t: Transcript) -> bool:
    """Whether a final is safe to condition the next utterance on (the module docstring's safeguards)."""
    return (
        compression_ratio(t.text) <= COMPRESSION_RATIO_THRESHOLD
        and t.avg_logprob >= LOGPROB_THRESHOLD
        and t.no_speech_prob <= NO_SPEECH_THRESHOLD
    )


@dataclass
class ChannelContext:
    """One channel's carried text. `tail(text, n)`: text's last n tokens (engine/decoding/prompt.py
    PromptEncoder.tail, the engine's own tokenizer); `max_tokens` 0: nothing is carried."""

    max_tokens: int
    tail: Callable[[str, int], str]
    text: str = ""
    after_cut: bool = False  # the last utterance submitted was cut while speech went on

    def submitted(self, *, forced_cut: bool) -> None:
        """An utterance of this channel went to the engine; `forced_cut`: cut at the length bound, so the
        next one continues its speech."""
        self.after_cut = forced_cut

    def final(self, t: Transcript) -> None:
        """A final of this channel, in order: its text joins the context, or a doubtful one resets it."""
        if self.max_tokens <= 0:
            return
        words = t.text.strip()
        if not t.is_speech or not words:
            return  # silence or noise adds nothing and takes nothing away (Whisper skips such a segment)
        if not carried(t):
            self.text = ""
            return
        self.text = self.tail(f"{self.text} {words}".strip(), self.max_tokens)

    @property
    def value(self) -> str | None:
        """What the channel's next utterance gets as DecodeOptions.context (None: nothing carried)."""
        return None if self.after_cut else self.text or None
