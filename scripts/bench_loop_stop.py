#!/usr/bin/env python
"""Decode steps and wall time per real clip, one utterance at a time, before vs this checkout.

    python scripts/bench_loop_stop.py [--before REF] [--manifest FILE] [--out DIR]

What it shows: a trimmed decode that starts looping ("Seven of clubs. Seven of clubs. ...") now stops
at its first repeated span and goes to its full-context pass, instead of running on to its token budget
first. Same REAL clips as scripts/bench_latency_policy.py (pocketsphinx librivox + cards, jfk.flac; 8 kHz
mu-law decoded back to 16 kHz by sox), the bundled tiny.en with default settings, in-process. The
"before" code (default: merge-base with main) is extracted by `git archive` and run in a subprocess,
then this checkout; prints per clip the decode steps, wall time and whether the transcript is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.usage import Stopwatch

REPO = Path(__file__).resolve().parents[1]


def measure(manifest: Path) -> list[dict[str, Any]]:
    """Runs inside the tree under test (its engine first on the path)."""
    import soundfile as sf

    from engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model="tiny.en", threads=2))
    engine.start()
    engine.warmup()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "clip.wav"
        for line in manifest.read_text().splitlines():
            entry = json.loads(line)
            raw = manifest.parent / entry["audio"]
            subprocess.run(
                ["sox", "-D", "-t", "raw", "-r", "8000", "-e", "mu-law", "-b", "8", "-c", "1", str(raw),
                 "-r", "16000", "-e", "signed", "-b", "16", str(wav)],
                check=True, capture_output=True,
            )  # fmt: skip
            audio, _ = sf.read(wav, dtype="float32")
            with Stopwatch(descendants=False) as timed:
                result = engine.submit(audio).future.result()
            rows.append(
                {
                    "clip": entry["audio"],
                    "audio_s": round(len(audio) / 16000, 2),
                    "steps": result.stats.decode_steps,
                    "wall_s": timed.wall_s,
                    "text": result.text,
                }
            )
    engine.stop()
    return rows


def run_tree(src: Path, manifest: Path) -> list[dict[str, Any]]:
    """This file run with `--measure` from inside `src`, whose engine is first on the path."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--measure", str(manifest)],
        cwd=src, env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return list(json.loads(line.removeprefix("RESULT ")))


def main() -> None:
    if sys.argv[1:2] == ["--measure"]:  # inside the tree under test: no path changes here
        sys.path.remove(str(Path(__file__).resolve().parent))
        print("RESULT " + json.dumps(measure(Path(sys.argv[2]))))
        return
    sys.path.insert(0, str(REPO))
    from harness.server import checkout, merge_base
    from scripts.real_speech import build_real_manifest

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--before", default="", help="git ref of the 'before' code (default: merge-base with main)"
    )
    p.add_argument("--out", type=Path, default=Path("bench-out/loop-stop"))
    p.add_argument(
        "--manifest", type=Path, default=None, help="8 kHz mu-law manifest.jsonl (default: the REAL clips)"
    )
    args = p.parse_args()
    ref = args.before or merge_base()
    # absolute: each tree runs with its own folder as the working directory
    manifest = (args.manifest or build_real_manifest(args.out / "manifest")).resolve()
    load = os.getloadavg()[0]
    with checkout(ref) as before_src:
        before = run_tree(before_src, manifest)
    after = run_tree(REPO, manifest)
    lines = [
        f"| clip | audio s | decode steps before ({ref[:7]}) | after | wall s before | after | same transcript |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for b, a in zip(before, after, strict=True):
        lines.append(
            f"| {b['clip']} | {b['audio_s']} | {b['steps']} | {a['steps']} | {b['wall_s']:.2f} | {a['wall_s']:.2f} "
            f"| {'yes' if a['text'] == b['text'] else 'NO'} |"
        )
    total = [sum(int(r["steps"]) for r in rows) for rows in (before, after)]
    walls = [sum(float(r["wall_s"]) for r in rows) for rows in (before, after)]
    lines.append(f"| all | | {total[0]} | {total[1]} | {walls[0]:.2f} | {walls[1]:.2f} | |")
    note = (
        f"\nOne utterance at a time, in-process tiny.en defaults; load average {load:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end; CPUs {os.cpu_count()}.\n"
    )
    print("\n".join(lines) + "\n" + note, end="")


if __name__ == "__main__":
    main()
