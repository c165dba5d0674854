"""Keyterm respelling: a finished window's words that sound like a listed term, checked by the model.

tiny.en hears many names as other words ("Okonkwo" as "Akan Kuo", "Vantrell" as "Mantrol"): the decode
step's bias (engine/decoding/keyterms.py) cannot reach a spelling whose first piece is far below the
model's choice. After a window is decoded, this module proposes alternatives: each span of up to a few
words whose sound key (`sound_key`: letters folded into classes of similar sounds, repeats merged) is
within `max_distance` edits per key letter of a listed term's becomes that term, the rest of the window
unchanged. The model then scores the original and each alternative teacher-forced over the same encoder
output (engine/model/model.py `sequence_logits`, run by engine/model/respell.py `Respeller`), and an
alternative is kept when its log-probability is at most `margin` nats per token of the term below the
original's: the audio, not the spelling alone, has to agree. One alternative is kept per round (the
best), and the next round proposes from the new text, up to one round per term; a term already in the
text is not proposed again.

This module is the rules (no torch): the proposals and the choice.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Letters that tiny.en confuses for one another in names fold into one class; vowels and the glides
# fold into one (a misheard vowel is the commonest error), and so do voiced/unvoiced pairs.
_CLASSES = {
    **dict.fromkeys("aeiouyhw", "a"),
    **dict.fromkeys("bpfv", "p"),
    **dict.fromkeys("cgjkqx", "k"),
    **dict.fromkeys("sz", "s"),
    **dict.fromkeys("dt", "t"),
    **dict.fromkeys("mn", "n"),
    "l": "l",
    "r": "r",
}


def sound_key(text: str) -> str:
    """Letters in sound classes, runs of one class merged; digits and other characters dropped."""
    out: list[str] = []
    for char in text.lower():
        cls = _CLASSES.get(char)
        if cls is not None and (not out or out[-1] != cls):
            out.append(cls)
    return "".join(out)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert, delete, substitute: 1 each). Written here, not taken from rapidfuzz:
    the engine imports only what a bare GPU host has (part 1 of scripts/gpu_check.sh carries no wheels)."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


@dataclass(frozen=True)
class RespellSettings:
    """How far a span may sound from a term to be proposed, and how far below the original an
    alternative may score to be kept (EngineConfig's keyterm_respell flags)."""

    margin: float = 6.0  # nats per token of the term as spelled
    max_distance: float = 0.5  # edits per letter of the longer sound key
    extra_words: int = 2  # a span may hold this many words more than the term


@dataclass(frozen=True)
class Alternative:
    """The window's tokens with tokens[start:end] spelled as `term` (`spelled`: its tokens there)."""

    term: str
    start: int
    end: int
    tokens: tuple[int, ...]
    spelled: int


def word_spans(
    tokens: Sequence[int], decode: Callable[[list[int]], str], eot: int
) -> list[tuple[int, int, str]]:
    """(start, end, text) of each word: a new word at a leading space or a punctuation mark; special
    tokens (end of text, timestamps) belong to no word."""
    words: list[tuple[int, int, str]] = []
    start: int | None = None
    for i, token in enumerate(tokens):
        if token >= eot:
            if start is not None:
                words.append((start, i, decode(list(tokens[start:i]))))
            start = None
            continue
        piece = decode([token])
        mark = bool(piece.strip()) and all(c in string.punctuation for c in piece.strip())
        if start is None:
            start = i
        elif piece.startswith(" ") or mark:
            words.append((start, i, decode(list(tokens[start:i]))))
            start = i
    if start is not None:
        words.append((start, len(tokens), decode(list(tokens[start:]))))
    return words


def said(term: str, text: str) -> bool:
    """Whether the text holds the term as words (any case)."""
    words = [w.strip(string.punctuation) for w in text.lower().split()]
    wanted = term.lower().split()
    return any(words[i : i + len(wanted)] == wanted for i in range(len(words) - len(wanted) + 1))


def proposals(
    tokens: Sequence[int],
    terms: Sequence[str],
    decode: Callable[[list[int]], str],
    encode: Callable[[str], list[int]],
    eot: int,
    settings: RespellSettings,
) -> list[Alternative]:
    """The alternatives worth scoring: per term not yet in the text, the spans whose sound is nearest
    the term's (ties: all of them), within settings.max_distance. A span keeps its leading space and
    its closing punctuation; a span made only of punctuation is never one."""
    words = word_spans(tokens, decode, eot)
    text = decode([t for t in tokens if t < eot])
    terms = list(dict.fromkeys(" ".join(t.split()) for t in terms))
    longest = max((len(t.split()) for t in terms), default=0) + settings.extra_words
    # Every run of up to `longest` words, decoded and keyed once for all the terms.
    spans: list[tuple[int, int, str, str, int]] = []  # start, end, text, sound key, words
    for a in range(len(words)):
        for b in range(a, min(len(words), a + longest)):
            if b > a and words[b][0] != words[b - 1][1]:
                break  # a special token between: not one run of text
            span = decode(list(tokens[words[a][0] : words[b][1]]))
            key = sound_key(span)
            # a span holding a listed term is left alone: the bias wrote it
            if key and not any(said(t, span) for t in terms):
                spans.append((words[a][0], words[b][1], span, key, b - a + 1))
    out: dict[tuple[int, ...], Alternative] = {}
    for term in terms:
        target = sound_key(term)
        if not target or said(term, text):
            continue
        words_limit = len(term.split()) + settings.extra_words
        best: list[tuple[int, int, str]] = []
        best_distance = settings.max_distance
        for start, end, span, key, n_words in spans:
            if n_words > words_limit:
                continue
            distance = edit_distance(key, target) / max(len(key), len(target))
            if distance < best_distance - 1e-9:
                best, best_distance = [], distance
            if distance <= best_distance + 1e-9:
                best.append((start, end, span))
        for start, end, span in best:
            core = span.rstrip(string.punctuation + " ")
            tail = span[len(core) :]
            lead = " " if span.startswith(" ") or start > 0 else ""
            spelled = tuple(encode(lead + term + tail))
            if spelled == tuple(tokens[start:end]):
                continue
            alternative = (*tokens[:start], *spelled, *tokens[end:])
            out.setdefault(alternative, Alternative(term, start, end, alternative, len(spelled)))
    return list(out.values())


def choose(original: float, scores: Sequence[float], spelled: Sequence[int], margin: float) -> int | None:
    """The alternative kept: the one whose score, less the original's, per token of its term is highest,
    when that is at most `margin` nats below zero. Per token, since a name in more pieces pays for each
    piece's surprise (the spans that sound like a term and are not it lost more than ~6 nats per piece
    on the dev set, those that were it less: docs/benchmarks.md Keyterms)."""
    if not scores:
        return None
    gain = [(s - original) / max(1, n) for s, n in zip(scores, spelled, strict=True)]
    best = max(range(len(gain)), key=gain.__getitem__)
    return best if gain[best] >= -margin else None
