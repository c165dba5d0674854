"""`asr-loadgen`: drive concurrent StreamingRecognize streams and report throughput, latency, WER.

    asr-loadgen make-manifest --out DIR [--telephone] [--count N]
    asr-loadgen run --server 127.0.0.1:50051 --manifest DIR/manifest.jsonl \\
        [--concurrency 1,4,16,64] [--utterances-per-level N | --duration S] [--realtime] \\
        [--chunk-ms 20] [--metrics http://127.0.0.1:9464/metrics] [--out DIR] [--label NAME]
    asr-loadgen compare BASELINE.json BATCHED.json [--out DIR]
    asr-loadgen capacity --server 127.0.0.1:50051 --metrics http://127.0.0.1:9464/metrics \\
        [--calls 128] [--chunk-ms 20] [--seconds 30] [--manifest DIR/manifest.jsonl]

One gRPC stream per utterance: config, the audio in `--chunk-ms` chunks, half-close, then
read finals until the server closes the stream. Each of the N workers runs one such stream
after another. Per-utterance streams measure the engine rather than our endpointing: the
half-close ends the utterance at a known instant (the last audio byte), so latency is exactly
"last audio byte sent -> final result received", with no VAD silence timer inside it, and a
failed utterance cannot take others down with it. Opening a stream on an established HTTP/2
connection costs well under a millisecond, so per-utterance streams do not skew throughput.

`--realtime` paces each stream at the audio's own rate (a live call); otherwise audio is sent
as fast as possible (a replay of recorded calls, the throughput test).

`capacity` holds N calls open at once, each paced in real time for `--seconds` (line noise by
default: the frontends' per-chunk work with no engine work at all; or a manifest's speech), then
half-closes them. It reports whether the server kept up (a stream's close lag, last chunk sent ->
stream closed, at p95 <= 0.5 s with no errors), the server's CPU summed over all its processes
(process_cpu_seconds_total) per second of call audio (% of a core per call) and per process, and the
IPC time per utterance (asr_ipc_seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import io
import itertools
import json
import math
import multiprocessing
import os
import platform
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import soundfile as sf
from asr.v1 import asr_pb2

from clients.client import G711_RATE, RecognizerClient
from clients.manifest import ManifestEntry, build_manifest, load_manifest
from clients.scoring import corpus_wer

DEFAULT_CONCURRENCY = (1, 4, 16, 64)
STREAM_TIMEOUT_S = 300.0  # a stuck server shows as DEADLINE_EXCEEDED rather than a hung benchmark
RSS_METRIC = "process_resident_memory_bytes"
SERVER_INFO_METRICS = ("asr_model_info", "asr_build_info", "asr_kv_cache_bytes")  # recorded with each run


# ---------------------------------------------------------------- audio from the manifest


@dataclass(frozen=True)
class Utterance:
    index: int
    encoding: int  # asr_pb2.AudioEncoding
    sample_rate: int
    data: bytes  # raw samples, as sent on the wire
    bytes_per_second: int
    duration_s: float
    text: str


def load_utterances(entries: Sequence[ManifestEntry]) -> list[Utterance]:
    """Read every file once, up front, so disk reads never sit inside a timed stream."""
    out: list[Utterance] = []
    for i, e in enumerate(entries):
        if e.encoding == "MULAW":
            data = Path(e.audio).read_bytes()  # headerless G.711: already the wire format
            bps = e.sample_rate
            enc = asr_pb2.MULAW
        else:
            pcm, rate = sf.read(e.audio, dtype="int16", always_2d=True)
            if rate != e.sample_rate:
                raise ValueError(f"{e.audio}: file says {rate} Hz, manifest says {e.sample_rate}")
            data = pcm[:, 0].tobytes()
            bps = 2 * e.sample_rate
            enc = asr_pb2.LINEAR16
        out.append(Utterance(i, enc, e.sample_rate, data, bps, len(data) / bps, e.text))
    return out


# ---------------------------------------------------------------- one stream


@dataclass
class UtteranceResult:
    index: int
    code: str  # gRPC status name; OK on success
    audio_s: float
    reference: str
    hypothesis: str = ""
    latency_s: float | None = None  # last audio byte -> last final; None when no final came
    start: float = 0.0
    end: float = 0.0
    finals: int = 0
    details: str = ""


def _stream_config(u: Utterance) -> asr_pb2.StreamingRecognitionConfig:
    cfg = asr_pb2.RecognitionConfig(
        encoding=u.encoding,  # type: ignore[arg-type]
        sample_rate_hertz=u.sample_rate,
        audio_channel_count=1,
    )
    return asr_pb2.StreamingRecognitionConfig(config=cfg)


def chunk_bytes(u: Utterance, chunk_ms: int) -> int:
    """Bytes per message: `chunk_ms` of audio in whole samples."""
    step = max(1, u.bytes_per_second * chunk_ms // 1000)
    if u.encoding == asr_pb2.LINEAR16:
        step -= step % 2  # whole 16-bit samples per message
    return max(step, 2 if u.encoding == asr_pb2.LINEAR16 else 1)


async def recognize_one(
    client: RecognizerClient,
    u: Utterance,
    *,
    realtime: bool,
    chunk_ms: int,
) -> UtteranceResult:
    """One stream through `RecognizerClient.stream` (the one streaming implementation, with its
    grpc.aio workaround): config, the audio in `chunk_ms` chunks, half-close, finals until the end."""
    res = UtteranceResult(index=u.index, code="OK", audio_s=u.duration_s, reference=u.text)
    step = chunk_bytes(u, chunk_ms)
    texts: list[str] = []
    last_final = 0.0
    last_byte: float | None = None

    async def audio() -> AsyncIterator[bytes]:
        nonlocal last_byte
        t0 = time.perf_counter()  # asked for the first chunk: the server has accepted the stream
        for n, off in enumerate(range(0, len(u.data), step)):
            if realtime:
                # absolute schedule: chunk n leaves when its audio would have been spoken
                delay = t0 + n * step / u.bytes_per_second - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            yield u.data[off : off + step]
        # grpc.aio asks for the next message only once the previous one is written: the last byte is out
        last_byte = time.perf_counter()

    res.start = time.perf_counter()
    try:
        responses = client.stream(_stream_config(u), audio(), deadline_s=STREAM_TIMEOUT_S)
        async with contextlib.aclosing(responses):
            async for resp in responses:
                for r in resp.results:
                    if r.is_final:
                        last_final = time.perf_counter()
                        res.finals += 1
                        if r.alternatives:
                            texts.append(r.alternatives[0].transcript.strip())
        if last_final and last_byte is not None:
            res.latency_s = last_final - last_byte
        if last_byte is None:
            res.code, res.details = "CLIENT_ERROR", "the call ended OK before all audio was sent"
    except grpc.aio.AioRpcError as exc:
        res.code = exc.code().name
        res.details = exc.details() or ""
    res.end = time.perf_counter()
    res.hypothesis = " ".join(t for t in texts if t)
    return res


# ---------------------------------------------------------------- server metrics


def scrape(url: str, timeout: float = 2.0) -> dict[str, float]:
    """Every sample of a Prometheus exposition, keyed `name{labels}` (labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def cost_per_utterance(
    before: dict[str, float], after: dict[str, float], utterances: int
) -> dict[str, float]:
    """Seconds per utterance spent in each of the server's `*_seconds` histograms during a level,
    plus the server's CPU seconds per utterance (process_cpu_seconds_total: every thread, so
    it stays meaningful when other work shares the machine and wall times stretch)."""
    if utterances <= 0:
        return {}
    out: dict[str, float] = {}
    for key, v in after.items():
        name = key.split("{", 1)[0]
        if name == "process_cpu_seconds_total":
            # one series per server process (process="engine", "frontend-0", ...): their sum
            out["process_cpu_seconds"] = (
                out.get("process_cpu_seconds", 0.0) + (v - before.get(key, v)) / utterances
            )
            continue
        if not name.endswith("_seconds_sum"):
            continue
        d = v - before.get(key, 0.0)
        if d > 0:
            base = name.removesuffix("_sum")
            out[base] = out.get(base, 0.0) + d / utterances
    return dict(sorted(out.items()))


class RssSampler:
    """Polls the server's metrics during a level for its peak resident memory."""

    def __init__(self, url: str | None, interval_s: float = 0.5) -> None:
        self.url = url
        self.interval_s = interval_s
        self.peak: float | None = None
        self.last_error = ""

    async def sample_once(self) -> None:
        if not self.url:
            return
        try:
            m = await asyncio.to_thread(scrape, self.url)
        except (OSError, ValueError) as exc:
            self.last_error = str(exc)
            return
        # one series per server process (process="engine", "frontend-0", ...): the server's is their sum
        series = [v for k, v in m.items() if k.split("{", 1)[0] == RSS_METRIC]
        rss = sum(series) if series else None
        if rss is not None:
            self.peak = rss if self.peak is None else max(self.peak, rss)

    async def run(self) -> None:
        while True:
            await self.sample_once()
            await asyncio.sleep(self.interval_s)


# ---------------------------------------------------------------- one concurrency level


@dataclass
class LevelResult:
    concurrency: int
    utterances: int
    ok: int
    wall_s: float
    utt_per_s: float
    audio_s_per_s: float
    latency_p50_s: float | None
    latency_p95_s: float | None
    latency_p99_s: float | None
    latency_mean_s: float | None
    wer: float | None
    errors: dict[str, int]
    no_final: int
    peak_rss_bytes: float | None
    server_seconds_per_utterance: dict[str, float] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def summarize(concurrency: int, results: list[UtteranceResult], peak_rss: float | None) -> LevelResult:
    ok = [r for r in results if r.code == "OK"]
    wall = (max(r.end for r in results) - min(r.start for r in results)) if results else 0.0
    lat = [r.latency_s for r in ok if r.latency_s is not None]
    return LevelResult(
        concurrency=concurrency,
        utterances=len(results),
        ok=len(ok),
        wall_s=wall,
        utt_per_s=len(ok) / wall if wall > 0 else 0.0,
        audio_s_per_s=sum(r.audio_s for r in ok) / wall if wall > 0 else 0.0,
        latency_p50_s=percentile(lat, 50),
        latency_p95_s=percentile(lat, 95),
        latency_p99_s=percentile(lat, 99),
        latency_mean_s=sum(lat) / len(lat) if lat else None,
        wer=corpus_wer([r.reference for r in ok], [r.hypothesis for r in ok]) if ok else None,
        errors=dict(Counter(r.code for r in results if r.code != "OK")),
        no_final=sum(1 for r in ok if r.latency_s is None),
        peak_rss_bytes=peak_rss,
    )


class Progress:
    """One status line on stderr: rewritten in place on a terminal, every few seconds in a log."""

    def __init__(self, concurrency: int, total: int | None, results: list[UtteranceResult]) -> None:
        self.concurrency = concurrency
        self.total = total
        self.results = results
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def line(self) -> str:
        done = len(self.results)
        el = time.perf_counter() - self.t0
        errs = sum(1 for r in self.results if r.code != "OK")
        lat = sorted(r.latency_s for r in self.results if r.latency_s is not None)
        p95 = f"{percentile(lat, 95):.2f}s" if lat else "-"
        of = f"/{self.total}" if self.total else ""
        rate = done / el if el else 0.0
        return (
            f"[c={self.concurrency}] {done}{of} utt  {el:5.1f}s  {rate:5.2f} utt/s  p95 {p95}  errors {errs}"
        )

    async def run(self) -> None:
        every = 1.0 if self.tty else 5.0
        while True:
            await asyncio.sleep(every)
            self.emit()

    def emit(self, final: bool = False) -> None:
        if self.tty:
            print("\r" + self.line().ljust(90), end="\n" if final else "", file=sys.stderr, flush=True)
        else:
            print(self.line(), file=sys.stderr, flush=True)


async def run_level(
    client: RecognizerClient,
    utts: Sequence[Utterance],
    concurrency: int,
    *,
    count: int | None,
    duration_s: float | None,
    realtime: bool,
    chunk_ms: int,
    metrics_url: str | None,
    start_index: int = 0,
) -> LevelResult:
    """`concurrency` workers, each running one utterance stream after another, until `count`
    utterances have started or `duration_s` has passed; in-flight ones are then finished."""
    results: list[UtteranceResult] = []
    order: Iterator[int] = itertools.count(start_index)
    started = 0
    deadline = time.perf_counter() + duration_s if duration_s else None

    def next_utterance() -> Utterance | None:
        nonlocal started
        if count is not None and started >= count:
            return None
        if deadline is not None and time.perf_counter() >= deadline:
            return None
        started += 1
        return utts[next(order) % len(utts)]

    async def worker() -> None:
        while (u := next_utterance()) is not None:
            results.append(await recognize_one(client, u, realtime=realtime, chunk_ms=chunk_ms))

    sampler = RssSampler(metrics_url)
    before: dict[str, float] = {}
    if metrics_url:
        with contextlib.suppress(OSError, ValueError):
            before = await asyncio.to_thread(scrape, metrics_url)
    progress = Progress(concurrency, count, results)
    bg = [asyncio.create_task(sampler.run()), asyncio.create_task(progress.run())]
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        for t in bg:
            t.cancel()
        await asyncio.gather(*bg, return_exceptions=True)
    progress.emit(final=True)
    await sampler.sample_once()
    level = summarize(concurrency, results, sampler.peak)
    if metrics_url and before:
        with contextlib.suppress(OSError, ValueError):
            after = await asyncio.to_thread(scrape, metrics_url)
            level.server_seconds_per_utterance = cost_per_utterance(before, after, level.ok)
    level.samples = [
        {"index": r.index, "code": r.code, "latency_s": r.latency_s, "audio_s": round(r.audio_s, 3),
         "hypothesis": r.hypothesis, "details": r.details}
        for r in sorted(results, key=lambda r: r.start)
    ]  # fmt: skip
    return level


async def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    load_start = os.getloadavg()  # a busy machine explains slow figures: record how busy it was
    entries = load_manifest(args.manifest)
    utts = load_utterances(entries)
    levels: list[LevelResult] = []
    async with RecognizerClient(args.server, token=args.token) as client:
        await client.wait_until_serving(args.wait_ready)
        for i in range(
            args.warmup
        ):  # untimed: first-call costs (allocator, thread pools) stay out of level 1
            w = await recognize_one(client, utts[i % len(utts)], realtime=False, chunk_ms=args.chunk_ms)
            if w.code != "OK":
                print(f"asr-loadgen: warm-up utterance failed: {w.code} {w.details}", file=sys.stderr)
        info: dict[str, float] = {}
        if args.metrics:
            with contextlib.suppress(OSError, ValueError):
                info = {k: v for k, v in scrape(args.metrics).items() if k.startswith(SERVER_INFO_METRICS)}
        for c in args.concurrency:
            count = None if args.duration else (args.utterances_per_level or max(len(utts), 3 * c))
            levels.append(
                await run_level(
                    client, utts, c, count=count, duration_s=args.duration, realtime=args.realtime,
                    chunk_ms=args.chunk_ms, metrics_url=args.metrics,
                )
            )  # fmt: skip
    return {
        "label": args.label,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "server": args.server,
        "manifest": str(args.manifest),
        "manifest_utterances": len(utts),
        "manifest_audio_s": round(sum(u.duration_s for u in utts), 3),
        "realtime": args.realtime,
        "chunk_ms": args.chunk_ms,
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_1m_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        },
        "server_info": info,
        "levels": [asdict(lv) for lv in levels],
    }


