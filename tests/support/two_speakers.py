"""Two-speaker mono calls made from real recordings of known speakers, with their exact reference turns.

The clips: LibriSpeech test-clean excerpts of 9 speakers (CC-BY-4.0) from the `voxint` 0.51.0 wheel, and
pyannote's own 30 s two-speaker sample with its reference RTTM (MIT) from the `pyannote-audio` 4.0.7 wheel,
both extracted by scripts/setup.sh into .cache/diarization-data/ (the wheels are not installed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

DATA = Path(__file__).resolve().parents[2] / ".cache" / "diarization-data"
RATE = 16000


@dataclass(frozen=True)
class Call:
    audio: np.ndarray  # 16 kHz float32 mono
    turns: tuple[tuple[float, float, str], ...]  # reference (start_s, end_s, speaker)
    texts: tuple[str, ...]  # each speaker's clip transcript (upper case, as LibriSpeech writes it)


def clip(speaker_id: str) -> tuple[np.ndarray, str]:
    """The LibriSpeech clip of speaker `speaker_id` ("1089") and its transcript."""
    manifest = json.loads((DATA / "manifest.json").read_text())
    for f in manifest["files"]:
        if f["id"].endswith(f"_spk{speaker_id}"):
            audio, rate = sf.read(DATA / f["filename"], dtype="float32")
            assert rate == RATE and audio.ndim == 1
            return audio, f["reference_transcript"]
    raise KeyError(speaker_id)


def speakers() -> list[str]:
    manifest = json.loads((DATA / "manifest.json").read_text())
    return [f["id"].rsplit("_spk", 1)[1] for f in manifest["files"] if f["id"].startswith("libri_")]


def split_at_pause(audio: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The clip cut in two at its longest quiet stretch in the middle half (a pause between words), so
    that one speaker's clip gives two turns without cutting a word."""
    frame = RATE // 100
    energy = np.array(
        [np.sqrt(np.mean(audio[i : i + frame] ** 2)) for i in range(0, len(audio) - frame, frame)]
    )
    quiet = energy < max(energy.max() * 0.03, 1e-4)
    lo, hi = len(energy) // 4, 3 * len(energy) // 4
    best, best_len, run_start = lo, 0, None
    for i in range(lo, hi):
        if quiet[i] and run_start is None:
            run_start = i
        if (not quiet[i] or i == hi - 1) and run_start is not None:
            if i - run_start > best_len:
                best, best_len = (run_start + i) // 2, i - run_start
            run_start = None
    cut = best * frame
    return audio[:cut], audio[cut:]


def _trim(audio: np.ndarray) -> np.ndarray:
    """Leading and trailing silence off, so that a reference turn starts and ends with speech."""
    frame = RATE // 100
    energy = np.array(
        [np.sqrt(np.mean(audio[i : i + frame] ** 2)) for i in range(0, len(audio) - frame, frame)]
    )
    loud = np.flatnonzero(energy > energy.max() * 0.03)
    return audio[loud[0] * frame : (loud[-1] + 1) * frame]


def two_speaker_call(a: str = "1089", b: str = "1221", gap_s: float = 0.6, overlap_s: float = 0.5) -> Call:
    """A, B, A, B: each speaker's clip split at a pause into two turns, gaps of `gap_s` between turns except
    the last, which B starts `overlap_s` before A's second turn ends (one overlap)."""
    clip_a, text_a = clip(a)
    clip_b, text_b = clip(b)
    a1, a2 = (_trim(x) for x in split_at_pause(clip_a))
    b1, b2 = (_trim(x) for x in split_at_pause(clip_b))
    pieces = [(a1, a, gap_s), (b1, b, gap_s), (a2, a, -overlap_s), (b2, b, 0.0)]
    total = int((0.5 + sum(len(p) / RATE + max(g, 0) for p, _, g in pieces) + 0.5) * RATE)
    out = np.zeros(total, dtype=np.float32)
    turns = []
    at = int(0.5 * RATE)
    for piece, who, gap in pieces:
        out[at : at + len(piece)] += piece * (0.5 / max(np.abs(piece).max(), 1e-6))
        turns.append((at / RATE, (at + len(piece)) / RATE, who))
        at += len(piece) + int(gap * RATE)
    return Call(
        out[: max(t[1] for t in turns).__mul__(RATE).__int__() + RATE // 2], tuple(turns), (text_a, text_b)
    )


def one_speaker_call(a: str = "1089", gap_s: float = 1.0) -> Call:
    """One speaker's clip split at a pause into two turns `gap_s` apart (two utterances of one voice)."""
    clip_a, text_a = clip(a)
    a1, a2 = (_trim(x) for x in split_at_pause(clip_a))
    lead, gap = int(0.5 * RATE), int(gap_s * RATE)
    out = np.zeros(lead + len(a1) + gap + len(a2) + lead, dtype=np.float32)
    out[lead : lead + len(a1)] = a1 * (0.5 / max(np.abs(a1).max(), 1e-6))
    b = lead + len(a1) + gap
    out[b : b + len(a2)] = a2 * (0.5 / max(np.abs(a2).max(), 1e-6))
    turns = ((lead / RATE, (lead + len(a1)) / RATE, a), (b / RATE, (b + len(a2)) / RATE, a))
    return Call(out, turns, (text_a,))


def pyannote_sample() -> Call:
    """pyannote's 30 s two-speaker sample and its reference turns."""
    audio, rate = sf.read(DATA / "sample.wav", dtype="float32")
    assert rate == RATE
    turns = []
    for line in (DATA / "sample.rttm").read_text().splitlines():
        parts = line.split()
        start, dur = float(parts[3]), float(parts[4])
        turns.append((start, start + dur, parts[7]))
    return Call(audio, tuple(turns), ())


def reference_speaker(call: Call, start_s: float, end_s: float) -> str | None:
    """The reference speaker of a word: the turn that covers most of it."""
    best, best_overlap = None, 0.0
    for s, e, who in call.turns:
        overlap = min(e, end_s) - max(s, start_s)
        if overlap > best_overlap:
            best, best_overlap = who, overlap
    return best


def word_accuracy(call: Call, words: list[tuple[float, float, int]]) -> float:
    """Share of the words whose speaker is right, under the best one-to-one mapping of labels to
    reference speakers (2 reference speakers: the better of the two mappings; extra labels count wrong)."""
    refs = sorted({who for _, _, who in call.turns})
    pairs = [(reference_speaker(call, s, e), spk) for s, e, spk in words]
    pairs = [(r, h) for r, h in pairs if r is not None]
    if not pairs:
        return 0.0
    best = 0
    labels = sorted({h for _, h in pairs})
    import itertools

    for perm in itertools.permutations(labels, min(len(labels), len(refs))):
        mapping = dict(zip(perm, refs, strict=False))
        best = max(best, sum(1 for r, h in pairs if mapping.get(h) == r))
    return best / len(pairs)
