"""Redaction of payment cards, social security numbers and numbers in transcripts (pure functions).

Whisper writes the same spoken digits as "four one one one", "4111", "4-1-1-1" or "41, 11" from one
utterance to the next, so every word is first normalised to the digits it stands for ("oh"/"zero" are 0,
"double four" is 44, "forty one" is 41). Consecutive number words form a run; then, over the runs:

- PCI: 13-19 consecutive digits that pass the Luhn check (a card), and every short number (2-6 digits,
  or a date like 04/27) in the FOLLOW_WORDS words after it: the security code and the expiry date.
- SSN: nine digits that are a valid US SSN by its structure (stdnum.us.ssn), written 3-2-4
  ("123-45-6789"), or spoken in context ("social", "security", "SSN" shortly before).
- NUMBERS: every other run with a written digit, or of two number words or more (a lone "one" in
  "one moment" is no number to hide).
Each span becomes one word, `[PCI]`, `[SSN]` or `[NUMBER]`, that keeps the span's start, end and mean
probability. Times of day ("10:30") are numbers but never part of a card or an SSN.

A card read out slowly is split over two utterances, and a final already sent cannot be unsent. The
policy (StreamRedactor): when PCI or SSN is asked for and a final ends in a digit run that is not yet a
whole card or SSN (3 digits or more), that final is held back until the channel's next final (or until
HOLD_AUDIO_S of audio has passed with no next utterance, or the stream ends), then both are redacted
together; so a final waits for at most one following utterance. A card spread over three utterances or
more, or cut after fewer than 3 digits, can show those first few digits: never a whole card number.
Words of the finals already sent stay as context, so a continuation (or the code after a card) that
comes later is still redacted.

Library choice: presidio-analyzer installs from PyPI, but its AnalyzerEngine loads a spaCy model
(en_core_web_lg) that is published only on GitHub, not on PyPI (only third-party re-uploads are), so it
cannot be installed offline here; and what it would bring for cards and SSNs is a regular expression over
written digits plus a Luhn check. It knows nothing of spoken digits, of word times, or of a number split
across utterances, which is the work here. We use python-stdnum (well kept) for the check digits (Luhn)
and the SSN structure rules, and keep the normalisation, which must stay aligned with word times, here.
Names and addresses are out of scope (issue 14 makes them optional).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from stdnum import luhn
from stdnum.us import ssn as us_ssn

FOLLOW_WORDS = 20  # after a card, its security code and expiry come within this many words
CONTEXT_WORDS = 12  # "social security number is ..." within this many words before nine digits
HISTORY_WORDS = 40  # words of finals already sent kept as context for the next ones
MIN_HOLD_DIGITS = 3  # a final ending in this many digits or more may be the first part of a card
HOLD_AUDIO_S = 6.0  # a held final goes out once this much audio passed with no next utterance


class Kind(enum.Enum):
    """What to redact; the names are the proto's Redaction values."""

    PCI = "[PCI]"
    SSN = "[SSN]"
    NUMBERS = "[NUMBER]"

    @property
    def placeholder(self) -> str:
        return self.value


@dataclass(frozen=True)
class Word:
    text: str  # as Whisper writes it, leading space included
    start_s: float | None = None
    end_s: float | None = None
    probability: float | None = None
    part: int = 0  # which segment of its utterance it belongs to (segment texts are rebuilt from words)


def words_of_text(text: str, part: int = 0) -> list[Word]:
    """Whitespace-separated words, each with its leading space (no times)."""
    return [Word(m.group(0), part=part) for m in re.finditer(r"\s*\S+", text)]


def join(words: Sequence[Word]) -> str:
    return "".join(w.text for w in words).strip()


# --- numbers: each word to the digits it stands for ---------------------------------------------

_UNITS = {
    "zero": 0, "oh": 0, "o": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5,
    "six": 6, "seven": 7, "eight": 8, "nine": 9,
}  # fmt: skip
_TEENS = {
    "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
    "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19,
}  # fmt: skip
_TENS = {
    "twenty": 2, "thirty": 3, "forty": 4, "fourty": 4, "fifty": 5, "sixty": 6, "seventy": 7,
    "eighty": 8, "ninety": 9,
}  # fmt: skip
_REPEAT = {"double": 2, "triple": 3}
_ZERO_WORDS = {"oh", "o"}  # zero only next to other digits ("oh, I see" is no number)
# Whisper writes "four one one one" as "for one one one" at times ("free" for three, "to" for two):
# these count only right next to three digits or more.
_HOMOPHONES = {"for": "4", "to": "2", "too": "2", "free": "3"}
_HOMOPHONE_RUN = 3
_WRITTEN = re.compile(r"[$#£€]?\d+(?:[-.,/:]\d+)*%?")
_PUNCT = "\"'“”‘’()[]{}<>.,;:!?…-"
_SSN_CONTEXT = re.compile(r"^(social|security|ssn|s\.s\.n)$")