# ---------------------------------------------------------------- capacity: many live calls at once

KEEP_UP_LAG_S = 0.5  # issue 12: a server keeps up when streams close within this of their last chunk
LINE_NOISE_DBFS = -50.0  # an idle telephone line's hiss: the VAD hears no speech, the engine gets nothing


@dataclass
class CallResult:
    code: str  # gRPC status name; OK on success
    details: str
    audio_s: float
    finals: int
    close_lag_s: float | None  # last chunk sent -> the server closed the stream; None on failure
    send_late_s: float  # most a chunk left behind its real-time schedule (client or flow control)


def line_noise(seconds: float, seed: int) -> bytes:
    """`seconds` of white noise at LINE_NOISE_DBFS as 8 kHz G.711 mu-law (soundfile's encoder)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(round(G711_RATE * seconds)) * 10 ** (LINE_NOISE_DBFS / 20)
    buf = io.BytesIO()
    sf.write(buf, np.clip(x, -1.0, 1.0), G711_RATE, format="RAW", subtype="ULAW")
    return buf.getvalue()


def call_audio(utts: Sequence[Utterance], seconds: float, call: int) -> Utterance:
    """Call `call`'s audio: the utterances back to back from utterance `call` on (so calls differ),
    looped to `seconds`. Every utterance must share one encoding and rate."""
    first = utts[0]
    if any((u.encoding, u.sample_rate) != (first.encoding, first.sample_rate) for u in utts):
        raise ValueError("capacity --manifest: every utterance must have the same encoding and rate")
    want = round(seconds * first.bytes_per_second)
    want -= want % (2 if first.encoding == asr_pb2.LINEAR16 else 1)
    parts: list[bytes] = []
    have, i = 0, call
    while have < want:
        data = utts[i % len(utts)].data
        parts.append(data)
        have += len(data)
        i += 1
    data = b"".join(parts)[:want]
    text = " ".join(utts[j % len(utts)].text for j in range(call, i))
    return Utterance(call, first.encoding, first.sample_rate, data, first.bytes_per_second, seconds, text)


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
        responses = client.stream(_stream_config(u), audio(), deadline_s=u.duration_s + STREAM_TIMEOUT_S)
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
        cpu0 = time.process_time()
        start = time.perf_counter() + max(0.0, start_wall - time.time())
        chunk_s = chunk_ms / 1000
        # calls start spread over one chunk's time: live calls' chunks do not arrive in lockstep
        results = await asyncio.gather(
            *(
                live_call(clients[i % len(clients)], u, chunk_ms, start + chunk_s * i / len(calls))
                for i, u in enumerate(calls)
            )
        )
        return list(results), time.process_time() - cpu0
    finally:
        for c in clients:
            await c.close()


def _capacity_process(
    target: str, token: str | None, calls: list[Utterance], chunk_ms: int, connections: int, start_wall: float
) -> tuple[list[CallResult], float]:
    return asyncio.run(_capacity_calls(target, token, calls, chunk_ms, connections, start_wall))


def server_cpu_by_process(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each server process used between two scrapes (process_cpu_seconds_total, one series
    per process of a multi-process server, labelled process=engine/frontend-N/supervisor)."""
    out: dict[str, float] = {}
    for key, v in after.items():
        if key.split("{", 1)[0] != "process_cpu_seconds_total":
            continue
        label = key.partition("process=")[2].rstrip("}").split(",")[0] or "server"
        out[label] = out.get(label, 0.0) + max(0.0, v - before.get(key, 0.0))
    return dict(sorted(out.items()))


