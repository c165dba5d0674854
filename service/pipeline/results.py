"""Engine transcripts -> protobuf results, for StreamingRecognize and Recognize alike.

Everything a result carries (and every other response a stream sends: speech events, interims) (transcript, segments, words with offsets and confidence) is built here,
with redaction (service/pipeline/redaction.py) applied before anything leaves the server: finals, interims and
the transcript text in logs. Offsets count from the stream's start; the engine's times count from the
utterance audio's first sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asr.v1 import asr_pb2
from google.protobuf.duration_pb2 import Duration

from engine import Transcript
from service.pipeline.endpointing import Utterance
from service.pipeline.redaction import Kind, StreamRedactor, Word, join, redact_utterances, words_of_text


def duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


@dataclass(frozen=True)
class ResultOptions:
    """What a RecognitionConfig asks results to carry."""

    segments: bool = False
    word_times: bool = False
    word_confidence: bool = False
    redact: frozenset[Kind] = frozenset()

    @property
    def words(self) -> bool:
        return self.word_times or self.word_confidence


def result_options(config: asr_pb2.RecognitionConfig) -> ResultOptions:
    """Raises ValueError naming config.redact for a value this server does not know."""
    kinds = set()
    for value in config.redact:
        if value == asr_pb2.REDACTION_UNSPECIFIED:
            continue
        if value not in asr_pb2.Redaction.values():
            raise ValueError(f"config.redact: unknown value {value} (known: PCI, SSN, NUMBERS)")
        kinds.add(Kind[asr_pb2.Redaction.Name(value)])
    return ResultOptions(
        segments=config.enable_segment_time_offsets,
        word_times=config.enable_word_time_offsets,
        word_confidence=config.enable_word_confidence,
        redact=frozenset(kinds),
    )


def transcript_words(t: Transcript, opts: ResultOptions) -> list[Word]:
    """The utterance as words: the engine's timed words when it computed them, else the text's words
    (segment by segment when segments are asked for, so that their texts can be rebuilt)."""
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


def alternative(
    t: Transcript, words: Sequence[Word], audio_start_s: float, opts: ResultOptions
) -> asr_pb2.SpeechRecognitionAlternative:
    """`words`: transcript_words(t), redacted when the stream redacts."""
    segments = []
    if opts.segments:
        for i, s in enumerate(t.segments):
            text = join([w for w in words if w.part == i]) if opts.redact else s.text.strip()
            segments.append(
                asr_pb2.WordOrSegment(
                    text=text,
                    start_offset=duration(audio_start_s + s.start_s),
                    end_offset=duration(audio_start_s + s.end_s),
                )
            )
    infos = []
    if opts.words:
        for w in words:
            if w.start_s is None or w.end_s is None:
                continue  # words without times: the engine computed none
            info = asr_pb2.WordInfo(word=w.text.strip())
            if opts.word_times:
                info.start_offset.CopyFrom(duration(audio_start_s + w.start_s))
                info.end_offset.CopyFrom(duration(audio_start_s + w.end_s))
            if opts.word_confidence and w.probability is not None:
                info.confidence = w.probability
            infos.append(info)
    return asr_pb2.SpeechRecognitionAlternative(
        transcript=join(words) if opts.redact else t.text.strip(),
        confidence=t.confidence,
        segments=segments,
        words=infos,
    )


# --- Recognize: a whole recording ----------------------------------------------------------------


def recognize_results(
    jobs: Sequence[tuple[int, Utterance]], transcripts: Sequence[Transcript], opts: ResultOptions
) -> list[asr_pb2.SpeechRecognitionResult | None]:
    """One result per job (None where the utterance held no speech). Each channel's utterances are
    redacted together, in order, so that a number split across two of them is still found."""
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
    results: list[asr_pb2.SpeechRecognitionResult | None] = []
    for (tag, u), t, ok, w in zip(jobs, transcripts, spoken, words, strict=True):
        if not ok:
            results.append(None)
            continue
        results.append(
            asr_pb2.SpeechRecognitionResult(
                alternatives=[alternative(t, w, u.audio_start_s, opts)],
                channel_tag=tag,
                start_offset=duration(u.start_s),
                end_offset=duration(u.end_s),
                language_code=t.language,
            )
        )
    return results


# --- StreamingRecognize: one channel of a stream ---------------------------------------------------


def speech_event(kind: int, offset_s: float, tag: int) -> asr_pb2.StreamingRecognizeResponse:
    """A SpeechEventType response (`kind`), `offset_s` from the stream's start, on channel `tag`."""
    return asr_pb2.StreamingRecognizeResponse(
        speech_event_type=kind, speech_event_offset=duration(offset_s), speech_event_channel_tag=tag
    )


OnSent = Callable[[], None] | None


@dataclass
class _Final:
    transcript: Transcript
    utterance: Utterance
    on_sent: OnSent


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
        self, t: Transcript, u: Utterance, on_sent: OnSent
    ) -> list[tuple[asr_pb2.StreamingRecognitionResult, OnSent]]:
        """The finals ready to send now (none while this one is held back; two when it releases one)."""
        return self._build(
            self._redactor.final(transcript_words(t, self.opts), _Final(t, u, on_sent), u.end_s)
        )

    def release(
        self, heard_s: float | None = None
    ) -> list[tuple[asr_pb2.StreamingRecognitionResult, OnSent]]:
        """The held final, if any: always (None: no next utterance is coming), or once `heard_s` of the
        channel's audio is far enough past it."""
        ready = self._redactor.release() if heard_s is None else self._redactor.release_if_stale(heard_s)
        return self._build(ready)

    def _build(
        self, ready: list[tuple[_Final, list[Word]]]
    ) -> list[tuple[asr_pb2.StreamingRecognitionResult, OnSent]]:
        out = []
        for f, words in ready:
            u, t = f.utterance, f.transcript
            result = asr_pb2.StreamingRecognitionResult(
                alternatives=[alternative(t, words, u.audio_start_s, self.opts)],
                is_final=True,
                start_offset=duration(u.start_s),
                end_offset=duration(u.end_s),
                channel_tag=self.tag,
                language_code=t.language,
                utterance_index=u.index,
            )
            out.append((result, f.on_sent))
        return out

    def interim(
        self,
        t: Transcript,
        index: int,
        start_s: float,
        end_s: float,
        stability: float,
        *,
        after_unknown: bool = False,
    ) -> asr_pb2.StreamingRecognitionResult:
        """An interim hypothesis of utterance `index` (audio from start_s to end_s of the stream);
        `after_unknown`: an earlier utterance's final is not in yet (its text is no context yet)."""
        text = t.text.strip()
        if self.opts.redact:
            text = join(self._redactor.interim(words_of_text(text), after_unknown=after_unknown))
        return asr_pb2.StreamingRecognitionResult(
            alternatives=[asr_pb2.SpeechRecognitionAlternative(transcript=text, confidence=t.confidence)],
            is_final=False,
            stability=stability,
            start_offset=duration(start_s),
            end_offset=duration(end_s),
            channel_tag=self.tag,
            language_code=t.language,
            utterance_index=index,
        )

    def log_text(self, t: Transcript) -> str:
        if not self.opts.redact:
            return t.text
        return self._redactor.for_log(words_of_text(t.text.strip()))
