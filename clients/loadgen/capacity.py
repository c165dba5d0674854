"""`asr-loadgen capacity`: N live calls held open at once, each paced in real time (line noise, or a
manifest's speech looped), then half-closed: did the server keep up (close lag), at what CPU per call
(process_cpu_seconds_total over all its processes, and per process), and the IPC time per utterance."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import multiprocessing
import os
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from asr.v1 import asr_pb2

from clients.client import G711_RATE, RecognizerClient
from clients.loadgen.audio import (
    LINE_NOISE_DBFS,
    STREAM_TIMEOUT_S,
    Utterance,
    call_audio,
    chunk_bytes,
    line_noise,
    load_utterances,
    stream_config,
)
from clients.loadgen.report import fmt
from clients.manifest import load_manifest
from harness.metrics import Metrics, scrape
from harness.stats import percentile
from harness.usage import Stopwatch

KEEP_UP_LAG_S = 0.5  # issue 12: a server keeps up when streams close within this of their last chunk


@dataclass
class CallResult:
    code: str  # gRPC status name; OK on success
    details: str
    audio_s: float
    finals: int
    close_lag_s: float | None  # last chunk sent -> the server closed the stream; None on failure
    send_late_s: float  # most a chunk left behind its real-time schedule (client or flow control)


async def live_call(client: RecognizerClient, u: Utterance, chunk_ms: int, start_at: float) -> CallResult:
    """One call paced in real time from `start_at` (time.perf_counter()); measures its close lag."""
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    step = chunk_bytes(u, chunk_ms)
    last_sent: float | None = None
    late = 0.0

    async def audio() -> AsyncIterator[bytes]:
        nonlocal last_sent, late
        t0 = time.perf_counter()
        for n, off in enumerate(range(0, len(u.data), step)):
            delay = t0 + n * step / u.bytes_per_second - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                late = max(late, -delay)
            yield u.data[off : off + step]
        last_sent = time.perf_counter()  # the last chunk is written (see recognize_one)

    finals = 0
    try:
        responses = client.stream(stream_config(u), audio(), deadline_s=u.duration_s + STREAM_TIMEOUT_S)
        async with contextlib.aclosing(responses):
            async for resp in responses:
                finals += sum(1 for r in resp.results if r.is_final)
        closed = time.perf_counter()
    except grpc.aio.AioRpcError as exc:
        return CallResult(exc.code().name, exc.details() or "", u.duration_s, finals, None, late)
    if last_sent is None:
        return CallResult(
            "CLIENT_ERROR", "the call ended OK before all audio was sent", u.duration_s, finals, None, late
        )
    return CallResult("OK", "", u.duration_s, finals, closed - last_sent, late)


async def _capacity_calls(
    target: str, token: str | None, calls: list[Utterance], chunk_ms: int, connections: int, start_wall: float
) -> tuple[list[CallResult], float]:
    """Run these calls from this process over `connections` connections; (results, this process's CPU s)."""
    # a local subchannel pool per client: each client is its own TCP connection, so that SO_REUSEPORT
    # spreads the calls over the server's frontends as separate callers' connections would be
    clients = [
        RecognizerClient(target, token=token, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(max(1, min(connections, len(calls))))
    ]
    try:
        for c in clients:
            await c.wait_until_serving(30.0)
        used = Stopwatch(descendants=False).start()  # this process: the load generator's own cost
        start = time.perf_counter() + max(0.0, start_wall - time.time())
        chunk_s = chunk_ms / 1000
        # calls start spread over one chunk's time: live calls' chunks do not arrive in lockstep
        results = await asyncio.gather(
            *(
                live_call(clients[i % len(clients)], u, chunk_ms, start + chunk_s * i / len(calls))
                for i, u in enumerate(calls)
            )
        )
        return list(results), used.stop().cpu_s
    finally:
        for c in clients:
            await c.close()


def _capacity_process(
    target: str, token: str | None, calls: list[Utterance], chunk_ms: int, connections: int, start_wall: float
) -> tuple[list[CallResult], float]:
    return asyncio.run(_capacity_calls(target, token, calls, chunk_ms, connections, start_wall))


async def _scrape_or_empty(url: str) -> Metrics:
    try:
        return await asyncio.to_thread(scrape, url)
    except (OSError, ValueError) as exc:
        print(f"asr-loadgen: could not read {url}: {exc}", file=sys.stderr)
        return Metrics()


async def run_capacity(args: argparse.Namespace) -> dict[str, Any]:
    """`args.calls` live calls at once, each `args.seconds` of audio paced in real time in
    `args.chunk_ms` chunks, then half-closed: did the server keep up, and at what CPU per call?"""
    load_start = os.getloadavg()
    if args.manifest:
        utts = load_utterances(load_manifest(args.manifest))
        calls = [call_audio(utts, args.seconds, i) for i in range(args.calls)]
        source = str(args.manifest)
    else:
        calls = [
            Utterance(i, asr_pb2.MULAW, G711_RATE, line_noise(args.seconds, i), G711_RATE, args.seconds, "")
            for i in range(args.calls)
        ]
        source = f"line noise (white, {LINE_NOISE_DBFS:g} dBFS, 8 kHz mu-law)"
    async with RecognizerClient(args.server, token=args.token) as probe:
        await probe.wait_until_serving(args.wait_ready)
    processes = max(1, min(args.client_processes, args.calls))
    shares = [calls[p::processes] for p in range(processes)]
    per_process_connections = max(1, args.connections // processes)
    before = await _scrape_or_empty(args.metrics)
    start_wall = time.time() + (2.0 if processes > 1 else 0.0)  # spawned workers start together
    if processes == 1:
        outcomes = [
            await _capacity_calls(
                args.server, args.token, shares[0], args.chunk_ms, per_process_connections, start_wall
            )
        ]
    else:
        loop = asyncio.get_running_loop()
        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            outcomes = await asyncio.gather(
                *(
                    loop.run_in_executor(
                        pool, _capacity_process, args.server, args.token, share, args.chunk_ms,
                        per_process_connections, start_wall,
                    )
                    for share in shares
                )
            )  # fmt: skip
    wall = time.time() - start_wall  # from the common start to the last stream's close
    after = await _scrape_or_empty(args.metrics)
    results = [r for rs, _ in outcomes for r in rs]
    client_cpu = sum(cpu for _, cpu in outcomes)
    lags = [r.close_lag_s for r in results if r.close_lag_s is not None]
    gained = after.since(before) if before and after else Metrics()
    # one series per server process (process="engine", "frontend-0", ...); a restarted one's counter
    # starts again at 0, so a negative change is no CPU rather than negative CPU
    by_process = {
        k: max(0.0, v) for k, v in gained.by("process_cpu_seconds_total", "process", missing="server").items()
    }
    cpu = sum(by_process.values()) if by_process else None
    audio_s = sum(r.audio_s for r in results)
    ipc_count, ipc_sum = gained.histogram("asr_ipc_seconds")
    errors = dict(Counter(r.code for r in results if r.code != "OK"))
    p95 = percentile(lags, 95)
    return {
        "mode": "capacity",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "server": args.server,
        "audio": source,
        "calls": args.calls,
        "chunk_ms": args.chunk_ms,
        "seconds_per_call": args.seconds,
        "connections": per_process_connections * processes,
        "client_processes": processes,
        "wall_s": round(wall, 3),
        "ok": sum(1 for r in results if r.code == "OK"),
        "errors": errors,
        "error_details": sorted({r.details for r in results if r.code != "OK"})[:5],
        "finals": sum(r.finals for r in results),
        "close_lag_p50_s": percentile(lags, 50),
        "close_lag_p95_s": p95,
        "close_lag_max_s": max(lags) if lags else None,
        "client_send_late_max_s": max((r.send_late_s for r in results), default=0.0),
        "kept_up": not errors and p95 is not None and p95 <= KEEP_UP_LAG_S,
        "server_cpu_s": cpu,
        "server_cpu_s_by_process": by_process,
        # CPU seconds per second of call audio: the share of one core each live call costs
        "cpu_per_call_pct": None if cpu is None or audio_s <= 0 else 100 * cpu / audio_s,
        "server_cores_used": None if cpu is None or wall <= 0 else cpu / wall,
        "client_cores_used": client_cpu / wall if wall > 0 else None,
        "ipc_utterances": int(ipc_count),
        "ipc_mean_s": ipc_sum / ipc_count if ipc_count else None,
        "loadavg_1m_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
    }


def capacity_line(r: dict[str, Any]) -> str:
    """One human line for a capacity run."""
    errs = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "0"
    return (
        f"{r['calls']} calls x {r['seconds_per_call']:g} s in {r['chunk_ms']} ms chunks: "
        f"kept up {'yes' if r['kept_up'] else 'NO'}; close lag p50/p95/max "
        f"{fmt(r['close_lag_p50_s'])}/{fmt(r['close_lag_p95_s'])}/{fmt(r['close_lag_max_s'])} s; "
        f"server CPU {fmt(r['cpu_per_call_pct'], '{:.3f}')}% of a core per call "
        f"({fmt(r['server_cores_used'])} cores: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in r["server_cpu_s_by_process"].items())
        + f"); IPC {r['ipc_utterances']} utterances, mean {fmt(r['ipc_mean_s'], '{:.4f}')} s; "
        f"errors {errs}; client {fmt(r['client_cores_used'])} cores, sent late by at most "
        f"{r['client_send_late_max_s']:.2f} s"
    )
