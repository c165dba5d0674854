"""The default benchmark manifest: call-center sentences spoken by espeak-ng, made on the spot.

A fresh machine has no recorded call audio, so the load generator makes its own: each
sentence is spoken by espeak-ng with one of several voices and speeds (chosen by index, so
the same `--count` always gives the same files), then sox turns it into a 16 kHz LINEAR16 WAV
and an 8 kHz G.711 mu-law raw file (what a telephone line carries). `manifest.jsonl` lists one
utterance per line:

    {"audio": "utt000.ulaw", "encoding": "MULAW", "sample_rate": 8000, "text": "..."}

Paths are relative to the manifest's folder. The reference text is exactly what espeak-ng was
asked to say; digits are written as words so the spoken form is not left to espeak's guess.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from clients.client import G711_RATE, WIDEBAND_RATE

Encoding = Literal["LINEAR16", "MULAW"]

# Written for this project: what callers say to a contact center, 1-6 s each when spoken.
SENTENCES: tuple[str, ...] = (
    "Hi, I'm calling about my last bill.",
    "I'd like to cancel my subscription, please.",
    "My account number is four five seven two nine one.",
    "Can you tell me the status of my order?",
    "I was charged twice for the same purchase.",
    "I moved last month and need to update my address.",
    "The new address is twelve Oak Street, apartment three.",
    "My internet has been down since yesterday morning.",
    "Could you transfer me to the billing department?",
    "I never received the package you said was delivered.",
    "What is the balance on my account?",
    "I want to upgrade to the premium plan.",
    "Please send me a copy of my latest invoice by email.",
    "The order number is seven seven three one eight.",
    "Why did my monthly payment go up?",
    "I would like to speak to a supervisor.",
    "Can I change the date of my appointment?",
    "My card expired, so I need to add a new one.",
    "Is there a fee for ending my contract early?",
    "I forgot my password and I can't log in.",
    "The technician never showed up today.",
    "How long will the refund take to arrive?",
    "I'd like to return this item for a full refund.",
    "My phone number is five five five, two one three, four eight.",
    "Yes, that is correct.",
    "No, I did not authorize that payment.",
    "Can you repeat the confirmation number?",
    "I have been on hold for over twenty minutes.",
    "Please remove me from your mailing list.",
    "The device stopped working after the update.",
    "Do you offer a discount for students?",
    "I need to report a lost credit card.",
    "When does my free trial end?",
    "Could you check if my payment went through?",
    "I'd like to pause my service while I'm traveling.",
    "Thank you, that solves my problem.",
    "My zip code is nine zero two one zero.",
    "The delivery was supposed to arrive on Friday.",
    "I want to add another line to my family plan.",
    "Can you email me the terms and conditions?",
)

# espeak-ng voice variants (+f3 female, +m3 male, ...) and accents; speeds in words per minute.
VOICES: tuple[str, ...] = (
    "en-us",
    "en-us+f3",
    "en-gb",
    "en-gb+m3",
    "en",
    "en-us+f2",
    "en-gb-x-rp+f4",
    "en-us+m2",
)
SPEEDS_WPM: tuple[int, ...] = (140, 155, 170, 190, 160, 180, 150)

LEAD_SILENCE_S = 0.15  # a little room before speech, as a caller's line has
TRAIL_SILENCE_S = 0.25  # shorter than the server's 500 ms end-of-speech default: the half-close ends it


@dataclass(frozen=True)
class ManifestEntry:
    audio: str  # relative to the manifest's folder, or absolute
    encoding: Encoding
    sample_rate: int
    text: str
    voice: str = ""
    wpm: int = 0

    def to_json(self) -> str:
        return json.dumps(
            {
                "audio": self.audio,
                "encoding": self.encoding,
                "sample_rate": self.sample_rate,
                "text": self.text,
                "voice": self.voice,
                "wpm": self.wpm,
            }
        )


def _require_tools() -> None:
    missing = [t for t in ("espeak-ng", "sox") if shutil.which(t) is None]
    if missing:
        raise RuntimeError(
            f"the default manifest needs {' and '.join(missing)} on PATH "
            f"(apt-get install {' '.join(missing)})"
        )


def speak(text: str, voice: str, wpm: int, wav_out: Path) -> None:
    """espeak-ng -> WAV at its native 22 050 Hz."""
    subprocess.run(
        ["espeak-ng", "-v", voice, "-s", str(wpm), "-w", str(wav_out), text], check=True, capture_output=True
    )


# sox dithers with random noise when it requantises; -D turns that off so the files are
# byte-for-byte the same on every run.


def to_linear16(src: Path, out: Path) -> None:
    """16 kHz mono 16-bit WAV, padded with the lead and trail silence."""
    subprocess.run(
        ["sox", "-D", str(src), "-r", str(WIDEBAND_RATE), "-c", "1", "-b", "16", "-e", "signed-integer", str(out),
         "pad", str(LEAD_SILENCE_S), str(TRAIL_SILENCE_S)],
        check=True,
        capture_output=True,
    )  # fmt: skip


def to_mulaw(src: Path, out: Path) -> None:
    """8 kHz mono G.711 mu-law, headerless: the bytes a telephone trunk carries."""
    subprocess.run(
        ["sox", "-D", str(src), "-r", str(G711_RATE), "-c", "1", "-e", "mu-law", "-b", "8", "-t", "raw", str(out),
         "pad", str(LEAD_SILENCE_S), str(TRAIL_SILENCE_S)],
        check=True,
        capture_output=True,
    )  # fmt: skip


def voice_for(index: int) -> tuple[str, int]:
    """Voice and speed of utterance `index`: coprime cycle lengths, so pairs vary across the set."""
    return VOICES[index % len(VOICES)], SPEEDS_WPM[index % len(SPEEDS_WPM)]


def build_manifest(
    out_dir: str | Path,
    count: int = len(SENTENCES),
    encodings: tuple[Encoding, ...] = ("LINEAR16",),
    name: str = "manifest.jsonl",
) -> Path:
    """Speak `count` sentences (cycling through SENTENCES with a new voice each lap) into `out_dir`.

    `encodings` is cycled per utterance: ("MULAW",) gives the telephone manifest,
    ("LINEAR16", "MULAW") alternates. Both files are always written; the manifest lists the
    chosen one. Returns the manifest path.
    """
    if count < 1:
        raise ValueError(f"--count must be at least 1, got {count}")
    _require_tools()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries: list[ManifestEntry] = []
    with tempfile.TemporaryDirectory(prefix="asr-manifest-") as tmp:
        for i in range(count):
            text = SENTENCES[i % len(SENTENCES)]
            # a later lap over the sentences shifts the voice so a repeated sentence sounds different
            voice, wpm = voice_for(i + i // len(SENTENCES))
            raw = Path(tmp) / f"{i}.wav"
            speak(text, voice, wpm, raw)
            wav, ulaw = out / f"utt{i:03d}.wav", out / f"utt{i:03d}.ulaw"
            to_linear16(raw, wav)
            to_mulaw(raw, ulaw)
            enc = encodings[i % len(encodings)]
            audio, rate = (wav.name, WIDEBAND_RATE) if enc == "LINEAR16" else (ulaw.name, G711_RATE)
            entries.append(ManifestEntry(audio, enc, rate, text, voice, wpm))
    path = out / name
    path.write_text("".join(e.to_json() + "\n" for e in entries))
    return path


def load_manifest(path: str | Path) -> list[ManifestEntry]:
    """Read manifest.jsonl; relative audio paths become absolute (relative to the manifest)."""
    p = Path(path)
    entries: list[ManifestEntry] = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        d = json.loads(line)
        try:
            enc = d["encoding"]
            if enc not in ("LINEAR16", "MULAW"):
                raise ValueError(f"encoding must be LINEAR16 or MULAW, got {enc!r}")
            audio = Path(d["audio"])
            if not audio.is_absolute():
                audio = p.parent / audio
            entries.append(
                ManifestEntry(
                    str(audio),
                    enc,
                    int(d["sample_rate"]),
                    str(d["text"]),
                    d.get("voice", ""),
                    d.get("wpm", 0),
                )
            )
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{p}:{n}: {exc}") from exc
    if not entries:
        raise ValueError(f"{p}: no utterances")
    return entries
