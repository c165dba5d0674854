#!/usr/bin/env python
"""Endpointing cost per stream: the VAD run for each stream on its own, and batched across streams,
side by side in one run.

    python scripts/bench_vad.py [--streams 1,32,128] [--chunks-ms 20,100] [--seconds 4]

N telephone calls (8 kHz mu-law made by sox from real speech: jfk.flac, each call starting at a
different point of it) go through what a frontend does per chunk: G.711 decode, resampling to
16 kHz (what the VAD and the engine hear), VAD, the endpointer's state machine. Every call gets one
chunk per tick (the batch is every call; in a server it is whatever arrived in one event-loop
iteration). Two ways:

  per-stream       each call's VAD on its own
  batched          one VAD call per tick for all calls (the server's path)

With --server N, it then runs N real-time calls of 8 kHz mu-law line noise (no speech: the engine
idles, the frontend works) against `asr-server --frontends 1` of this checkout, and of another checkout
at the git ref given with --before (e.g. main), one after the other, and prints the frontend process's CPU
per call (process_cpu_seconds_total) and the mean channels per VAD pass.

Prints CPU per stream as % of one core (process CPU time over the audio's duration, per call), the
VAD's share of it, and the ratio to per-stream; then the utterance bounds found on the telephone
audio of the real-speech sets (windows off the wideband recording's cuts). The machine is shared: the load average
is printed before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
from asr.v1 import asr_pb2

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout

from clients.client import RecognizerClient  # noqa: E402
from harness.server import ServerProcess, checkout  # noqa: E402
from harness.usage import Stopwatch  # noqa: E402
from service.pipeline.audio import StreamDecoder  # noqa: E402
from service.pipeline.endpointing import Endpointer, Utterance  # noqa: E402
from service.pipeline.vad import load_vad  # noqa: E402
from tests.support.audio import make_conversation, to_mulaw_8k_bytes, white_noise  # noqa: E402
from tests.test_vad_batch import CALL, cut, jfk_16k, pocketsphinx_16k, telephone  # noqa: E402

MODES = ("per-stream", "batched")


def jfk_call() -> bytes:
    return to_mulaw_8k_bytes(jfk_16k())


def run(mode: str, calls: list[bytes], chunk_ms: int) -> tuple[float, float, int]:
    """(CPU seconds of the whole loop, of which VAD seconds, utterances found)."""
    vad = load_vad()
    decoders = [StreamDecoder("MULAW", 8000, 1) for _ in calls]
    eps = [Endpointer() for _ in calls]
    step = 8 * chunk_ms  # bytes: one per sample at 8 kHz
    vad_s, found = 0.0, 0
    loop = Stopwatch(descendants=False).start()
    for i in range(0, len(calls[0]), step):
        for data, decoder, ep in zip(calls, decoders, eps, strict=True):
            ep.push(decoder.feed(data[i : i + step])[0])
        with Stopwatch(descendants=False) as scoring:
            if mode.startswith("batched"):
                probs = vad.score([ep.vad_state for ep in eps], [ep.windows() for ep in eps])
            else:
                probs = [vad(ep.vad_state, ep.windows()) for ep in eps]
        vad_s += scoring.cpu_s
        for ep, p in zip(eps, probs, strict=True):
            found += sum(isinstance(e, Utterance) for e in ep.advance(p))
    return loop.stop().cpu_s, vad_s, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,32,128")
    ap.add_argument("--chunks-ms", default="20,100")
    ap.add_argument("--seconds", type=float, default=4.0, help="audio per call")
    ap.add_argument("--server", type=int, default=0, help="calls for the server run (0: none)")
    ap.add_argument("--server-seconds", type=float, default=10.0)
    ap.add_argument("--before", default="", help="a git ref (e.g. main) whose server to run too")
    ap.add_argument("--skip-table", action="store_true", help="only the server run")
    args = ap.parse_args()
    if args.skip_table:
        server_section(args)
        return
    load_vad()
    jfk = jfk_call()
    n_bytes = round(args.seconds * 8000)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}  (2 cores, shared machine)")
    print(f"{args.seconds:g} s of 8 kHz mu-law per call (jfk.flac, each call from a different offset)\n")
    print("| calls | chunk | path | CPU per call (% of a core) | of which VAD | vs per-stream | utterances |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for n in [int(x) for x in args.streams.split(",")]:
        offsets = [(k * 8000 * 7 // max(n, 1)) % len(jfk) for k in range(n)]
        calls = [(jfk[o:] + jfk)[:n_bytes] for o in offsets]
        for chunk_ms in [int(x) for x in args.chunks_ms.split(",")]:
            base = None
            for mode in MODES:
                cpu, vad_s, found = run(mode, calls, chunk_ms)
                per_call = 100 * cpu / (n * args.seconds)
                base = base or per_call
                print(
                    f"| {n} | {chunk_ms} ms | {mode} | {per_call:.3f}% | {100 * vad_s / (n * args.seconds):.3f}% "
                    f"| {base / per_call:.2f}x | {found} |",
                    flush=True,
                )
    print("\nUtterance bounds on telephone audio (8 kHz mu-law by sox), windows (32 ms) off the cuts of the")
    print("original wideband recording, summed over each set (and the worst boundary):\n")
    print("| set | clips | utterances (wideband, telephone) | telephone off |")
    print("|---|---:|---|---:|")
    for name, clips, audio in bound_sets():
        wideband, phone = cut(audio), cut(telephone(audio))
        off = [
            round(abs(x - y) / 0.032)
            for u, w in zip(phone, wideband, strict=False)
            for x, y in ((u.start_s, w.start_s), (u.end_s, w.end_s))
        ]
        print(f"| {name} | {clips} | {len(wideband)}, {len(phone)} | {sum(off)} (max {max(off)}) |")
    if args.server:
        server_section(args)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def server_section(args: argparse.Namespace) -> None:
    print(
        f"\n{args.server} real-time calls of 8 kHz mu-law line noise (-45 dBFS), {args.server_seconds:g} s,"
    )
    print(f"20 ms chunks, against asr-server --frontends 1 (load average now {os.getloadavg()[0]:.2f}):\n")
    print("| server | frontend CPU per call (% of a core) | VAD passes | mean channels per pass |")
    print("|---|---:|---:|---:|")
    with contextlib.ExitStack() as stack:
        sources: list[tuple[str, Path | None]] = [("this checkout", None)]
        if args.before:
            sources.append((f"before: {args.before}", stack.enter_context(checkout(args.before))))
        for name, source in sources:
            cpu, passes, channels = server_run(source, args.server, args.server_seconds)
            mean = f"{channels / passes:.1f}" if passes else "(no VAD metric)"
            print(
                f"| {name} | {100 * cpu / (args.server * args.server_seconds):.3f}% | {passes:.0f} | {mean} |",
                flush=True,
            )


def server_run(source: Path | None, calls: int, seconds: float) -> tuple[float, float, float]:
    """(frontend CPU seconds, VAD passes, channels scored) over the calls, against a server of `source`'s
    code (None: this checkout's)."""
    flags = ("--frontends", "1", "--max-streams", str(calls + 8))
    with ServerProcess(*flags, threads=None, source=source) as server:
        server.wait_serving(180)
        before = server.metrics()
        asyncio.run(paced_calls(server.target, calls, seconds))
        gained = server.metrics().since(before)
    return (
        gained.sum("process_cpu_seconds_total", process="frontend-0"),
        gained.sum("asr_vad_batch_channels_count"),
        gained.sum("asr_vad_batch_channels_sum"),
    )


async def paced_calls(target: str, calls: int, seconds: float) -> None:
    """`calls` calls of line noise, each paced in real time in 20 ms chunks."""
    async with RecognizerClient(target) as client:
        await client.wait_until_serving(180)
        noise = to_mulaw_8k_bytes(white_noise(seconds, dbfs=-45.0))
        chunks = [noise[i : i + 160] for i in range(0, len(noise), 160)]
        config = asr_pb2.StreamingRecognitionConfig(
            config=asr_pb2.RecognitionConfig(encoding=asr_pb2.MULAW, sample_rate_hertz=8000)
        )

        async def paced(offset: float) -> AsyncIterator[bytes]:
            await asyncio.sleep(offset)
            start = time.monotonic()
            for k, chunk in enumerate(chunks):
                await asyncio.sleep(max(0.0, start + k * 0.02 - time.monotonic()))
                yield chunk

        async def call(k: int) -> None:
            async for _ in client.stream(config, paced(0.02 * k / calls)):
                pass

        await asyncio.gather(*(call(k) for k in range(calls)))


def bound_sets() -> list[tuple[str, int, np.ndarray]]:
    return [
        ("jfk.flac (real)", 1, jfk_16k()),
        ("pocketsphinx librivox (real)", 5, pocketsphinx_16k("librivox")),
        ("pocketsphinx cards (real)", 5, pocketsphinx_16k("cards")),
        ("espeak-ng conversation", 1, make_conversation(CALL, pause_s=1.0)[0]),
    ]


if __name__ == "__main__":
    main()
