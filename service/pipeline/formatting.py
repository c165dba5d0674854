"""Smart formatting of English finals: spoken numbers written as digits, word timings kept (pure functions).

Whisper writes most numbers as digits itself, but now and then spells them out ("the order number one two
three four five six", "call you back in ten minutes"), and a call-center integrator wants one form.
`format_transcript(text, words)` rewrites spelled-out numbers and leaves everything else as it was: words
that are no number, numbers Whisper already wrote as digits, punctuation and case.

Rules, over runs of number words (consecutive, with no punctuation between them):

- digit sequences: two digits or more spoken one by one, "oh" and "zero" as 0, "double"/"triple" repeating
  the next digit: "four five seven two one" -> "45721", "nine oh two one oh" -> "90210", "double four" ->
  "44". Three or more spoken groups of up to two digits each are read out digits too ("five five five
  twelve thirty four" -> "5551234").
- digits read out one by one that Whisper separates with commas alone, four or more: "two, one, two,
  five, five" -> "21255". Fewer stay words ("one, two, three" may be counting).
- phone numbers: digit sequences spoken in groups that Whisper separates with commas or dashes, in the
  NANP shapes 3-4, 3-3-4 and 1-3-3-4: "two one two, five five five, zero one nine eight" ->
  "212-555-0198". Other groupings (a card's 4-4-4-4) stay separate numbers.
- cardinals, ordinals and decimals (parsed by text2num): digits when the number is 10 or more, or said in
  more than one word, or followed by a unit below: "twenty three people" -> "23 people", "the twenty
  first" -> "the 21st", "three point five" -> "3.5". A lone number word below 10 stays a word, as style
  guides write it and so that "one of the", "no one", "a second" or "the first time" are left alone.
- amounts: a number followed by dollars/bucks, pounds or euros takes the currency sign, and "and N cents"
  after it the decimals: "twenty five dollars" -> "$25", "forty two dollars and fifty cents" -> "$42.50",
  "a hundred dollars" -> "$100"; percent: "fifteen percent" -> "15%"; "N cents" -> "N cents".
- years and times: two numbers where the first is 19 or 20 (or 10-18 right after a month) read as a year,
  "nineteen ninety nine" -> "1999", "twenty twenty four" -> "2024", "nineteen oh five" -> "1905"; hour and
  minutes after "at", "by", "around", "until", "from"..., or before "a.m."/"p.m.", read as a time, "at three
  thirty" -> "at 3:30".
- dates: a day after a month becomes its number, "June second" -> "June 2", "March third, twenty twenty
  four" -> "March 3, 2024"; "the fifth of May" -> "the 5th of May" (May and March only capitalised, as
  Whisper writes the months).

Each rewritten run becomes one word that keeps the first word's start, the last word's end, the lowest
confidence of its words (and the first word's other fields, such as its segment), with the first word's
leading space and the last word's trailing punctuation: [" twenty", " five", " dollars."] -> [" $25."].

Library choice. nemo_text_processing (NVIDIA's inverse text normalization, the one Riva ships) installs
here with pynini (413 MB of OpenFst libraries) and works offline after compiling its grammars (13-20 s at
first start, cached), but it gives no word alignment (its fst_alignment helper is a heuristic that fails
on reordering, which is what "$25" is), and on Whisper's cased, punctuated text it wrote "Twenty five
dollars." as "Twenty $5 ." and "the first time" as "the 1st time". wetextprocessing is built on the same
pynini; whisper-normalizer's number normaliser lowercases and strips punctuation (it serves WER). text2num
(Allo-Media, maintained, a small Rust wheel with no dependencies) parses English numbers over a sequence of
tokens and returns each number's token span, exactly what keeping word timings needs; it does not format
amounts, dates, phone numbers or digit strings, so those rules are this module's small grammar on top.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from text_to_num import find_numbers


class FormattableWord(Protocol):
    """A word as service/pipeline/redaction.py's Word has it: a dataclass with these fields (text with its leading
    space, as Whisper writes it); a rewritten word is the first word of its run with `text`, `end_s` and
    `probability` replaced, so its other fields (the segment it belongs to) are kept."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def text(self) -> str: ...
    @property
    def start_s(self) -> float | None: ...
    @property
    def end_s(self) -> float | None: ...
    @property
    def probability(self) -> float | None: ...


W = TypeVar("W", bound=FormattableWord)


