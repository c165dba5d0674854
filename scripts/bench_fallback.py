"""Temperature fallback against none on real telephone speech, in one run (issue 29 item 1).

    python scripts/bench_fallback.py [--rounds 2] [--streams 16]

One engine (tiny.en, the CPU defaults) serves both schedules, asked per request: `off` decodes each window
at temperature 0 only; `on` is openai-whisper's transcribe() schedule (0, 0.2, ... 1.0), a window decoded
again at the next temperature while its text compresses more than 2.4 or its mean log-probability is
below -1 (not silence).
- WER on real speech: the REAL set (scripts/real_speech.py: jfk and pocketsphinx-testdata's librivox and
  cards, 8 kHz mu-law; 11 utterances, 113 words, so one word is ~0.9 pt), the 9 LibriSpeech test-clean
  clips scripts/setup.sh extracts (tests/support/two_speakers.py, 16 kHz), and both with white noise at
  `--snr-db` (real speech the model is less sure of: where windows fail the thresholds); per set, how many
  windows fell back at each temperature (asr_temperature_fallbacks_total), how many utterances' text the
  fallback changed, and how many utterances' tokens differ from the same utterance decoded alone.
- Throughput: `--streams` utterances submitted at once (the REAL clips, and the noisy ones, cycled: 16
  calls' finals in flight together), `--rounds` times per set and schedule, interleaved so that a shared machine's load falls on
  both alike; CPU seconds per utterance (every engine thread) and wall utterances/s.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]  # runnable as a plain script from a checkout

import numpy as np  # noqa: E402
from bench_levers import SpeechSet, load_set  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402
from real_speech import build_real_manifest  # noqa: E402

from clients.scoring import corpus_wer  # noqa: E402
from engine import DecodeOptions, Engine, EngineConfig  # noqa: E402
from engine.parameters import WHISPER_TEMPERATURES  # noqa: E402
from harness.server import short_commit  # noqa: E402
from harness.usage import cpu_model  # noqa: E402

SCHEDULES = {"off": (0.0,), "on": WHISPER_TEMPERATURES}


def fallbacks() -> dict[str, float]:
    """asr_temperature_fallbacks_total by temperature (both reasons)."""
    out: dict[str, float] = {}
    for t in WHISPER_TEMPERATURES[1:]:
        out[f"{t:g}"] = sum(
            REGISTRY.get_sample_value(
                "asr_temperature_fallbacks_total", {"temperature": f"{t:g}", "reason": r}
            )
            or 0.0
            for r in ("compression", "logprob")
        )
    return out


def noisy(clips: list[np.ndarray], snr_db: float, seed: int = 29) -> list[np.ndarray]:
    """The clips with white noise at `snr_db` (seeded): real speech the model is less sure of."""
    rng = np.random.default_rng(seed)
    out = []
    for c in clips:
        power = float(np.mean(c.astype(np.float64) ** 2))
        noise = rng.standard_normal(len(c)) * np.sqrt(power / 10 ** (snr_db / 10))
        out.append(np.clip(c + noise, -1, 1).astype(np.float32))
    return out


def libri_set() -> SpeechSet:
    """The 9 LibriSpeech test-clean clips scripts/setup.sh extracts (tests/support/two_speakers.py)."""
    from tests.support.two_speakers import clip, speakers

    pairs = [clip(s) for s in speakers()]
    return SpeechSet("libri", [a for a, _ in pairs], [t for _, t in pairs])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--snr-db", default="0,-5", help="noise levels of the noisy sets (the first: throughput)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out/fallback"))
    args = parser.parse_args()
    real = load_set("real", build_real_manifest(args.out / "real"))
    libri = libri_set()
    levels = [float(x) for x in args.snr_db.split(",")]
    clean, refs = [*real.clips, *libri.clips], [*real.refs, *libri.refs]
    noisy_sets = {snr: SpeechSet(f"{snr:g} dB", noisy(clean, snr), refs) for snr in levels}
    sets = {
        f"REAL ({len(real.clips)} clips, {real.words} words)": real,
        f"LIBRI ({len(libri.clips)} clips, {libri.words} words)": libri,
    }
    for snr, speech in noisy_sets.items():
        sets[f"REAL+LIBRI, white noise at {snr:g} dB SNR ({speech.words} words)"] = speech
    both = noisy_sets[levels[0]]
    engine = Engine(EngineConfig(model="tiny.en", threads=args.threads, kv_slots=max(32, args.streams)))
    engine.start()
    engine.warmup()
    quality: list[tuple[Any, ...]] = []
    try:
        for label, speech in sets.items():
            texts: dict[str, list[str]] = {}
            for name, schedule in SCHEDULES.items():
                options = DecodeOptions(temperatures=schedule)
                before = fallbacks()
                together = [h.future.result() for h in [engine.submit(c, options) for c in speech.clips]]
                after = fallbacks()
                alone = [engine.submit(c, options).future.result() for c in speech.clips]
                w = corpus_wer(speech.refs, [t.text for t in together])
                differ = sum(a.tokens != t.tokens for a, t in zip(alone, together, strict=True))
                again = "/".join(f"{after[t] - before[t]:g}" for t in after)
                texts[name] = [t.text for t in together]
                quality.append((label, name, w, round(w * speech.words), again, differ, len(speech.clips)))
            changed = sum(a != b for a, b in zip(texts["off"], texts["on"], strict=True))
            quality.append((label, "changed", changed, len(speech.clips)))
        loads = {"REAL": real, f"REAL+LIBRI at {levels[0]:g} dB SNR": both}
        cost = {(s, n): [0.0, 0.0, 0.0] for s in loads for n in SCHEDULES}  # wall, cpu, utterances
        for _ in range(args.rounds):
            for set_name, speech in loads.items():
                clips = list(itertools.islice(itertools.cycle(speech.clips), args.streams))
                for name, schedule in SCHEDULES.items():
                    options = DecodeOptions(temperatures=schedule)
                    t0, c0 = time.perf_counter(), time.process_time()
                    for h in [engine.submit(c, options) for c in clips]:
                        h.future.result()
                    cost[set_name, name][0] += time.perf_counter() - t0
                    cost[set_name, name][1] += time.process_time() - c0
                    cost[set_name, name][2] += len(clips)
    finally:
        engine.stop()
    print(
        f"{datetime.date.today()}, commit {short_commit()}, {cpu_model()} ({os.cpu_count()} CPUs seen, "
        f"--threads {args.threads}), tiny.en CPU defaults; {args.streams} utterances at once x {args.rounds} "
        "rounds per set and schedule, interleaved"
    )
    print()
    print(
        "| set | fallback | WER % | errors | windows decoded again at 0.2/0.4/0.6/0.8/1 "
        "| utterances whose tokens differ alone |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for row in quality:
        if row[1] == "changed":
            print(f"| {row[0]} | text changed by the fallback | | | {row[2]} of {row[3]} utterances | |")
            continue
        label, name, w, errors, again, differ, n = row
        print(f"| {label} | {name} | {100 * w:.1f} | {errors} | {again} | {differ} of {n} |")
    print()
    print(f"| clips | fallback | {args.streams} streams: utt/s (wall) | CPU s/utt | CPU cost vs off |")
    print("|---|---|---:|---:|---:|")
    for set_name in loads:
        base = cost[set_name, "off"][1] / cost[set_name, "off"][2]
        for name in SCHEDULES:
            wall, cpu, n = cost[set_name, name]
            print(f"| {set_name} | {name} | {n / wall:.2f} | {cpu / n:.3f} | {cpu / n / base:.2f}x |")


if __name__ == "__main__":
    main()