def histogram_delta(before: dict[str, float], after: dict[str, float], name: str) -> tuple[float, float]:
    """(count, sum) a histogram gained between two scrapes, over all its label sets."""
    count = total = 0.0
    for key, v in after.items():
        base = key.split("{", 1)[0]
        if base == f"{name}_count":
            count += v - before.get(key, 0.0)
        elif base == f"{name}_sum":
            total += v - before.get(key, 0.0)
    return count, total


async def _scrape_or_empty(url: str) -> dict[str, float]:
    try:
        return await asyncio.to_thread(scrape, url)
    except (OSError, ValueError) as exc:
        print(f"asr-loadgen: could not read {url}: {exc}", file=sys.stderr)
        return {}


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
    by_process = server_cpu_by_process(before, after) if before and after else {}
    cpu = sum(by_process.values()) if by_process else None
    audio_s = sum(r.audio_s for r in results)
    ipc_count, ipc_sum = histogram_delta(before, after, "asr_ipc_seconds") if before and after else (0.0, 0.0)
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
        f"{_f(r['close_lag_p50_s'])}/{_f(r['close_lag_p95_s'])}/{_f(r['close_lag_max_s'])} s; "
        f"server CPU {_f(r['cpu_per_call_pct'], '{:.3f}')}% of a core per call "
        f"({_f(r['server_cores_used'])} cores: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in r["server_cpu_s_by_process"].items())
        + f"); IPC {r['ipc_utterances']} utterances, mean {_f(r['ipc_mean_s'], '{:.4f}')} s; "
        f"errors {errs}; client {_f(r['client_cores_used'])} cores, sent late by at most "
        f"{r['client_send_late_max_s']:.2f} s"
    )


