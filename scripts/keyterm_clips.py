"""The keyterm speech sets: espeak-ng sentences with invented names tiny.en does not know, sentences
without them, and the real clips of scripts/real_speech.py; all as a telephone delivers them (8 kHz
G.711 mu-law by sox, decoded back to 16 kHz float). Shared by scripts/bench_keyterms.py and
tests/engine/test_keyterms.py.

Two sets of name sentences: `dev` (what the bonus was tuned on) and `test` (held out: other
sentences, the same names and voices). Every utterance gets the same 16-term list: the 8 names said
in the sets and 8 that are said nowhere. A third, `heldout` (issue 29), shares nothing with them: other
names (surnames and product names a contact center hears, none of them in tiny.en's vocabulary as one
piece), other sentences, its own 16-term list (its 8 names and 8 said nowhere), and another voice
besides two of theirs; nothing was tuned on it.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

NAMES = ("Zorvath", "Quellbrook", "Tavrenko", "Moxilar", "Brenwick", "Velquist", "Draymont", "Kestoria")
UNSAID = ("Ulvanis", "Pyxtel", "Fenrow", "Orlindo", "Graventh", "Syllaro", "Nexquora", "Tembrix")
KEYTERMS = NAMES + UNSAID
HELDOUT_NAMES = (
    "Okonkwo",
    "Vantrell",
    "Zephyrix",
    "Dunmarrow",
    "Krelliston",
    "Bravenna",
    "Quintaro",
    "Halloran",
)
HELDOUT_UNSAID = (
    "Marlowick",
    "Tessaline",
    "Ardentix",
    "Volkane",
    "Pemberlyn",
    "Gastrova",
    "Ixora",
    "Rendtorff",
)
HELDOUT_KEYTERMS = HELDOUT_NAMES + HELDOUT_UNSAID
HELDOUT_VOICES = ("en-us+f2", "en-gb", "en-us+m7")
VOICES = ("en-us", "en-gb+f3", "en-us+m3")
TEMPLATES = {
    "dev": (
        "Please put me through to {} in the billing team.",
        "I spoke with {} yesterday about my refund.",
        "My account was opened by {} last spring.",
        "Can you ask {} to call me back this afternoon?",
        "The technician from {} never showed up.",
        "I am calling about the {} order I placed.",
        "{} told me the contract would be renewed.",
        "Could you spell the name {} for me again?",
    ),
    "test": (
        "Hello, I would like to speak with {} please.",
        "Our company uses {} for all the shipping.",
        "I was transferred to {} twice already.",
        "Is {} still the manager of this branch?",
        "The invoice from {} shows the wrong amount.",
        "Yes, the name on the card is {}.",
        "I think {} can help me with this problem.",
        "We signed up for {} in January.",
    ),
    "heldout": (
        "Good morning, this is {} from the accounts department.",
        "I need to update the address for {} on my policy.",
        "The delivery from {} arrived damaged again.",
        "Could you connect me with {} in technical support?",
        "My manager {} approved the purchase last week.",
        "We are still waiting for the {} software licence.",
        "Please note that {} is the authorised contact.",
        "I called {} three times and nobody answered.",
    ),
}
CONTROLS = (
    "Thank you for calling customer support, how can I help you today?",
    "I would like to check the status of my order please.",
    "My account number is four five seven two nine.",
    "Can you transfer me to the billing department?",
    "The package was supposed to arrive last Tuesday.",
    "I want to cancel my subscription at the end of the month.",
)


@dataclass(frozen=True)
class Clip:
    name: str
    text: str  # the reference
    term: str | None  # the invented name said in it (None: none)
    voice: str = ""
    source: Path | None = None  # a recording (real speech) instead of espeak text
    keyterms: tuple[str, ...] = KEYTERMS  # the list it is decoded with


def name_clips(split: str) -> list[Clip]:
    """One sentence per name, each in every voice (24 clips)."""
    if split == "heldout":
        return [
            Clip(
                f"heldout-{name}-{voice}",
                TEMPLATES[split][(i + j) % 8].format(name),
                name,
                voice,
                None,
                HELDOUT_KEYTERMS,
            )
            for i, name in enumerate(HELDOUT_NAMES)
            for j, voice in enumerate(HELDOUT_VOICES)
        ]
    shift = 0 if split == "dev" else 3  # each name in another sentence position than in dev
    templates = TEMPLATES[split]
    return [
        Clip(f"{split}-{name}-{voice}", templates[(i + shift) % len(templates)].format(name), name, voice)
        for i, name in enumerate(NAMES)
        for voice in VOICES
    ]


def control_clips() -> list[Clip]:
    return [
        Clip(f"control{i}-{voice}", text, None, voice) for i, text in enumerate(CONTROLS) for voice in VOICES
    ]


def real_clips() -> list[Clip]:
    from scripts.real_speech import real_clips as sources

    return [Clip(f"real{i:02d}", text, None, source=path) for i, (path, text) in enumerate(sources())]


# Real speech with a list of its own words: what a caller's names and domain words would be (the
# proper names of each source, the card words of the cards set), said in some clips and not others.
OWN_WORDS = {
    "jfk": ("Americans",),
    "librivox": ("John Dashwood",),
    "cards": ("clubs", "spades", "hearts", "diamonds", "ace", "king", "queen", "jack"),
}


def real_clips_own_words() -> list[Clip]:
    """The real clips again, each with its source's OWN_WORDS as the keyterms."""
    out = []
    for clip in real_clips():
        assert clip.source is not None
        group = "jfk" if clip.source.suffix == ".flac" else clip.source.parent.name
        out.append(Clip(f"own-{clip.name}", clip.text, None, source=clip.source, keyterms=OWN_WORDS[group]))
    return out


def _sox(*args: str | Path) -> None:
    subprocess.run(["sox", *(str(a) for a in args)], check=True, capture_output=True)


@functools.cache
def _workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="keyterm-clips-"))


def telephone_audio(clip: Clip) -> np.ndarray:
    """The clip as 8 kHz mu-law (sox, no dither) decoded back to 16 kHz float32 mono."""
    key = hashlib.sha1(f"{clip.text}|{clip.voice}|{clip.source}".encode()).hexdigest()[:16]
    work = _workdir()
    src, ulaw, out = work / f"{key}.wav", work / f"{key}.ulaw", work / f"{key}-16k.wav"
    if not out.exists():
        if clip.source is None:
            subprocess.run(
                ["espeak-ng", "-v", clip.voice, "-s", "160", "-w", str(src), clip.text],
                check=True,
                capture_output=True,
            )
        else:
            src = clip.source
        _sox("-D", src, "-r", "8000", "-c", "1", "-e", "mu-law", "-b", "8", "-t", "raw", ulaw)
        _sox("-D", "-t", "raw", "-r", "8000", "-e", "mu-law", "-b", "8", "-c", "1", ulaw, "-r", "16000", "-e", "signed", "-b", "16", out)  # fmt: skip
    audio, _ = sf.read(out, dtype="float32")
    return audio


def said(term: str, text: str) -> bool:
    """The term is in the text as a word (any case)."""
    import re

    return re.search(rf"(?<![\w]){re.escape(term.lower())}(?![\w])", text.lower()) is not None
