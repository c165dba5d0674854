#!/usr/bin/env python
"""The VAD's noise gate on real speech: the same calls cut and transcribed with it and without it.

    python scripts/bench_noise_gate.py [--gains-db=0,-10,-20] [--noise-dbfs=none,-60,-50,-40]

(the "=" keeps argparse from reading a leading minus as an option)

Each call is every clip of scripts/real_speech.py (jfk.flac, pocketsphinx librivox and cards) one after
the other with 1-3 s of line between them, at a caller's gain (0 dB: as recorded; -20 dB: a quiet
caller, speech windows around -45 dBFS), with white line noise at the given level all through (none:
digital silence between the clips), made 8 kHz mu-law by soundfile and decoded and resampled to 16 kHz
by the server's own StreamDecoder. It is cut by one Endpointer with the gate and one without (as 20 ms
live passes would cut it); both cuttings go through the in-process engine (tiny.en, server defaults). Prints per call: utterances, bounds that
moved and by how much, the windows the gate skipped, and the call's WER either way; then the WER over
every call (the calls' words pooled). Where the line is louder than the quiet caller's speech (-20 dB
under -40 dBFS), both cut badly; that row is printed and left out of the pooled WER.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from real_speech import real_clips  # noqa: E402

from clients.scoring import corpus_wer  # noqa: E402
from engine import DecodeOptions, Engine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from service import metrics  # noqa: E402
from service.pipeline.audio import StreamDecoder  # noqa: E402
from service.pipeline.endpointing import Endpointer, Utterance  # noqa: E402
from service.pipeline.noise_gate import MARGIN_DB  # noqa: E402
from service.pipeline.vad import WINDOW  # noqa: E402

G711_RATE = 8000


def clip_8k(path: Path) -> np.ndarray:
    audio, rate = sf.read(path, dtype="float32", always_2d=True)
    return soxr.resample(audio.mean(axis=1), rate, G711_RATE).astype(np.float32)


def make_call(clips: list[np.ndarray], gain_db: float, noise_dbfs: float | None, seed: int = 0) -> np.ndarray:
    """The call as a stream hears it: 16 kHz float32 from 8 kHz mu-law."""
    rng = np.random.default_rng(seed)
    parts: list[np.ndarray] = [np.zeros(2 * G711_RATE, dtype=np.float32)]
    for clip in clips:
        parts += [
            clip * 10 ** (gain_db / 20),
            np.zeros(int(G711_RATE * rng.uniform(1.0, 3.0)), dtype=np.float32),
        ]
    audio = np.concatenate(parts)
    if noise_dbfs is not None:
        audio = audio + rng.standard_normal(len(audio)).astype(np.float32) * 10 ** (noise_dbfs / 20)
    wire = io.BytesIO()
    sf.write(wire, np.clip(audio, -1, 1), G711_RATE, format="RAW", subtype="ULAW")
    decoder = StreamDecoder("MULAW", G711_RATE, 1)  # the server's own decoding and resampling
    return np.concatenate([decoder.feed(wire.getvalue())[0], decoder.flush()[0]])


def cut(audio: np.ndarray, gate_margin_db: float) -> list[Utterance]:
    """The whole call at once: the same cuts as 20 ms passes give (tests/test_noise_gate.py holds it)."""
    ep = Endpointer(gate_margin_db=gate_margin_db)
    return [e for e in ep.feed(audio) + ep.flush() if isinstance(e, Utterance)]


def gated() -> float:
    return float(metrics.VAD_WINDOWS_GATED._value.get())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gains-db", default="0,-10,-20")
    ap.add_argument("--noise-dbfs", default="none,-60,-50,-40")
    args = ap.parse_args()
    sources = real_clips()
    clips = [clip_8k(path) for path, _ in sources]
    reference = " ".join(text for _, text in sources)
    engine = Engine(EngineConfig())
    engine.start()
    options = DecodeOptions(language="en")

    def transcribe(utterances: list[Utterance]) -> str:
        handles = [engine.submit(u.audio, options) for u in utterances]
        return " ".join(h.future.result().text.strip() for h in handles)

    print(f"{len(sources)} real clips per call; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(
        "| caller gain dB | line noise dBFS | utterances gate / none | bounds moved (max s) | windows skipped | WER % gate / none |"
    )
    print("|---:|---:|---|---|---:|---|")
    pooled: tuple[list[str], list[str], list[str]] = ([], [], [])
    for gain in (float(g) for g in args.gains_db.split(",")):
        for raw in args.noise_dbfs.split(","):
            noise = None if raw == "none" else float(raw)
            audio = make_call(clips, gain, noise)
            before = gated()
            a = cut(audio, MARGIN_DB)
            skipped = gated() - before
            b = cut(audio, 0.0)
            moved = [
                max(abs(x.start_s - y.start_s), abs(x.end_s - y.end_s)) for x, y in zip(a, b, strict=False)
            ]
            hyp_a, hyp_b = transcribe(a), transcribe(b)
            wer_a, wer_b = corpus_wer([reference], [hyp_a]), corpus_wer([reference], [hyp_b])
            buried = noise is not None and gain - 25 < noise  # the speech's median is -25 dBFS as recorded
            if not buried:
                pooled[0].append(reference)
                pooled[1].append(hyp_a)
                pooled[2].append(hyp_b)
            print(
                f"| {gain:g} | {raw} | {len(a)} / {len(b)} | {sum(m > 0 for m in moved)} ({max(moved, default=0):.2f}) "
                f"| {100 * skipped / (len(audio) // WINDOW):.0f} % | {100 * wer_a:.1f} / {100 * wer_b:.1f}"
                f"{' (speech under the line: not pooled)' if buried else ''} |",
                flush=True,
            )
    refs, hyps_a, hyps_b = pooled
    print(
        f"\npooled over {len(refs)} calls: WER {100 * corpus_wer(refs, hyps_a):.1f} % with the gate, "
        f"{100 * corpus_wer(refs, hyps_b):.1f} % without"
    )
    engine.stop()


if __name__ == "__main__":
    main()