@dataclass
class _Token:
    index: int  # in the flat word list
    digits: str | None  # None: not a number
    written: bool = False  # digits as digits (not words)
    shape: str = "plain"  # "time" (10:30) and "date" (04/27) never join a card or SSN
    groups: tuple[int, ...] = ()  # written digit groups' lengths ("123-45-6789": 3, 2, 4)
    weak: bool = False  # "oh": a number only next to another
    homophone: bool = False  # "for": a number only next to three others
    tens: bool = False  # "forty": "4" before a unit word, "40" otherwise
    repeat: int = 0  # "double": repeats the next unit word


def _core(text: str) -> str:
    return text.strip().strip(_PUNCT).lower()


def _token(index: int, text: str) -> _Token:
    core = _core(text)
    if _WRITTEN.fullmatch(core):
        shape = "time" if ":" in core else "date" if "/" in core else "plain"
        groups = tuple(len(g) for g in re.findall(r"\d+", core))
        return _Token(index, re.sub(r"\D", "", core), written=True, shape=shape, groups=groups)
    if core in _REPEAT:
        return _Token(index, "", repeat=_REPEAT[core])
    if core in _HOMOPHONES:
        return _Token(index, _HOMOPHONES[core], homophone=True)
    parts = core.split("-")
    digits = ""
    tens = False
    for i, part in enumerate(parts):  # "forty-one", "one-one-one-one"
        if part in _UNITS:
            digits += str(_UNITS[part])
        elif part in _TEENS:
            digits += str(_TEENS[part])
        elif part in _TENS:
            following_unit = i + 1 < len(parts) and parts[i + 1] in _UNITS and parts[i + 1] not in _ZERO_WORDS
            digits += str(_TENS[part]) + ("" if following_unit else "0")
            tens = i == len(parts) - 1
        else:
            return _Token(index, None)
    return _Token(index, digits, tens=tens, weak=core in _ZERO_WORDS)


def _tokens(words: Sequence[Word]) -> list[_Token]:
    tokens = [_token(i, w.text) for i, w in enumerate(words)]
    # "forty" "one": 41; "double" "four": 44; a lone "oh" or "double" is no number.
    for i, t in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        unit_next = nxt is not None and nxt.digits is not None and len(nxt.digits) == 1 and not nxt.written
        if t.tens and t.digits is not None and unit_next and nxt is not None and not nxt.weak:
            t.digits = t.digits[:-1]
        if t.repeat:
            t.digits = (nxt.digits or "") * (t.repeat - 1) if unit_next and nxt is not None else None

    def definite(j: int) -> bool:
        return (
            0 <= j < len(tokens)
            and tokens[j].digits is not None
            and not tokens[j].weak
            and not tokens[j].homophone
        )

    for i, t in enumerate(tokens):
        if t.weak and not (definite(i - 1) or definite(i + 1)):
            t.digits = None
        if t.homophone and not any(_digits_beside(tokens, i, step) >= _HOMOPHONE_RUN for step in (-1, 1)):
            t.digits = None
    return tokens


def _digits_beside(tokens: list[_Token], i: int, step: int) -> int:
    """How many digits the definite number words right before (step -1) or after (+1) token i hold."""
    count, j = 0, i + step
    while (
        0 <= j < len(tokens)
        and tokens[j].digits is not None
        and not tokens[j].weak
        and not tokens[j].homophone
    ):
        count += len(tokens[j].digits or "")
        j += step
    return count


def _runs(tokens: list[_Token]) -> list[list[_Token]]:
    """Maximal stretches of consecutive number words of one shape class (cards/SSNs: plain only)."""
    runs: list[list[_Token]] = []
    current: list[_Token] = []
    for t in tokens:
        if t.digits is not None and t.shape == "plain":
            current.append(t)
            continue
        if current:
            runs.append(current)
            current = []
        if t.digits is not None:  # a time or a date stands alone
            runs.append([t])
    if current:
        runs.append(current)
    return runs


