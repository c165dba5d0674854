#!/usr/bin/env python
"""What grpc.aio alone costs a live call: a server that reads asr.v1 StreamingRecognize requests and
does nothing with them, against real-time calls, in % of a core per call.

    python scripts/bench_grpc_floor.py [--calls 128] [--chunk-ms 20,100] [--seconds 10]

The frontend's own per-call cost (docs/benchmarks.md "Line-noise calls") is this floor plus the VAD,
G.711, resampling and the pipeline. The server runs in a process of its own (this script with
--serve), one asyncio event loop as a frontend has, the same message (160 bytes of audio_content per
20 ms of 8 kHz mu-law); the calls are paced in real time from this process. Its CPU is read from the
server process (user + system, every thread) over the timed pass. The machine and its load average
are printed with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import psutil
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout
from service.runtime.ports import free_port  # noqa: E402

G711_BYTES_PER_S = 8000


class Sink(asr_pb2_grpc.RecognizerServicer):
    """Reads every request of a stream and answers nothing: the transport's cost alone."""

    async def StreamingRecognize(
        self, request_iterator: AsyncIterator[asr_pb2.StreamingRecognizeRequest], context: aio.ServicerContext
    ) -> AsyncIterator[asr_pb2.StreamingRecognizeResponse]:
        async for _ in request_iterator:
            pass
        return
        yield  # a response stream that sends nothing


async def serve(port: int) -> None:
    server = aio.server()
    asr_pb2_grpc.add_RecognizerServicer_to_server(Sink(), server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("serving", flush=True)
    await server.wait_for_termination()


async def call(stub: asr_pb2_grpc.RecognizerStub, chunk_ms: int, seconds: float, t0: float) -> None:
    chunk = bytes(G711_BYTES_PER_S * chunk_ms // 1000)

    async def requests() -> AsyncIterator[asr_pb2.StreamingRecognizeRequest]:
        yield asr_pb2.StreamingRecognizeRequest(
            streaming_config=asr_pb2.StreamingRecognitionConfig(
                config=asr_pb2.RecognitionConfig(encoding=asr_pb2.MULAW, sample_rate_hertz=8000)
            )
        )
        for i in range(round(seconds * 1000 / chunk_ms)):
            await asyncio.sleep(max(0.0, t0 + i * chunk_ms / 1000 - time.monotonic()))
            yield asr_pb2.StreamingRecognizeRequest(audio_content=chunk)

    async for _ in stub.StreamingRecognize(requests()):
        pass


async def drive(port: int, calls: int, chunk_ms: int, seconds: float, server: psutil.Process) -> float:
    """Server CPU per call over one timed pass, % of a core."""
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = asr_pb2_grpc.RecognizerStub(channel)  # type: ignore[no-untyped-call]
        await channel.channel_ready()
        before = server.cpu_times()
        t0 = time.monotonic() + 0.5
        await asyncio.gather(
            *(call(stub, chunk_ms, seconds, t0 + k * chunk_ms / 1000 / calls) for k in range(calls))
        )
        after = server.cpu_times()
    cpu = (after.user - before.user) + (after.system - before.system)
    return 100.0 * cpu / seconds / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=128)
    ap.add_argument("--chunk-ms", default="20,100", help="message sizes, comma-separated")
    ap.add_argument("--seconds", type=float, default=10.0, help="audio per call")
    ap.add_argument("--port", type=int, default=0, help="the bare server's port (0: a free one)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve(args.port))
        return
    args.port = args.port or free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--port", str(args.port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "serving"
        server = psutil.Process(proc.pid)
        print(
            f"grpcio {grpc.__version__}, {os.uname().machine}, {os.cpu_count()} CPUs, "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        print("| calls x message | server CPU % of a core per call (grpc.aio read only) |")
        print("|---|---:|")
        for chunk_ms in (int(c) for c in args.chunk_ms.split(",")):
            pct = asyncio.run(drive(args.port, args.calls, chunk_ms, args.seconds, server))
            print(f"| {args.calls} x {chunk_ms} ms | {pct:.3f} |", flush=True)
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
