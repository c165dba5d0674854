"""Real human speech as a telephone manifest, for benchmarks that decide anything that can move WER.

    python scripts/real_speech.py bench-out/real     # writes bench-out/real/manifest.jsonl

The clips (../shared/notes/real-speech-data.md): jfk.flac and pocketsphinx-testdata's 5 librivox
read sentences and 5 "cards" utterances, references from their transcripts: 11 utterances, 113
reference words (after Whisper's normaliser), so one word is ~0.9 pt of WER. Each becomes what a call center receives:
8 kHz mono G.711 mu-law, headerless (sox, no dither), listed the way `asr-loadgen make-manifest`
lists its espeak files.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POCKETSPHINX = Path("/usr/share/pocketsphinx/test/data")
JFK = REPO.parent / "shared" / "data" / "jfk.flac"  # where tests/support/audio.py finds it
JFK_TEXT = (
    "And so, my fellow Americans, ask not what your country can do for you, "
    "ask what you can do for your country."
)


def real_clips() -> list[tuple[Path, str]]:
    """(audio file, reference) for every real clip on this machine; an error naming what to
    install if a source is missing (a smaller set would silently change every figure)."""
    if not JFK.exists():
        raise SystemExit(f"real speech: {JFK} is missing (../shared/data/jfk.flac)")
    if not POCKETSPHINX.is_dir():
        raise SystemExit("real speech: install pocketsphinx-testdata (apt; scripts/setup.sh does)")
    clips = [(JFK, JFK_TEXT)]
    for folder, listing in (("librivox", "transcription"), ("cards", "cards.transcription")):
        for line in (POCKETSPHINX / folder / listing).read_text().splitlines():
            m = re.match(r"<s>(.*)</s>\s*\((.+)\)", line.strip())  # sphinx: <s> text </s> (file-id)
            if m:
                clips.append(
                    (POCKETSPHINX / folder / f"{m.group(2).strip()}.wav", " ".join(m.group(1).split()))
                )
    return clips


def build_real_manifest(out_dir: Path) -> Path:
    """Write the real clips as 8 kHz mu-law files and their manifest.jsonl into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (path, text) in enumerate(real_clips()):
        name = f"real{i:02d}.ulaw"
        subprocess.run(
            ["sox", "-D", str(path), "-r", "8000", "-c", "1", "-e", "mu-law", "-b", "8", "-t", "raw",
             str(out_dir / name)],
            check=True,
            capture_output=True,
        )  # fmt: skip
        entry = {"audio": name, "encoding": "MULAW", "sample_rate": 8000, "text": text, "source": path.name}
        lines.append(json.dumps(entry) + "\n")
    manifest = out_dir / "manifest.jsonl"
    manifest.write_text("".join(lines))
    return manifest


if __name__ == "__main__":
    print(build_real_manifest(Path(sys.argv[1] if len(sys.argv) > 1 else "bench-out/real")))
