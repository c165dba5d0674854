"""Engine transcripts -> the core's Result events, for streams and recordings alike.

Everything a result carries (transcript, segments, words with offsets and confidence) is built here, with
redaction (service/pipeline/redaction.py) applied before anything leaves the server: finals, interims and
the transcript text in logs. Offsets count from the stream's start; the engine's times count from the
utterance audio's first sample.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from engine.api import Transcript
from service.pipeline.endpointing import Utterance
from service.pipeline.formatting import format_text, format_words
from service.pipeline.redaction import StreamRedactor, Word, join, redact_utterances, words_of_text
from service.vocabulary.redaction import Kind
from service.vocabulary.types import EndReason, Result, Segment
from service.vocabulary.types import Word as ResultWord


@dataclass(frozen=True)
class ResultOptions:
    """What the recognition settings ask results to carry."""

    segments: bool = False
    word_times: bool = False
    word_confidence: bool = False
    redact: frozenset[Kind] = frozenset()
    smart: bool = False  # spoken numbers as digits (service/pipeline/formatting.py), before redaction
    speakers: bool = False  # words and finals carry a diarized speaker (recordings)

    @property
    def words(self) -> bool:
        return self.word_times or self.word_confidence or self.speakers

    @property
    def rewrites(self) -> bool:
        """The text is rebuilt from the words (formatted or redacted), not taken as the engine wrote it."""
        return self.smart or bool(self.redact)


def transcript_words(t: Transcript, opts: ResultOptions) -> list[Word]:
    """The utterance as words, formatted when the settings ask (a spoken number merged into one word that
    keeps the first word's start, the last one's end and the lowest confidence), not yet redacted."""
    words = spoken_words(t, opts)
    return format_words(words) if opts.smart else words


def spoken_words(t: Transcript, opts: ResultOptions) -> list[Word]:
    """The utterance as words, as the engine wrote them: its timed words when it computed them, else the
    text's words (segment by segment when segments are asked for, so that their texts can be rebuilt)."""
    starts = [s.start_s for s in t.segments] if opts.segments else []

    def part(start_s: float) -> int:
        return max(0, sum(1 for s in starts if s <= start_s) - 1)

    if t.words:
        return [Word(w.word, w.start_s, w.end_s, w.probability, part(w.start_s)) for w in t.words]
    if opts.segments and t.segments:
        return [
            w for i, s in enumerate(t.segments) for w in words_of_text((" " if i else "") + s.text.strip(), i)
        ]
    return words_of_text(t.text.strip())


@dataclass(frozen=True)
class _Text:
    transcript: str
    words: tuple[ResultWord, ...]
    segments: tuple[Segment, ...]


SpeakerOf = Callable[[float, float], int | None]


def _text(
    t: Transcript,
    words: Sequence[Word],
    audio_start_s: float,
    opts: ResultOptions,
    speaker_of: SpeakerOf | None,
) -> _Text:
    """`words`: transcript_words(t), redacted when the stream redacts. `speaker_of`: the diarized speaker
    of a span of the stream (None: no speakers)."""
    segments = []
    if opts.segments:
        for i, s in enumerate(t.segments):
            text = join([w for w in words if w.part == i]) if opts.rewrites else s.text.strip()
            segments.append(Segment(text, audio_start_s + s.start_s, audio_start_s + s.end_s))
    infos = []
    if opts.words:
        for w in words:
            if w.start_s is None or w.end_s is None:
                continue  # words without times: the engine computed none
            timed = opts.word_times
            infos.append(
                ResultWord(
                    w.text.strip(),
                    audio_start_s + w.start_s if timed else None,
                    audio_start_s + w.end_s if timed else None,
                    w.probability if opts.word_confidence else None,
                    None
                    if speaker_of is None
                    else speaker_of(audio_start_s + w.start_s, audio_start_s + w.end_s),
                )
            )
    return _Text(join(words) if opts.rewrites else t.text.strip(), tuple(infos), tuple(segments))


# --- Recognize: a whole recording ----------------------------------------------------------------


def recognize_results(
    jobs: Sequence[tuple[int, Utterance]],
    transcripts: Sequence[Transcript],
    opts: ResultOptions,
    at_end: Collection[Utterance] = (),
    speakers: Callable[[int], SpeakerOf | None] | None = None,
) -> list[Result | None]:
    """One result per job (None where the utterance held no speech). Each channel's utterances are
    redacted together, in order, so that a number split across two of them is still found. `at_end`:
    the utterances the end of the recording cut. `speakers`: a channel tag's diarized speakers."""
    spoken = [t.is_speech and bool(t.text.strip()) for t in transcripts]
    words: list[list[Word]] = [
        transcript_words(t, opts) if ok else [] for t, ok in zip(transcripts, spoken, strict=True)
    ]
    if opts.redact:
        for tag in {tag for tag, _ in jobs}:
            indexes = [i for i, (jt, _) in enumerate(jobs) if jt == tag and spoken[i]]
            indexes.sort(key=lambda i: jobs[i][1].start_s)
            for i, redacted in zip(
                indexes, redact_utterances([words[i] for i in indexes], opts.redact), strict=True
            ):
                words[i] = redacted
    results: list[Result | None] = []
    for (tag, u), t, ok, w in zip(jobs, transcripts, spoken, words, strict=True):
        if not ok:
            results.append(None)
            continue
        ended = end_reason(u, at_end=any(u is e for e in at_end))
        results.append(final_result(tag, u, t, w, opts, ended, None if speakers is None else speakers(tag)))
    return results


