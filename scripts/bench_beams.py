"""Beam search against greedy decoding on real telephone speech, in one run (issue 29).

    python scripts/bench_beams.py [--beams 1,5] [--rounds 2] [--streams 16]

One engine (tiny.en, the CPU defaults, --kv-slots big enough for every stream's beams) serves both:
- WER: the REAL set (scripts/real_speech.py: jfk and pocketsphinx-testdata's librivox and cards, 8 kHz
  mu-law; 11 utterances, 113 words, so one word is ~0.9 pt), each beam size over the same clips, and
  how many of its utterances' tokens differ from the same utterance decoded alone (batch invariance).
- Throughput: `--streams` utterances submitted at once (the real clips, cycled: 16 calls' finals in
  flight together), `--rounds` times per beam size, the beam sizes interleaved so that a shared machine's
  load falls on both alike; CPU seconds per utterance (every engine thread) and wall utterances/s.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]  # runnable as a plain script from a checkout

from bench_levers import load_set  # noqa: E402
from real_speech import build_real_manifest  # noqa: E402

from clients.scoring import corpus_wer  # noqa: E402
from engine import DecodeOptions, Engine, EngineConfig  # noqa: E402
from harness.server import short_commit  # noqa: E402
from harness.usage import cpu_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--beams", default="1,5")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-out/beams"))
    args = parser.parse_args()
    beams = [int(b) for b in args.beams.split(",")]
    real = load_set("real", build_real_manifest(args.out / "real"))
    engine = Engine(
        EngineConfig(
            model="tiny.en",
            threads=args.threads,
            kv_slots=args.streams * max(beams),
            max_beam_size=max(beams),
        )
    )
    engine.start()
    engine.warmup()
    rows = []
    try:
        wer: dict[int, tuple[float, int, int]] = {}
        for b in beams:
            options = DecodeOptions(beam_size=b)
            together = [h.future.result() for h in [engine.submit(c, options) for c in real.clips]]
            alone = [engine.submit(c, options).future.result() for c in real.clips]
            w = corpus_wer(real.refs, [t.text for t in together])
            differ = sum(a.tokens != t.tokens for a, t in zip(alone, together, strict=True))
            wer[b] = (w, round(w * real.words), differ)
        clips = list(itertools.islice(itertools.cycle(real.clips), args.streams))
        cost = {b: [0.0, 0.0, 0] for b in beams}  # wall, cpu, utterances
        for _ in range(args.rounds):
            for b in beams:
                options = DecodeOptions(beam_size=b)
                t0, c0 = time.perf_counter(), time.process_time()
                for h in [engine.submit(c, options) for c in clips]:
                    h.future.result()
                cost[b][0] += time.perf_counter() - t0
                cost[b][1] += time.process_time() - c0
                cost[b][2] += len(clips)
    finally:
        engine.stop()
    base_cpu = cost[beams[0]][1] / cost[beams[0]][2]
    print(
        f"{datetime.date.today()}, commit {short_commit()}, {cpu_model()} ({os.cpu_count()} CPUs seen, "
        f"--threads {args.threads}), tiny.en CPU defaults, --kv-slots {args.streams * max(beams)}; "
        f"{args.streams} utterances at once x {args.rounds} rounds per beam size, interleaved"
    )
    print()
    print(
        f"| beam_size | WER % (REAL, {real.words} words) | errors | utterances whose tokens differ alone "
        f"| {args.streams} streams: utt/s (wall) | CPU s/utt | CPU cost vs beam {beams[0]} |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b in beams:
        w, errors, differ = wer[b]
        wall, cpu, n = cost[b]
        rows.append(
            f"| {b} | {100 * w:.1f} | {errors} | {differ} of {len(real.clips)} | {n / wall:.2f} | {cpu / n:.3f} "
            f"| {cpu / n / base_cpu:.2f}x |"
        )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