def _digits(run: Sequence[_Token]) -> str:
    return "".join(t.digits or "" for t in run)


@dataclass(frozen=True)
class Span:
    first: int  # flat word indexes, inclusive
    last: int
    kind: Kind


def _find_card(run: list[_Token]) -> tuple[int, int] | None:
    """The longest stretch of whole words of 13-19 digits passing Luhn, earliest first (run positions)."""
    for a in range(len(run)):
        best = None
        length = 0
        for b in range(a, len(run)):
            length += len(run[b].digits or "")
            if length > 19:
                break
            if length >= 13 and luhn.is_valid(_digits(run[a : b + 1])):
                best = (a, b)
        if best is not None and run[a].digits:
            return best
    return None


def _is_ssn(run: list[_Token], tokens: list[_Token], words: Sequence[Word]) -> bool:
    digits = _digits(run)
    if len(digits) != 9 or not us_ssn.is_valid(digits):
        return False
    groups = tuple(len(t.digits or "") for t in run)
    if groups == (3, 2, 4) or (len(run) == 1 and run[0].groups == (3, 2, 4)):
        return True
    start = run[0].index
    before = words[max(0, start - CONTEXT_WORDS) : start]
    return any(_SSN_CONTEXT.match(_core(w.text)) for w in before)


def find_spans(words: Sequence[Word], kinds: frozenset[Kind]) -> list[Span]:
    """The spans to redact in `words` (several utterances' words may be passed together)."""
    if not kinds:
        return []
    tokens = _tokens(words)
    spans: list[Span] = []
    follow_until = -1  # after a card: words up to here that are short numbers are its code/expiry
    for run in _runs(tokens):
        rest = run
        while rest:
            card = _find_card(rest) if Kind.PCI in kinds and rest[0].shape == "plain" else None
            if card is not None:
                a, b = card
                if a > 0:
                    spans.extend(_other(rest[:a], tokens, words, kinds, follow_until))
                spans.append(Span(rest[a].index, rest[b].index, Kind.PCI))
                follow_until = rest[b].index + FOLLOW_WORDS
                rest = rest[b + 1 :]
                continue
            spans.extend(_other(rest, tokens, words, kinds, follow_until))
            rest = []
    return spans


def _other(
    run: list[_Token], tokens: list[_Token], words: Sequence[Word], kinds: frozenset[Kind], follow_until: int
) -> list[Span]:
    """A run that holds no card: a card's code or expiry, an SSN, or a number."""
    first, last = run[0].index, run[-1].index
    digits = _digits(run)
    if Kind.PCI in kinds and first <= follow_until and 2 <= len(digits) <= 6 and run[0].shape != "time":
        return [Span(first, last, Kind.PCI)]
    if Kind.SSN in kinds and run[0].shape == "plain" and _is_ssn(run, tokens, words):
        return [Span(first, last, Kind.SSN)]
    if Kind.NUMBERS in kinds and (any(t.written for t in run) or len(run) >= 2):
        return [Span(first, last, Kind.NUMBERS)]
    return []


def apply(words: Sequence[Word], spans: Sequence[Span]) -> list[Word]:
    """Replace each span (within one utterance) by one placeholder word with the span's times."""
    out: list[Word] = []
    by_first = {s.first: s for s in spans}
    i = 0
    while i < len(words):
        span = by_first.get(i)
        if span is None:
            out.append(words[i])
            i += 1
            continue
        covered = words[span.first : span.last + 1]
        first, last = covered[0], covered[-1]
        lead = first.text[: len(first.text) - len(first.text.lstrip())]
        trail = re.search(r"[.,?!;]*$", last.text.rstrip()).group(0)  # type: ignore[union-attr]
        probs = [w.probability for w in covered if w.probability is not None]
        out.append(
            Word(
                text=f"{lead}{span.kind.placeholder}{trail[:1]}",
                start_s=first.start_s,
                end_s=last.end_s,
                probability=sum(probs) / len(probs) if probs else None,
                part=first.part,
            )
        )
        i = span.last + 1
    return out