@dataclass(frozen=True)
class _PlainWord:
    text: str
    start_s: float | None = None
    end_s: float | None = None
    probability: float | None = None


def format_transcript(text: str, words: Sequence[W]) -> tuple[str, list[W]]:
    """SMART formatting of one final: its transcript and its words, each formatted by the same rules (so
    they agree whenever the words spell the transcript, as the engine's words do)."""
    return format_text(text), format_words(words)


def format_text(text: str) -> str:
    """The transcript alone (no word timings)."""
    words = [_PlainWord(m.group(0)) for m in re.finditer(r"\s*\S+", text)]
    return "".join(w.text for w in format_words(words)) + text[len(text.rstrip()) :]


def format_words(words: Sequence[W]) -> list[W]:
    """The words with spelled-out numbers rewritten; a rewritten run of words is one word."""
    tokens = [_Token.of(w.text) for w in words]
    out: list[W] = []
    i = 0
    for start, end, new in _rewrites(tokens):
        out += words[i:start]
        first, last = words[start], words[end - 1]
        probabilities = [w.probability for w in words[start:end] if w.probability is not None]
        out.append(
            dataclasses.replace(
                first,
                text=tokens[start].lead + new + tokens[end - 1].trail,
                end_s=last.end_s,
                probability=min(probabilities) if probabilities else None,
            )
        )
        i = end
    return out + list(words[i:])


# --- tokens ------------------------------------------------------------------------------------------