def final_result(
    tag: int,
    u: Utterance,
    t: Transcript,
    words: Sequence[Word],
    opts: ResultOptions,
    ended_by: EndReason,
    speaker_of: SpeakerOf | None = None,
) -> Result:
    """The final of utterance `u` on channel `tag` from its transcript; `words` as _text takes them."""
    text = _text(t, words, u.audio_start_s, opts, speaker_of)
    speaker = None
    if speaker_of is not None:
        speaker = _result_speaker(words, u, speaker_of)
    return Result(
        channel=tag,
        utterance_index=u.index,
        is_final=True,
        transcript=text.transcript,
        confidence=t.confidence,
        start_s=u.start_s,
        end_s=u.end_s,
        language=t.language,
        temperature=t.temperature,
        words=text.words,
        segments=text.segments,
        ended_by=ended_by,
        speaker=speaker,
    )


def _result_speaker(words: Sequence[Word], u: Utterance, speaker_of: SpeakerOf) -> int | None:
    """The speaker of most of the final's spoken time (by its timed words; by its span without them)."""
    spoken: dict[int, float] = {}
    for w in words:
        if w.start_s is None or w.end_s is None:
            continue
        who = speaker_of(u.audio_start_s + w.start_s, u.audio_start_s + w.end_s)
        if who is not None:
            spoken[who] = spoken.get(who, 0.0) + max(w.end_s - w.start_s, 1e-3)
    if spoken:
        return max(spoken, key=lambda k: spoken[k])
    return speaker_of(u.start_s, u.end_s)


def end_reason(u: Utterance, *, at_end: bool = False, finalized: bool = False) -> EndReason:
    if finalized:
        return EndReason.FINALIZE
    if u.forced_cut:
        return EndReason.MAX_LENGTH
    return EndReason.END_OF_AUDIO if at_end else EndReason.SILENCE


# --- a stream: one channel of it ---------------------------------------------------------------


OnSent = Callable[[], None] | None


@dataclass
class _Final:
    transcript: Transcript
    utterance: Utterance
    ended_by: EndReason
    on_sent: OnSent
    speaker_of: SpeakerOf | None = None


class ChannelResults:
    """One channel's results as they leave the stream: finals in order (a redacting stream may hold one
    back until the next, see service/pipeline/redaction.py), interims and log text redacted in context."""

    def __init__(self, opts: ResultOptions, tag: int) -> None:
        self.opts = opts
        self.tag = tag
        self._redactor: StreamRedactor[_Final] = StreamRedactor(opts.redact)

    @property
    def holding(self) -> bool:
        return bool(self._redactor.held)

    def final(
        self,
        t: Transcript,
        u: Utterance,
        ended_by: EndReason,
        on_sent: OnSent,
        speaker_of: SpeakerOf | None = None,
    ) -> list[tuple[Result, OnSent]]:
        """The finals ready to send now (none while this one is held back; two when it releases one).
        `speaker_of`: the utterance's live speakers (None: none, or none in time)."""
        return self._build(
            self._redactor.final(
                transcript_words(t, self.opts), _Final(t, u, ended_by, on_sent, speaker_of), u.end_s
            )
        )

    def release(self, heard_s: float | None = None) -> list[tuple[Result, OnSent]]:
        """The held final, if any: always (None: no next utterance is coming), or once `heard_s` of the
        channel's audio is far enough past it."""
        ready = self._redactor.release() if heard_s is None else self._redactor.release_if_stale(heard_s)
        return self._build(ready)

    def _build(self, ready: list[tuple[_Final, list[Word]]]) -> list[tuple[Result, OnSent]]:
        return [
            (
                final_result(self.tag, f.utterance, f.transcript, words, self.opts, f.ended_by, f.speaker_of),
                f.on_sent,
            )
            for f, words in ready
        ]

    def empty(self, t: Transcript | None, u: Utterance, ended_by: EndReason) -> Result:
        """The final of an utterance in which nothing was recognized (StreamSettings.empty_finals)."""
        return Result(
            channel=self.tag,
            utterance_index=u.index,
            is_final=True,
            transcript="",
            confidence=0.0 if t is None else t.confidence,
            start_s=u.start_s,
            end_s=u.end_s,
            language="" if t is None else t.language,
            ended_by=ended_by,
        )

    def interim(
        self,
        t: Transcript,
        index: int,
        start_s: float,
        end_s: float,
        stability: float,
        *,
        after_unknown: bool = False,
    ) -> Result:
        """An interim hypothesis of utterance `index` (audio from start_s to end_s of the stream);
        `after_unknown`: an earlier utterance's final is not in yet (its text is no context yet)."""
        text = self._formatted(t.text)
        if self.opts.redact:
            text = join(self._redactor.interim(words_of_text(text), after_unknown=after_unknown))
        return Result(
            channel=self.tag,
            utterance_index=index,
            is_final=False,
            transcript=text,
            confidence=t.confidence,
            start_s=start_s,
            end_s=end_s,
            language=t.language,
            stability=stability,
        )

    def log_text(self, t: Transcript) -> str:
        text = self._formatted(t.text)
        if not self.opts.redact:
            return text
        return self._redactor.for_log(words_of_text(text))

    def _formatted(self, text: str) -> str:
        """Text without word timings (interims, logs), formatted as finals are: an interim reads as its
        final will, and its redaction sees the same digits."""
        return format_text(text.strip()) if self.opts.smart else text.strip()