def redact_utterances(utterances: Sequence[Sequence[Word]], kinds: frozenset[Kind]) -> list[list[Word]]:
    """Redact adjacent utterances of one channel together (a card may run across them); each comes
    back with its own placeholders (a span across two gives each its part)."""
    flat = [w for u in utterances for w in u]
    spans = find_spans(flat, kinds)
    out = []
    offset = 0
    for u in utterances:
        end = offset + len(u)
        local = [
            Span(max(s.first, offset) - offset, min(s.last, end - 1) - offset, s.kind)
            for s in spans
            if s.first < end and s.last >= offset
        ]
        out.append(apply(u, local))
        offset = end
    return out


def redact_words(words: Sequence[Word], kinds: frozenset[Kind]) -> list[Word]:
    return redact_utterances([words], kinds)[0]


def redact_text(text: str, kinds: frozenset[Kind]) -> str:
    return join(redact_words(words_of_text(text), kinds))


def open_digit_tail(words: Sequence[Word], redacted: Sequence[Word]) -> bool:
    """True when `words` end in a run of MIN_HOLD_DIGITS digits or more that redaction left alone: it
    may be the first part of a card (or SSN) whose rest is in the next utterance."""
    if not words or not redacted or redacted[-1].text.strip().startswith("["):
        return False
    tokens = _tokens(words)
    runs = _runs(tokens)
    if not runs or runs[-1][-1].index != len(words) - 1 or runs[-1][-1].shape != "plain":
        return False
    return MIN_HOLD_DIGITS <= len(_digits(runs[-1])) < 19


# --- streaming: one channel's finals, in order ----------------------------------------------------

T = TypeVar("T")


@dataclass
class _Held(Generic[T]):
    payload: T
    words: list[Word]
    end_s: float


@dataclass
class StreamRedactor(Generic[T]):
    """One channel of a stream: redacts its finals in order, holding back a final that ends in an open
    digit run until the next one (see the module docstring). Payloads are the caller's (the result to
    send); each call returns the (payload, redacted words) ready to go out, in order."""

    kinds: frozenset[Kind]
    history: list[Word] = field(default_factory=list)  # words of finals already sent
    held: _Held[T] | None = None

    @property
    def holds_back(self) -> bool:
        return bool(self.kinds & {Kind.PCI, Kind.SSN})

    def final(self, words: Sequence[Word], payload: T, end_s: float) -> list[tuple[T, list[Word]]]:
        words = list(words)
        pending = [self.history] + ([self.held.words] if self.held else []) + [words]
        redacted = redact_utterances(pending, self.kinds)
        out: list[tuple[T, list[Word]]] = []
        if self.held is not None:
            out.append((self.held.payload, redacted[1]))
            self._remember(self.held.words)
            self.held = None
        if self.holds_back and open_digit_tail(words, redacted[-1]):
            self.held = _Held(payload, words, end_s)
        else:
            out.append((payload, redacted[-1]))
            self._remember(words)
        return out

    def release(self) -> list[tuple[T, list[Word]]]:
        """Send what is held as it stands (no next utterance is coming, or it waited long enough)."""
        if self.held is None:
            return []
        held, self.held = self.held, None
        redacted = redact_utterances([self.history, held.words], self.kinds)[1]
        self._remember(held.words)
        return [(held.payload, redacted)]

    def release_if_stale(self, heard_s: float) -> list[tuple[T, list[Word]]]:
        """Release the held final once HOLD_AUDIO_S of audio was heard after it (the caller checks that
        no next utterance of the channel is on its way)."""
        if self.held is not None and heard_s - self.held.end_s >= HOLD_AUDIO_S:
            return self.release()
        return []

    def interim(self, words: Sequence[Word]) -> list[Word]:
        """An interim (changes nothing): redacted in the context of what came before it, and an open digit
        tail masked as if it were the start of a card, since the digits after it are not heard yet."""
        words = list(words)
        before = self.history + (self.held.words if self.held else [])
        redacted = redact_utterances([before, words], self.kinds)[1]
        if self.holds_back and open_digit_tail(words, redacted):
            tail = _runs(_tokens(words))[-1]
            kind = Kind.PCI if Kind.PCI in self.kinds else Kind.SSN
            masked = apply(words, [Span(tail[0].index, tail[-1].index, kind)])
            redacted = redact_utterances([before, masked], self.kinds)[1]
        return redacted

    def for_log(self, words: Sequence[Word]) -> str:
        """The text to log for a final as it settles, before a held final's fate is known: as an interim."""
        return join(self.interim(words))

    def _remember(self, words: list[Word]) -> None:
        self.history = (self.history + words)[-HISTORY_WORDS:]
