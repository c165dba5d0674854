"""Long recorded calls through Recognize: wall time and the server's peak RSS per recording.

Each case starts its own `asr-server` (so its peak RSS belongs to that case alone: the sum of each of
its processes' VmHWM, supervisor, engine and frontends), sends one recording through Recognize and
prints a markdown row:

- `20min`: jfk.flac repeated to 20 minutes, 16 kHz mono WAV (37 MB);
- `2h`: the same to 2 hours, as FLAC (the WAV would be 230 MB);
- `10h-silence`: 10 hours of silence as FLAC (a few MB), once with the default --max-recognize-seconds
  (refused before decoding) and once with the limit raised to 10 h (decoded block by block).

    python scripts/bench_long_recordings.py 20min 10h-silence
    python scripts/bench_long_recordings.py --threads 2 2h

The server gets --max-recognize-bytes 512 MiB so that every recording fits in one request.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import soundfile as sf
import soxr
from asr.v1 import asr_pb2, asr_pb2_grpc

from harness.server import ServerProcess
from harness.usage import Stopwatch, peak_rss_bytes

REPO = Path(__file__).resolve().parents[1]
JFK_FLAC = REPO.parent / "shared" / "data" / "jfk.flac"
RATE = 16000
MAX_BYTES = 512 << 20


def jfk_16k() -> np.ndarray:
    audio, rate = sf.read(JFK_FLAC, dtype="float32")
    return soxr.resample(audio.mean(axis=1), rate, RATE).astype(np.float32)


def repeated_jfk(seconds: float, fmt: str) -> bytes:
    clip = (jfk_16k() * 32767).astype(np.int16)
    reps = int(np.ceil(seconds * RATE / len(clip)))
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", RATE, 1, format=fmt, subtype="PCM_16") as f:
        for _ in range(reps):
            f.write(clip)
    return buf.getvalue()


def silence_flac(seconds: float) -> bytes:
    minute = np.zeros(RATE * 60, dtype=np.int16)
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", RATE, 1, format="FLAC", subtype="PCM_16") as f:
        for _ in range(round(seconds / 60)):
            f.write(minute)
    return buf.getvalue()


@dataclass
class Case:
    name: str
    make: Callable[[], bytes]
    encoding: int
    server_args: tuple[str, ...] = ()


CASES: dict[str, list[Case]] = {
    "20min": [Case("20 min call (jfk x110), 16 kHz WAV", lambda: repeated_jfk(1200, "WAV"), asr_pb2.WAV)],
    "2h": [Case("2 h call (jfk x655), 16 kHz FLAC", lambda: repeated_jfk(7200, "FLAC"), asr_pb2.FLAC)],
    "10h-silence": [
        Case("10 h silence FLAC, default limit (4 h)", lambda: silence_flac(36000), asr_pb2.FLAC),
        Case(
            "10 h silence FLAC, --max-recognize-seconds 36000",
            lambda: silence_flac(36000),
            asr_pb2.FLAC,
            ("--max-recognize-seconds", "36000"),
        ),
    ],
}


def peak_rss_mib(server: ServerProcess) -> float:
    """The sum of each server process's own peak RSS (supervisor, engine, frontends)."""
    return peak_rss_bytes(server.proc.pid) / 2**20


def run_case(case: Case, threads: int) -> str:
    data = case.make()
    flags = ("--log-level", "warning", "--max-recognize-bytes", str(MAX_BYTES), *case.server_args)
    with ServerProcess(*flags, threads=threads, log_format="text") as server:
        server.wait_serving(300)
        idle = peak_rss_mib(server)
        options = [("grpc.max_send_message_length", MAX_BYTES + (1 << 16))]
        with grpc.insecure_channel(server.target, options=options) as channel:
            stub = asr_pb2_grpc.RecognizerStub(channel)
            request = asr_pb2.RecognizeRequest(
                config=asr_pb2.RecognitionConfig(encoding=case.encoding),  # type: ignore[arg-type]
                audio_content=data,
            )
            with Stopwatch(descendants=False) as timed:
                try:
                    response = stub.Recognize(request, timeout=3 * 3600)
                    outcome = f"OK, {len(response.results)} results"
                    audio_s = response.total_audio_duration.ToTimedelta().total_seconds()
                except grpc.RpcError as e:
                    outcome = f"{e.code().name}"  # type: ignore[attr-defined]
                    audio_s = 0.0
        peak = peak_rss_mib(server)
    mb = len(data) / 1e6
    audio = f"{audio_s / 60:.1f} min" if audio_s else "-"
    return (
        f"| {case.name} | {mb:.1f} MB | {audio} | {outcome} | {timed.wall_s:.1f} s | "
        f"{idle:.0f} MiB | {peak:.0f} MiB | {peak - idle:+.0f} MiB |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("cases", nargs="+", choices=list(CASES))
    parser.add_argument("--threads", type=int, default=2, help="asr-server --threads")
    args = parser.parse_args()
    load = os.getloadavg()
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, asr-server --threads "
        f"{args.threads}, tiny.en; load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n"
    )
    print(
        "| recording | size | audio | outcome | Recognize wall time | peak RSS before the call | peak RSS after | growth |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.cases:
        for case in CASES[name]:
            print(run_case(case, args.threads), flush=True)
    load = os.getloadavg()
    print(f"\nload average at end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