_UNITS = {"zero", "oh", "o", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"}
_NUMBER_WORDS = _UNITS | {
    "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety",
    "hundred", "thousand", "million", "billion", "trillion", "and", "point",
    "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
    "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
    "eighteenth", "nineteenth", "twentieth", "thirtieth", "fortieth", "fiftieth", "sixtieth",
    "seventieth", "eightieth", "ninetieth", "hundredth", "thousandth", "millionth",
}  # fmt: skip
_SCALES = {"hundred", "thousand", "million", "billion", "trillion"}
_REPEAT = {"double": 2, "triple": 3}
_CURRENCY = {
    "dollar": "$", "dollars": "$", "buck": "$", "bucks": "$", "pound": "£", "pounds": "£", "euro": "€",
    "euros": "€",
}  # fmt: skip
_CENTS = {"cent", "cents"}
_PERCENT = {"percent"}
_MERIDIEM = {"am", "pm", "a.m", "p.m"}
_TIME_BEFORE = {"at", "by", "around", "until", "till", "from", "before", "after", "about"}
_MONTHS = {
    "january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
    "november", "december",
}  # fmt: skip
_CAPITALISED_MONTHS = {"may", "march"}  # also verbs: months only as Whisper writes them, capitalised
_SEPARATORS = set(",.;:!?…-–—")  # punctuation that ends a run of number words
_GROUP_JOINERS = {",", "-"}  # how Whisper separates the groups of a phone number
_PHONE_SHAPES = {(3, 4), (3, 3, 4), (1, 3, 3, 4)}
_MIN_COMMA_DIGITS = 4  # "two, one, two, five" is a number read out; "one, two, three" may be counting
_OPENERS = "\"'“‘(["
_CLOSERS = "\"'”’)].,;:!?…-–—"
_DIGIT = re.compile(r"^\d$")


def split_word(text: str) -> tuple[str, str, str]:
    """Leading space and opening punctuation, the word, its closing punctuation. By stripping, not a
    regex: a lazy core before a trailing class backtracks quadratically on a word of many dots."""
    stripped = text.lstrip()
    body = stripped.lstrip(_OPENERS)
    lead = text[: len(text) - len(body)]
    core = body.rstrip(_CLOSERS)
    return lead, core, body[len(core) :]


@dataclass(frozen=True)
class _Token:
    lead: str  # leading space and opening punctuation
    core: str
    trail: str  # closing punctuation
    norm: str  # core lowercased, without the dots of "a.m."

    @classmethod
    def of(cls, text: str) -> _Token:
        lead, core, trail = split_word(text)
        if core.lower() in ("a.m", "p.m") and trail.startswith("."):  # "p.m." keeps its last dot
            core, trail = core + ".", trail[1:]
        return cls(lead, core, trail, core.lower().rstrip("."))

    @property
    def separated(self) -> bool:
        """Punctuation after this word: a pause Whisper heard, which ends a run."""
        return any(c in _SEPARATORS for c in self.trail)

    @property
    def spelled_digit(self) -> bool:
        return self.norm in _UNITS

    @property
    def month(self) -> bool:
        return self.norm in _MONTHS and (self.norm not in _CAPITALISED_MONTHS or self.core[:1].isupper())


@dataclass(frozen=True)
class _Number:
    """One number found among the tokens: tokens [start, end)."""

    start: int
    end: int
    text: str  # digits as text2num writes them ("04", "21st", "3.5")
    value: float
    ordinal: bool = False
    digits: bool = False  # spoken digit by digit (unit words, "oh", "double"), or a written digit
    written: bool = False  # a digit Whisper wrote itself

    @property
    def integer(self) -> bool:
        return not self.ordinal and self.text.isdigit()

    @property
    def words(self) -> int:
        return self.end - self.start

    @property
    def plain(self) -> str:
        """Digits without an ordinal suffix."""
        return re.sub(r"(st|nd|rd|th)$", "", self.text)


class _Text2NumToken:
    """text2num's Token protocol over one word (lowercased; "oh" already "zero" where it is one)."""

    def __init__(self, word: str) -> None:
        self.word = word

    def text(self) -> str:
        return self.word

    def nt_separated(self, previous: object) -> bool:
        return False

    def not_a_number_part(self) -> bool:
        return False


def _numbers(tokens: Sequence[_Token]) -> list[_Number]:
    """Every spelled-out number, and every lone written digit (they can join a spoken digit sequence)."""
    words = []
    for i, t in enumerate(tokens):
        word = t.norm
        if word in ("oh", "o"):
            # zero after a number word ("nine oh two", "nineteen oh five"), or before two digit words
            # ("oh four five"); not in "oh, one more thing"
            prev = tokens[i - 1] if i else None
            before = prev is not None and prev.norm in _NUMBER_WORDS - {"and", "point"} and not prev.separated
            nxt = tokens[i + 1 : i + 3]
            after = (
                len(nxt) == 2 and all(x.spelled_digit for x in nxt) and not (t.separated or nxt[0].separated)
            )
            word = "zero" if before or after else word
        words.append(word)
    found: list[_Number] = []
    chunk = 0
    for i in range(len(tokens) + 1):  # each stretch between pauses parsed on its own
        if i == len(tokens) or tokens[i].separated:
            end = min(i + 1, len(tokens))
            for o in find_numbers([_Text2NumToken(w) for w in words[chunk:end]], "en", 0.0):
                start, stop = chunk + o.start, chunk + o.end
                span = words[start:stop]
                if all(part in _NUMBER_WORDS for w in span for part in w.split("-")):  # not "ones"
                    found.append(
                        _Number(start, stop, o.text, o.value, o.is_ordinal, all(w in _UNITS for w in span))
                    )
            chunk = end
    found += [
        _Number(i, i + 1, t.core, float(t.core), digits=True, written=True)
        for i, t in enumerate(tokens)
        if _DIGIT.match(t.core)
    ]
    found.sort(key=lambda n: n.start)
    return _with_repeats_and_a(found, tokens)


def _with_repeats_and_a(numbers: list[_Number], tokens: Sequence[_Token]) -> list[_Number]:
    """Numbers with the word before them that belongs to them: "double four" is 44, and "a hundred" is
    100 with its "a"."""
    out = []
    for n in numbers:
        before = tokens[n.start - 1] if n.start else None
        if before and not before.separated and before.norm in _REPEAT and n.digits and len(n.text) == 1:
            n = dataclasses.replace(n, start=n.start - 1, text=n.text * _REPEAT[before.norm])
        elif before and not before.separated and before.norm == "a" and _words_at(tokens, n)[0] in _SCALES:
            n = dataclasses.replace(n, start=n.start - 1)
        out.append(n)
    return out


def _words_at(tokens: Sequence[_Token], n: _Number) -> list[str]:
    return [t.norm for t in tokens[n.start : n.end]]


def _runs(numbers: list[_Number], tokens: Sequence[_Token]) -> list[list[_Number]]:
    """Numbers that follow each other with no other word and no pause between them."""
    runs: list[list[_Number]] = []
    for n in numbers:
        if runs and runs[-1][-1].end == n.start and not tokens[n.start - 1].separated:
            runs[-1].append(n)
        else:
            runs.append([n])
    return runs


# --- rules -------------------------------------------------------------------------------------------


@dataclass
class _Rewrite:
    start: int
    end: int
    text: str
    digit_string: bool = False  # a digit sequence (may join others into a phone number)
    number: _Number | None = None  # a single number (may take a currency or percent sign)


def _rewrites(tokens: Sequence[_Token]) -> list[tuple[int, int, str]]:
    numbers = _numbers(tokens)
    rewrites: list[_Rewrite] = []
    for runs in _comma_digits(_runs(numbers, tokens), tokens):
        if len(runs) >= _MIN_COMMA_DIGITS:
            rewrites.append(
                _Rewrite(runs[0][0].start, runs[-1][-1].end, "".join(r[0].text for r in runs), True)
            )
        else:
            for run in runs:
                rewrites += _run(run, tokens)
    rewrites = _phone_numbers(rewrites, tokens)
    rewrites = _units(rewrites, tokens)
    return [(r.start, r.end, r.text) for r in rewrites]


def _comma_digits(runs: list[list[_Number]], tokens: Sequence[_Token]) -> list[list[list[_Number]]]:
    """Runs grouped into chains of lone spoken digits that Whisper separated by commas alone ("two, one,
    two, five"); every other run is a chain of its own."""

    def lone(run: list[_Number]) -> bool:
        return len(run) == 1 and run[0].digits and not run[0].written and len(run[0].text) == 1

    chains: list[list[list[_Number]]] = []
    for run in runs:
        last = chains[-1][-1] if chains else None
        if (
            last is not None
            and lone(run)
            and lone(last)
            and last[-1].end == run[0].start
            and tokens[last[-1].end - 1].trail == ","
        ):
            chains[-1].append(run)
        else:
            chains.append([run])
    return chains


def _run(run: list[_Number], tokens: Sequence[_Token]) -> list[_Rewrite]:
    start, end = run[0].start, run[-1].end
    if all(n.written for n in run):
        return []  # Whisper's own digits stay as they are
    if (
        all(n.digits for n in run)
        and sum(len(n.text) for n in run) >= 2
        and len(run) >= 2 - (tokens[start].norm in _REPEAT)
    ):
        return [_Rewrite(start, end, "".join(n.text for n in run), digit_string=True)]
    if any(n.written for n in run):
        return []  # written digits beside spoken numbers that are no digit sequence: leave them
    if len(run) == 2:
        pair = _pair(run[0], run[1], tokens)
        if pair is not None:
            return [_Rewrite(start, end, pair)]
    if len(run) >= 3 and all(n.integer and n.value < 100 and n.words <= 2 for n in run):
        return [_Rewrite(start, end, "".join(n.text for n in run), digit_string=True)]
    if len(run) == 2 and run[0].text.replace(".", "").isdigit() and "." in run[0].text:
        scale = _words_at(tokens, run[1])
        if scale in (["million"], ["billion"], ["trillion"]):  # "one point five million"
            value = float(run[0].text) * run[1].value
            text = f"{value:.0f}" if value.is_integer() else f"{value:g}"
            return [_Rewrite(start, end, text, number=_Number(start, end, text, value))]
    if len(run) > 1:
        return []  # two numbers or more that are no digits, year or time ("nine eleven"): as spoken
    n = run[0]
    return [_Rewrite(n.start, n.end, _day(n, tokens) or n.text, number=n)] if _convertible(n, tokens) else []


def _pair(first: _Number, second: _Number, tokens: Sequence[_Token]) -> str | None:
    """Two numbers read as a time ("three thirty" after "at") or a year ("nineteen ninety nine")."""
    if not (first.integer and second.integer):
        return None
    minutes = second.text if len(second.text) == 2 and second.value < 60 else None
    before = tokens[first.start - 1].norm if first.start else ""
    after = tokens[second.end].norm if second.end < len(tokens) else ""
    if minutes and 1 <= first.value <= 12 and (before in _TIME_BEFORE or after in _MERIDIEM):
        return f"{first.text}:{minutes}"
    after_month = _after_month(first.start, tokens)
    if len(second.text) == 2 and (first.value in (19, 20) or (10 <= first.value <= 18 and after_month)):
        return f"{first.text}{second.text}"
    return None


def _after_month(i: int, tokens: Sequence[_Token]) -> bool:
    """Token i follows a month, or a month and its day ("March third, ...")."""
    return any(tokens[j].month for j in range(max(0, i - 3), i))


def _convertible(n: _Number, tokens: Sequence[_Token]) -> bool:
    """A number written as digits on its own: 10 or more, more than one word, or before a unit."""
    after = tokens[n.end] if n.end < len(tokens) else None
    unit = after is not None and not tokens[n.end - 1].separated and after.norm in _UNIT_WORDS
    if n.ordinal:
        return n.value >= 10 or n.words > 1 or _day(n, tokens) is not None
    return n.value >= 10 or n.words > 1 or unit or _day(n, tokens) is not None or "." in n.text


_UNIT_WORDS = set(_CURRENCY) | _CENTS | _PERCENT | _MERIDIEM


def _day(n: _Number, tokens: Sequence[_Token]) -> str | None:
    """The number is a date's day, spoken as an ordinal: after a month ("June second" -> "2"), or
    before "of" and a month ("the fifth of May" -> "5th"). ("May one" is left alone.)"""
    if not 1 <= n.value <= 31 or n.value != int(n.value) or "." in n.text:
        return None
    if n.ordinal and n.start and tokens[n.start - 1].month and not tokens[n.start - 1].separated:
        return n.plain
    if (
        n.ordinal
        and n.end + 1 < len(tokens)
        and tokens[n.end].norm == "of"
        and tokens[n.end + 1].month
        and not tokens[n.end - 1].separated
    ):
        return n.text
    return None


def _phone_numbers(rewrites: list[_Rewrite], tokens: Sequence[_Token]) -> list[_Rewrite]:
    """Digit sequences in NANP groups, separated by a comma or dash and nothing else: one number. The
    whole chain of such groups must have the shape (four 4-digit groups are a card, not a phone)."""
    out: list[_Rewrite] = []
    i = 0
    while i < len(rewrites):
        j = i + 1
        while (
            j < len(rewrites) and rewrites[i].digit_string and _joined(rewrites[j - 1], rewrites[j], tokens)
        ):
            j += 1
        chain = rewrites[i:j]
        more_digits = chain[-1].end < len(tokens) and tokens[chain[-1].end].core[:1].isdigit()
        if tuple(len(r.text) for r in chain) in _PHONE_SHAPES and not more_digits:
            out.append(_Rewrite(chain[0].start, chain[-1].end, "-".join(r.text for r in chain)))
        else:
            out += chain
        i = j
    return out


def _joined(a: _Rewrite, b: _Rewrite, tokens: Sequence[_Token]) -> bool:
    return (
        a.digit_string
        and b.digit_string
        and a.end == b.start
        and tokens[a.end - 1].trail.strip() in _GROUP_JOINERS
    )


def _units(rewrites: list[_Rewrite], tokens: Sequence[_Token]) -> list[_Rewrite]:
    """Currency signs, cents and percent signs on the numbers right before those words."""
    out: list[_Rewrite] = []
    skip_to = -1
    for k, r in enumerate(rewrites):
        if r.start < skip_to:
            continue
        n = r.number
        after = tokens[r.end] if r.end < len(tokens) and not tokens[r.end - 1].separated else None
        if n is None or n.written or n.ordinal or after is None:
            out.append(r)
            continue
        if after.norm in _CURRENCY:
            end, text = r.end + 1, f"{_CURRENCY[after.norm]}{r.text}"
            cents = _cents(rewrites[k + 1 : k + 2], end, tokens)
            if cents is not None:
                end, text = cents[0], f"{text}.{cents[1]}"
            out.append(_Rewrite(r.start, end, text))
            skip_to = end
        elif after.norm in _PERCENT:
            out.append(_Rewrite(r.start, r.end + 1, f"{r.text}%"))
        else:
            out.append(r)
    return out


def _cents(following: list[_Rewrite], i: int, tokens: Sequence[_Token]) -> tuple[int, str] | None:
    """'and fifty cents' (or 'fifty cents') from token i on: (end, two digits)."""
    if tokens[i - 1].separated:
        return None
    j = i + (i < len(tokens) and tokens[i].norm == "and")
    if not following or following[0].start != j or following[0].number is None:
        return None
    n, end = following[0].number, following[0].end
    if not (n.integer and n.value < 100 and end < len(tokens) and tokens[end].norm in _CENTS):
        return None
    if tokens[end - 1].separated:
        return None
    return end + 1, f"{int(n.value):02d}"