# ---------------------------------------------------------------- reports


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _mib(v: float | None) -> str:
    return "-" if v is None else f"{v / 2**20:.0f}"


def _cpu(level: dict[str, Any]) -> float | None:
    return level.get("server_seconds_per_utterance", {}).get("process_cpu_seconds")


def markdown_table(result: dict[str, Any]) -> str:
    rows = [
        "| concurrency | utterances | utt/s | audio s/s (RTFx) | p50 s | p95 s | p99 s | WER % | errors "
        "| server peak RSS MiB | server CPU s/utt |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for lv in result["levels"]:
        errs = ", ".join(f"{k} {v}" for k, v in sorted(lv["errors"].items())) or "0"
        if lv["no_final"]:
            errs += f" (no final: {lv['no_final']})"
        wer = None if lv["wer"] is None else 100 * lv["wer"]
        rows.append(
            f"| {lv['concurrency']} | {lv['utterances']} | {lv['utt_per_s']:.2f} "
            f"| {lv['audio_s_per_s']:.2f} | {_f(lv['latency_p50_s'])} | {_f(lv['latency_p95_s'])} "
            f"| {_f(lv['latency_p99_s'])} | {_f(wer, '{:.1f}')} | {errs} | {_mib(lv['peak_rss_bytes'])} "
            f"| {_f(_cpu(lv), '{:.3f}')} |"
        )
    return "\n".join(rows) + "\n"


def compare_table(base: dict[str, Any], batched: dict[str, Any]) -> str:
    rows = [
        "| concurrency | baseline utt/s | batched utt/s | change | baseline p95 s | batched p95 s "
        "| WER baseline % | WER batched % | peak RSS MiB (baseline / batched) "
        "| server CPU s/utt (baseline / batched) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    b_levels = {lv["concurrency"]: lv for lv in batched["levels"]}
    for a in base["levels"]:
        b = b_levels.get(a["concurrency"])
        if b is None:
            continue
        change = (b["utt_per_s"] / a["utt_per_s"] - 1) * 100 if a["utt_per_s"] else float("nan")
        wa = None if a["wer"] is None else 100 * a["wer"]
        wb = None if b["wer"] is None else 100 * b["wer"]
        rows.append(
            f"| {a['concurrency']} | {a['utt_per_s']:.2f} | {b['utt_per_s']:.2f} | {_f(change, '{:+.1f}%')} "
            f"| {_f(a['latency_p95_s'])} | {_f(b['latency_p95_s'])} "
            f"| {_f(wa, '{:.1f}')} | {_f(wb, '{:.1f}')} "
            f"| {_mib(a['peak_rss_bytes'])} / {_mib(b['peak_rss_bytes'])} "
            f"| {_f(_cpu(a), '{:.3f}')} / {_f(_cpu(b), '{:.3f}')} |"
        )
    return "\n".join(rows) + "\n"


def plot(results: Sequence[dict[str, Any]], out: Path) -> None:
    """Throughput and p95 latency against concurrency, one line per result."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for res in results:
        lv = res["levels"]
        xs = [x["concurrency"] for x in lv]
        ax1.plot(xs, [x["utt_per_s"] for x in lv], marker="o", label=res.get("label") or "run")
        p95 = [x["latency_p95_s"] if x["latency_p95_s"] is not None else math.nan for x in lv]
        ax2.plot(xs, p95, marker="o", label=res.get("label") or "run")
    for ax, title, ylabel in (
        (ax1, "Throughput", "utterances/s"),
        (ax2, "Latency p95 (last byte -> final)", "seconds"),
    ):
        ax.set_xscale("log", base=2)
        ticks = sorted({x["concurrency"] for res in results for x in res["levels"]})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out_dir: Path, label: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / f"{label}.json",
        "md": out_dir / f"{label}.md",
        "png": out_dir / f"{label}.png",
    }
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    head = (
        f"Run `{label}` {result['date']}: {result['manifest_utterances']} utterances "
        f"({result['manifest_audio_s']:.0f} s of audio) from {result['manifest']}, "
        f"{'real-time pacing' if result['realtime'] else 'as fast as possible'}, "
        f"{result['chunk_ms']} ms chunks.\n\n"
    )
    paths["md"].write_text(head + markdown_table(result))
    plot([result], paths["png"])
    return paths


# ---------------------------------------------------------------- CLI


def _concurrency_list(s: str) -> list[int]:
    try:
        values = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--concurrency: expected comma-separated integers, got {s!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--concurrency: every level must be at least 1, got {s!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asr-loadgen", description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("make-manifest", help="speak the default call-center sentences into DIR")
    m.add_argument("--out", required=True, type=Path, help="folder for the audio and manifest.jsonl")
    m.add_argument(
        "--telephone", action="store_true", help="list the 8 kHz mu-law files (default: 16 kHz LINEAR16)"
    )
    m.add_argument(
        "--count", type=int, default=40, help="utterances (sentences repeat with other voices past 40)"
    )

    r = sub.add_parser("run", help="sweep concurrency levels against a running server")
    r.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of the gRPC server")
    r.add_argument("--manifest", required=True, type=Path, help="manifest.jsonl (see make-manifest)")
    r.add_argument(
        "--concurrency", type=_concurrency_list, default=list(DEFAULT_CONCURRENCY), help="e.g. 1,4,16,64"
    )
    g = r.add_mutually_exclusive_group()
    g.add_argument(
        "--utterances-per-level",
        type=int,
        default=0,
        help="utterances per level (default: the manifest's size, at least 3 x concurrency)",
    )
    g.add_argument("--duration", type=float, default=None, help="seconds per level instead of a count")
    r.add_argument(
        "--realtime", action="store_true", help="pace audio at its own rate (default: as fast as possible)"
    )
    r.add_argument("--chunk-ms", type=int, default=20, help="audio per message")
    r.add_argument("--metrics", default=None, help="server metrics URL, for peak RSS and per-stage costs")
    r.add_argument("--warmup", type=int, default=1, help="untimed utterances before the first level")
    r.add_argument("--token", default=None, help="bearer token, when the server requires one")
    r.add_argument(
        "--wait-ready", type=float, default=120.0, help="seconds to wait for the server to be SERVING"
    )
    r.add_argument(
        "--out", type=Path, default=Path("bench-out/loadgen"), help="folder for LABEL.json/.md/.png"
    )
    r.add_argument("--label", default="run", help="name of this run (file names, plot legend)")

    k = sub.add_parser(
        "capacity",
        help="N live calls at once (line noise or a manifest's speech, real-time): kept up? CPU per call?",
    )
    k.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of the gRPC server")
    k.add_argument(
        "--metrics", required=True, help="server metrics URL (process_cpu_seconds_total, asr_ipc_seconds)"
    )
    k.add_argument("--calls", type=int, default=128, help="calls live at once")
    k.add_argument("--chunk-ms", type=int, default=20, help="audio per message")
    k.add_argument("--seconds", type=float, default=30.0, help="audio per call")
    k.add_argument(
        "--manifest", type=Path, default=None,
        help="speech from this manifest, looped per call (default: line noise, 8 kHz mu-law)",
    )  # fmt: skip
    k.add_argument(
        "--connections", type=int, default=32,
        help="TCP connections the calls share (SO_REUSEPORT spreads connections, not calls, over frontends)",
    )  # fmt: skip
    k.add_argument(
        "--client-processes", type=int, default=1,
        help="processes the calls are split over, so that the load generator itself keeps pace",
    )  # fmt: skip
    k.add_argument("--token", default=None, help="bearer token, when the server requires one")
    k.add_argument(
        "--wait-ready", type=float, default=120.0, help="seconds to wait for the server to be SERVING"
    )
    k.add_argument("--json-out", type=Path, default=None, help="also write the report here")

    c = sub.add_parser("compare", help="table of a baseline run against a batched run")
    c.add_argument("baseline", type=Path)
    c.add_argument("batched", type=Path)
    c.add_argument("--out", type=Path, default=None, help="also write compare.md and compare.png here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "make-manifest":
        path = build_manifest(args.out, args.count, ("MULAW",) if args.telephone else ("LINEAR16",))
        print(path)
        return 0
    if args.cmd == "compare":
        base, batched = (json.loads(p.read_text()) for p in (args.baseline, args.batched))
        table = compare_table(base, batched)
        print(table, end="")
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "compare.md").write_text(table)
            plot([base, batched], args.out / "compare.png")
        return 0
    if args.cmd == "capacity":
        bad = [
            f"{flag} must be at least {low} (got {value})"
            for flag, value, low in (
                ("--calls", args.calls, 1), ("--chunk-ms", args.chunk_ms, 1), ("--seconds", args.seconds, 0.1),
                ("--connections", args.connections, 1), ("--client-processes", args.client_processes, 1),
            )
            if value < low
        ]  # fmt: skip
        if bad:
            print("asr-loadgen: " + "; ".join(bad), file=sys.stderr)
            return 2
        report = asyncio.run(run_capacity(args))
        print(json.dumps(report, indent=2))
        print(capacity_line(report), file=sys.stderr)
        if args.json_out:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps(report, indent=2) + "\n")
        return 0 if not report["errors"] else 1
    if args.utterances_per_level < 0 or (args.duration is not None and args.duration <= 0):
        print("asr-loadgen: --utterances-per-level and --duration must be positive", file=sys.stderr)
        return 2
    result = asyncio.run(run_sweep(args))
    paths = write_outputs(result, args.out, args.label)
    print(markdown_table(result), end="")
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    failed = sum(sum(lv["errors"].values()) for lv in result["levels"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
