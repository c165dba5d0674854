"""Redaction of payment cards, social security numbers and numbers in transcripts (pure functions).

Whisper writes the same spoken digits as "four one one one", "4111", "4-1-1-1", "41, 11" or "0.041" from
one utterance to the next, and mishears some of them, so redaction never relies on a perfect transcript.
Every word is first normalised to the digits it stands for: written digits of any script (ASCII,
Arabic-Indic, full-width, ...: Unicode NFKC, then each decimal digit's value) however punctuated inside the
word ("4111-1111", "0.033", "4,810"); spoken ones ("oh"/"zero"/"nought" are 0, "double four" is 44, "forty
one" is 41, "hundred" 00, and Whisper's "for"/"to"/"free" when right beside three digits or more). A *run*
is a stretch of number words, bridged by up to MAX_FILLERS filler words ("4111 1111, uh, 1111 1111";
uh, um, er, sorry, dash, ...: FILLERS); times of day ("10:30") and dates ("04/27") stand alone. A
*cluster* is runs at most CLUSTER_GAP_WORDS words apart.

PCI (payment cards; rule applied in this order, first match wins):
1. a run whose cluster holds LONG_RUN_DIGITS (12) digits or more, whatever the context, Luhn or no Luhn
   (a card read with one digit misheard, a digit dropped or doubled, decimals, fillers);
2. (SSN, when asked, comes here: a valid SSN stays [SSN] even beside the word "number")
3. any run of CONTEXT_MIN_DIGITS (2) digits or more in a *card context*: a card word (CARD_WORDS: card,
   credit, debit, visa, mastercard, amex, number, expiry, cvv, security code, ...) or a run masked by
   rule 1 (a card) within CONTEXT_BEFORE_WORDS (20) words before the run, or a card word within
   CONTEXT_AFTER_WORDS (6) words after it ("... is my Visa"): a card with several digits misheard, a
   partial card, its expiry date and security code. Times of day are never PCI.
Masking too much is preferred to leaking: with PCI on, an order, phone or account number near the word
"number" is masked as [PCI] too, and so is any 12-digit stretch.
SSN: nine digits that are a valid US SSN by its structure (stdnum.us.ssn), written 3-2-4
("123-45-6789"), or spoken in context ("social", "security", "SSN" within SSN_CONTEXT_WORDS before).
NUMBERS: every other run with a written digit, or of two number words or more (a lone "one" in "one
moment" is no number to hide).
Each span becomes one word, `[PCI]`, `[SSN]` or `[NUMBER]`, that keeps the span's start, end and mean
probability.

A card read out slowly is split over several utterances ("4111" pause "1111" pause ...), and a final
already sent cannot be unsent. The policy (StreamRedactor): when PCI or SSN is asked for, a final that
ends in an open digit cluster (an unmasked run, followed by at most CLUSTER_GAP_WORDS words, whose
cluster holds MIN_HOLD_DIGITS (3) digits or more) is held back; the next final either continues that
cluster (then it is held too, up to MAX_HELD_FINALS (4) finals) or not, and then every held final goes
out, all redacted together, so the digits of all of them count as one cluster. A held final also goes out
once HOLD_AUDIO_S (6 s) of audio passed with no next utterance, or when the stream ends. Words of the
finals already sent stay as context (HISTORY_WORDS), so a continuation, or the code after a card, that
comes later is still redacted. Interims (and log text) mask an open cluster as if it were a card's
start (from INTERIM_TAIL_DIGITS (2) digits: the utterance goes on after an interim), and, while an
earlier utterance's final is still being transcribed, the digits they begin with. What can still leave: digits out of any card context whose cluster stays under 12 digits (a phone
number, an order number), a first part of 1-2 digits (not held), and what a fifth held final's cluster
pushes out before its end (never a whole card: the oldest held final is then redacted with all later
ones as context).

Library choice: presidio-analyzer installs from PyPI, but its AnalyzerEngine loads a spaCy model
(en_core_web_lg) that is published only on GitHub, not on PyPI (only third-party re-uploads are), so it
cannot be installed offline here; and what it would bring for cards and SSNs is a regular expression over
written digits plus a Luhn check, which is what misses a misheard card. It knows nothing of spoken
digits, of word times, or of a number split across utterances, which is the work here. We use
python-stdnum (well kept) for the SSN structure rules, and keep the normalisation, which must stay aligned
with word times, here. Names and addresses are out of scope (issue 14 makes them optional).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from stdnum.us import ssn as us_ssn

from service.vocabulary.redaction import Kind

LONG_RUN_DIGITS = 12  # a cluster of this many digits is PCI in any context (a card has 13-19)
CLUSTER_GAP_WORDS = 3  # runs at most this many other words apart count their digits together
MAX_FILLERS = 2  # filler words in a row that a run bridges ("4111, uh, sorry, 1111")
CONTEXT_MIN_DIGITS = 2  # in a card context, a run of this many digits is PCI
CONTEXT_BEFORE_WORDS = 20  # a card word this many words before a run (the card's code and expiry follow it)
CONTEXT_AFTER_WORDS = 6  # "4111 ... is my Visa"
SSN_CONTEXT_WORDS = 12  # "social security number is ..." within this many words before nine digits
HISTORY_WORDS = 40  # words of finals already sent kept as context for the next ones
MIN_HOLD_DIGITS = 3  # a final ending in this many digits or more may be the first part of a card
INTERIM_TAIL_DIGITS = 2  # an interim ending in this many digits masks them (its utterance goes on)
MAX_HELD_FINALS = 4  # finals held at once while their digits keep forming one cluster (a card in 4 groups)
HOLD_AUDIO_S = 6.0  # a held final goes out once this much audio passed with no next utterance


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
    "zero": 0, "oh": 0, "o": 0, "nought": 0, "naught": 0, "one": 1, "two": 2, "three": 3, "four": 4,
    "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
}  # fmt: skip
_TEENS = {
    "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
    "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19,
}  # fmt: skip
_TENS = {
    "twenty": 2, "thirty": 3, "forty": 4, "fourty": 4, "fifty": 5, "sixty": 6, "seventy": 7,
    "eighty": 8, "ninety": 9,
}  # fmt: skip
# "forty one hundred": digits as read out; the count matters for masking, not the value
_SCALES = {"hundred": "00", "thousand": "000"}
_REPEAT = {"double": 2, "triple": 3}
_WEAK = {"oh", "o", *_SCALES}  # numbers only next to other digits ("oh, I see", "a hundred times")
# Whisper writes "four one one one" as "for one one one" at times ("free" for three, "to" for two):
# these count only right next to three digits or more.
_HOMOPHONES = {"for": "4", "to": "2", "too": "2", "free": "3"}
_HOMOPHONE_RUN = 3
FILLERS = frozenset(
    {
        "uh", "uhh", "uhm", "um", "umm", "er", "err", "erm", "ah", "ahh", "eh", "hm", "hmm", "mm", "mhm",
        "sorry", "oops", "dash", "hyphen", "space", "slash", "dot", "point", "comma",
    }
)  # fmt: skip
CARD_WORDS = frozenset(
    {
        "card", "cards", "credit", "debit", "visa", "mastercard", "master", "amex", "american", "discover",
        "maestro", "jcb", "diners", "unionpay", "number", "numbers", "digits", "account", "expiry",
        "expiration", "expires", "expire", "expiring", "exp", "valid", "cvv", "cvv2", "cvc", "cvc2", "cv2",
        "csc", "cid", "security", "code", "pin",
    }
)  # fmt: skip
_PUNCT = "\"'“”‘’()[]{}<>.,;:!?…-‐‑‒–—―"
_SSN_CONTEXT = re.compile(r"^(social|security|ssn|s\.s\.n)$")
_TIME = re.compile(r"\d{1,2}:\d\d(?::\d\d)?")
_DATE = re.compile(r"\d{1,2}/\d{2}(?:\d{2})?|\d{1,2}/\d{1,2}/\d{2}(?:\d{2})?")
_SPLIT = re.compile(r"[-‐‑‒–—―]")


@dataclass
class _Token:
    index: int  # in the flat word list
    digits: str | None  # None: not a number
    written: bool = False  # digits as digits (not words)
    shape: str = "plain"  # "time" (10:30) and "date" (04/27) stand alone
    groups: tuple[int, ...] = ()  # written digit groups' lengths ("123-45-6789": 3, 2, 4)
    weak: bool = False  # "oh", "hundred": a number only next to another
    homophone: bool = False  # "for": a number only next to three others
    tens: bool = False  # "forty": "4" before a unit word, "40" otherwise
    repeat: int = 0  # "double": repeats the next unit word
    filler: bool = False  # "uh": a run may go on across it
    card_word: bool = False  # "card", "expiry": puts nearby digits in a card context


def _normalise(text: str) -> str:
    """Compatibility forms folded (full-width, superscripts), every decimal digit of any script as ASCII."""
    text = unicodedata.normalize("NFKC", text)
    return "".join(str(unicodedata.decimal(c)) if c.isdecimal() else c for c in text)


def _core(text: str) -> str:
    core = _normalise(text).strip().strip(_PUNCT).lower()
    return core[:-2] if core.endswith("'s") else core


def _written(core: str) -> bool:
    """Digits, whatever punctuation or symbols sit between or around them ("4,810", "0.033", "$5", "#12")."""
    return any(c.isdigit() for c in core) and all(
        c.isdigit() or unicodedata.category(c)[0] in "PS" for c in core
    )


def _token(index: int, text: str) -> _Token:
    core = _core(text)
    if _written(core):
        bare = core.strip("".join(c for c in core if not c.isdigit() and c not in "-:/.,"))
        shape = "time" if _TIME.fullmatch(bare) else "date" if _DATE.fullmatch(bare) else "plain"
        groups = tuple(len(g) for g in re.findall(r"\d+", core))
        return _Token(index, re.sub(r"\D", "", core), written=True, shape=shape, groups=groups)
    if core in _REPEAT:
        return _Token(index, "", repeat=_REPEAT[core])
    if core in _HOMOPHONES:
        return _Token(index, _HOMOPHONES[core], homophone=True)
    if core in FILLERS:
        return _Token(index, None, filler=True)
    if core in CARD_WORDS:
        return _Token(index, None, card_word=True)
    parts = _SPLIT.split(core)
    digits = ""
    tens = False
    for i, part in enumerate(parts):  # "forty-one", "one-one-one-one", "four-1-1"
        if part.isdigit():
            digits += part
        elif part in _UNITS:
            digits += str(_UNITS[part])
        elif part in _TEENS:
            digits += str(_TEENS[part])
        elif part in _SCALES:
            digits += _SCALES[part]
        elif part in _TENS:
            following_unit = i + 1 < len(parts) and parts[i + 1] in _UNITS and parts[i + 1] not in _WEAK
            digits += str(_TENS[part]) + ("" if following_unit else "0")
            tens = i == len(parts) - 1
        else:
            return _Token(index, None)
    return _Token(index, digits, tens=tens, weak=core in _WEAK)


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
        return 0 <= j < len(tokens) and _definite(tokens[j])

    # A weak word is a number next to a definite one, or next to a weak one that is ("one oh oh oh nine").
    anchored = [definite(i - 1) or definite(i + 1) for i in range(len(tokens))]
    for order in (range(len(tokens)), reversed(range(len(tokens)))):
        for i in order:
            if tokens[i].weak and tokens[i].digits is not None and not anchored[i]:
                anchored[i] = any(
                    0 <= j < len(tokens) and tokens[j].weak and anchored[j] for j in (i - 1, i + 1)
                )
    for i, t in enumerate(tokens):
        if t.weak and not anchored[i]:
            t.digits = None
        if t.homophone and not any(_digits_beside(tokens, i, step) >= _HOMOPHONE_RUN for step in (-1, 1)):
            t.digits = None
    return tokens


def _definite(t: _Token) -> bool:
    """A number word that is a number whatever its neighbours (a time or a date is no card's neighbour)."""
    return t.digits is not None and not t.weak and not t.homophone and t.shape == "plain"


def _digits_beside(tokens: list[_Token], i: int, step: int) -> int:
    """How many digits the definite number words right before (step -1) or after (+1) token i hold."""
    count, j = 0, i + step
    while 0 <= j < len(tokens) and _definite(tokens[j]):
        count += len(tokens[j].digits or "")
        j += step
    return count


@dataclass
class _Run:
    """Number words (their tokens) and, between them, at most MAX_FILLERS fillers at a time."""

    tokens: list[_Token]

    @property
    def first(self) -> int:
        return self.tokens[0].index

    @property
    def last(self) -> int:
        return self.tokens[-1].index

    @property
    def digits(self) -> str:
        return "".join(t.digits or "" for t in self.tokens)

    @property
    def shape(self) -> str:
        return self.tokens[0].shape


def _runs(tokens: list[_Token]) -> list[_Run]:
    """Maximal runs of plain number words (bridging fillers); a time or a date is a run of its own."""
    runs: list[_Run] = []
    current: list[_Token] = []
    fillers = 0
    for t in tokens:
        if t.digits is not None and t.shape == "plain":
            current.append(t)
            fillers = 0
            continue
        if t.filler and current and fillers < MAX_FILLERS:
            fillers += 1
            continue
        if current:
            runs.append(_Run(current))
            current, fillers = [], 0
        if t.digits is not None:  # a time or a date stands alone
            runs.append(_Run([t]))
    if current:
        runs.append(_Run(current))
    return runs


def _cluster_digits(runs: list[_Run]) -> list[int]:
    """For each run: the digits of its cluster (plain runs at most CLUSTER_GAP_WORDS words apart)."""
    out = [0] * len(runs)
    i = 0
    while i < len(runs):
        j = i
        while (
            j + 1 < len(runs)
            and runs[j].shape == runs[j + 1].shape == "plain"
            and runs[j + 1].first - runs[j].last - 1 <= CLUSTER_GAP_WORDS
        ):
            j += 1
        total = sum(len(r.digits) for r in runs[i : j + 1] if r.shape == "plain")
        for k in range(i, j + 1):
            out[k] = total if runs[k].shape == "plain" else len(runs[k].digits)
        i = j + 1
    return out


@dataclass(frozen=True)
class Span:
    first: int  # flat word indexes, inclusive
    last: int
    kind: Kind


def _is_ssn(run: _Run, words: Sequence[Word]) -> bool:
    digits = run.digits
    if run.shape != "plain" or len(digits) != 9 or not us_ssn.is_valid(digits):
        return False
    groups = tuple(len(t.digits or "") for t in run.tokens)
    if groups == (3, 2, 4) or (len(run.tokens) == 1 and run.tokens[0].groups == (3, 2, 4)):
        return True
    before = words[max(0, run.first - SSN_CONTEXT_WORDS) : run.first]
    return any(_SSN_CONTEXT.match(_core(w.text)) for w in before)


def find_spans(words: Sequence[Word], kinds: frozenset[Kind]) -> list[Span]:
    """The spans to redact in `words` (several utterances' words may be passed together), by the rules
    of the module docstring, in order."""
    if not kinds:
        return []
    tokens = _tokens(words)
    runs = _runs(tokens)
    clusters = _cluster_digits(runs)
    card_words = [t.index for t in tokens if t.card_word]
    spans: list[Span] = []
    last_pci = -(10**9)  # the end of the latest long PCI run (a card): its code and expiry follow it

    def card_context(run: _Run) -> bool:
        return run.first - last_pci - 1 <= CONTEXT_BEFORE_WORDS or any(
            run.first - CONTEXT_BEFORE_WORDS <= i <= run.last + CONTEXT_AFTER_WORDS for i in card_words
        )

    for run, cluster in zip(runs, clusters, strict=True):
        kind: Kind | None = None
        if Kind.PCI in kinds and run.shape == "plain" and cluster >= LONG_RUN_DIGITS:
            kind = Kind.PCI
        elif Kind.SSN in kinds and _is_ssn(run, words):
            kind = Kind.SSN
        elif (
            Kind.PCI in kinds
            and run.shape != "time"
            and len(run.digits) >= CONTEXT_MIN_DIGITS
            and card_context(run)
        ):
            kind = Kind.PCI
        elif Kind.NUMBERS in kinds and (any(t.written for t in run.tokens) or len(run.tokens) >= 2):
            kind = Kind.NUMBERS
        if kind is not None:
            spans.append(Span(run.first, run.last, kind))
            if kind is Kind.PCI and cluster >= LONG_RUN_DIGITS:
                last_pci = run.last
    return spans


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
        spoken = last.text.rstrip()
        trail = spoken[len(spoken.rstrip(".,?!;")) :]  # not a regex search: quadratic on a run of dots
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


def _local(spans: Sequence[Span], offset: int, end: int) -> list[Span]:
    """The parts of `spans` that fall in words[offset:end], indexed from offset."""
    return [
        Span(max(s.first, offset) - offset, min(s.last, end - 1) - offset, s.kind)
        for s in spans
        if s.first < end and s.last >= offset
    ]


def redact_utterances(utterances: Sequence[Sequence[Word]], kinds: frozenset[Kind]) -> list[list[Word]]:
    """Redact adjacent utterances of one channel together (a card may run across them); each comes
    back with its own placeholders (a span across two gives each its part)."""
    flat = [w for u in utterances for w in u]
    spans = find_spans(flat, kinds)
    out = []
    offset = 0
    for u in utterances:
        end = offset + len(u)
        out.append(apply(u, _local(spans, offset, end)))
        offset = end
    return out


def redact_words(words: Sequence[Word], kinds: frozenset[Kind]) -> list[Word]:
    return redact_utterances([words], kinds)[0]


def redact_text(text: str, kinds: frozenset[Kind]) -> str:
    return join(redact_words(words_of_text(text), kinds))


def open_cluster(
    words: Sequence[Word], start: int, kinds: frozenset[Kind], min_digits: int = MIN_HOLD_DIGITS
) -> Span | None:
    """The cluster that `words` end in, if it may be the first part of a card (or SSN) whose rest is in
    the next utterance: its last run reaches word `start` or beyond, followed by at most CLUSTER_GAP_WORDS
    words, unmasked, and the cluster holds `min_digits` digits or more (fewer than LONG_RUN_DIGITS:
    those are masked already). The span covers the whole cluster, from its first run (which may lie
    before `start`)."""
    runs = [r for r in _runs(_tokens(words)) if r.shape == "plain"]
    if not runs or runs[-1].last < start or len(words) - 1 - runs[-1].last > CLUSTER_GAP_WORDS:
        return None
    first = len(runs) - 1
    while first > 0 and runs[first].first - runs[first - 1].last - 1 <= CLUSTER_GAP_WORDS:
        first -= 1
    cluster = runs[first:]
    tail = cluster[-1]
    if any(s.first <= tail.last and s.last >= tail.first for s in find_spans(words, kinds)):
        return None
    if sum(len(r.digits) for r in cluster) < min_digits:
        return None
    return Span(cluster[0].first, tail.last, Kind.PCI if Kind.PCI in kinds else Kind.SSN)


def leading_cluster(words: Sequence[Word], kinds: frozenset[Kind]) -> list[Span]:
    """The cluster `words` begin with (its first run within CLUSTER_GAP_WORDS of the start), as one span:
    what may continue a number the words before them ended in."""
    runs = [r for r in _runs(_tokens(words)) if r.shape == "plain"]
    if not runs or runs[0].first > CLUSTER_GAP_WORDS:
        return []
    last = 0
    while last + 1 < len(runs) and runs[last + 1].first - runs[last].last - 1 <= CLUSTER_GAP_WORDS:
        last += 1
    return [Span(runs[0].first, runs[last].last, Kind.PCI if Kind.PCI in kinds else Kind.SSN)]


def _merge(spans: Sequence[Span]) -> list[Span]:
    """Overlapping spans as one (PCI wins over the kinds it covers)."""
    out: list[Span] = []
    for s in sorted(spans, key=lambda s: (s.first, s.last)):
        if out and s.first <= out[-1].last:
            prev = out[-1]
            kind = Kind.PCI if Kind.PCI in (prev.kind, s.kind) else prev.kind
            out[-1] = Span(prev.first, max(prev.last, s.last), kind)
        else:
            out.append(s)
    return out


# --- streaming: one channel's finals, in order ----------------------------------------------------

T = TypeVar("T")


@dataclass
class _Held(Generic[T]):
    payload: T
    words: list[Word]
    end_s: float


@dataclass
class StreamRedactor(Generic[T]):
    """One channel of a stream: redacts its finals in order, holding back finals that end in an open
    digit cluster until the cluster is over (see the module docstring). Payloads are the caller's (the
    result to send); each call returns the (payload, redacted words) ready to go out, in order."""

    kinds: frozenset[Kind]
    history: list[Word] = field(default_factory=list)  # words of finals already sent
    held: list[_Held[T]] = field(default_factory=list)  # finals held back, oldest first

    @property
    def holds_back(self) -> bool:
        return bool(self.kinds & {Kind.PCI, Kind.SSN})

    def final(self, words: Sequence[Word], payload: T, end_s: float) -> list[tuple[T, list[Word]]]:
        self.held.append(_Held(payload, list(words), end_s))
        return self._settle()

    def release(self) -> list[tuple[T, list[Word]]]:
        """Send what is held as it stands (no next utterance is coming, or it waited long enough)."""
        return self._settle(release_all=True)

    def release_if_stale(self, heard_s: float) -> list[tuple[T, list[Word]]]:
        """Release the held finals once HOLD_AUDIO_S of audio was heard after the last (the caller checks
        that no next utterance of the channel is on its way)."""
        if self.held and heard_s - self.held[-1].end_s >= HOLD_AUDIO_S:
            return self.release()
        return []

    def _settle(self, *, release_all: bool = False) -> list[tuple[T, list[Word]]]:
        """Send every held final that the digits of an open cluster do not reach into (all of them
        when the chain ends in no open cluster), redacted with everything heard as context."""
        flat = [w for h in self.held for w in h.words]
        keep = 0
        if self.holds_back and not release_all:
            open_at = open_cluster([*self.history, *flat], len(self.history), self.kinds)
            if open_at is not None:
                offset = len(self.history)
                for i, h in enumerate(self.held):
                    if offset + len(h.words) > open_at.first:
                        keep = len(self.held) - i
                        break
                    offset += len(h.words)
                keep = min(keep, MAX_HELD_FINALS)
        ready, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        if not ready:
            return []
        redacted = redact_utterances(
            [self.history, *(h.words for h in ready), *(h.words for h in self.held)], self.kinds
        )
        out = [(h.payload, redacted[1 + i]) for i, h in enumerate(ready)]
        for h in ready:
            self._remember(h.words)
        return out

    def interim(self, words: Sequence[Word], *, after_unknown: bool = False) -> list[Word]:
        """An interim (changes nothing): redacted in the context of what came before it, and an open digit
        cluster masked as if it were the start of a card, since the digits after it are not heard yet.
        `after_unknown`: an earlier utterance's final is not in yet, so digits the interim begins with
        may continue digits that one ends in: they are masked too."""
        words = list(words)
        before = self.history + [w for h in self.held for w in h.words]
        flat = [*before, *words]
        spans = _local(find_spans(flat, self.kinds), len(before), len(flat))
        if self.holds_back:
            # An interim's own utterance goes on after it: a tail of two digits may grow into a card.
            open_at = open_cluster(flat, len(before), self.kinds, min_digits=INTERIM_TAIL_DIGITS)
            if open_at is not None:
                spans += _local([open_at], len(before), len(flat))
            if after_unknown:
                spans += leading_cluster(words, self.kinds)
        return apply(words, _merge(spans))

    def for_log(self, words: Sequence[Word]) -> str:
        """The text to log for a final as it settles, before a held final's fate is known: as an interim."""
        return join(self.interim(words))

    def _remember(self, words: list[Word]) -> None:
        self.history = (self.history + words)[-HISTORY_WORDS:]
