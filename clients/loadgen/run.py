"""`asr-loadgen run`: concurrency levels of per-utterance streams against a running server, each level
summarised (throughput, latency percentiles, WER, errors by status, the server's peak RSS and its
seconds per utterance in each stage from /metrics)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import os
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from clients.client import RecognizerClient
from clients.loadgen.audio import STREAM_TIMEOUT_S, Utterance, chunk_bytes, load_utterances, stream_config
from clients.manifest import load_manifest
from clients.scoring import corpus_wer
from harness.metrics import Metrics, scrape
from harness.stats import percentile
from harness.usage import machine

DEFAULT_CONCURRENCY = (1, 4, 16, 64)
RSS_METRIC = "process_resident_memory_bytes"
SERVER_INFO_METRICS = ("asr_model_info", "asr_build_info", "asr_kv_cache_bytes")  # recorded with each run
SAMPLE_TIMEOUT_S = 2.0  # a slow /metrics must not hold up a level's RSS sampling


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
        responses = client.stream(stream_config(u), audio(), deadline_s=STREAM_TIMEOUT_S)
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


def cost_per_utterance(before: Metrics, after: Metrics, utterances: int) -> dict[str, float]:
    """Seconds per utterance spent in each of the server's `*_seconds` histograms during a level,
    plus the server's CPU seconds per utterance (process_cpu_seconds_total, summed over the server's
    processes: every thread, so it stays meaningful when other work shares the machine and wall times
    stretch)."""
    if utterances <= 0:
        return {}
    gained = after.since(before)
    out: dict[str, float] = {}
    if gained.has("process_cpu_seconds_total"):
        out["process_cpu_seconds"] = gained.sum("process_cpu_seconds_total") / utterances
    for (name, _), d in gained.items():
        if name.endswith("_seconds_sum") and d > 0:
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
            m = await asyncio.to_thread(scrape, self.url, SAMPLE_TIMEOUT_S)
        except (OSError, ValueError) as exc:
            self.last_error = str(exc)
            return
        if m.has(RSS_METRIC):
            # one series per server process (process="engine", "frontend-0", ...): the server's is their sum
            rss = m.sum(RSS_METRIC)
            self.peak = rss if self.peak is None else max(self.peak, rss)

    async def run(self) -> None:
        while True:
            await self.sample_once()
            await asyncio.sleep(self.interval_s)


# ---------------------------------------------------------------- one concurrency level
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
    before: Metrics | None = None
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
    if metrics_url and before is not None:
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
    load_start = os.getloadavg()[0]  # a busy machine explains slow figures: record how busy it was
    entries = load_manifest(args.manifest)
    utts = load_utterances(entries)
    levels: list[LevelResult] = []
    async with RecognizerClient(args.server, token=args.token) as client:
        await client.wait_until_serving(args.wait_ready)
        # untimed: first-call costs (allocator, thread pools) stay out of level 1
        for i in range(args.warmup):
            w = await recognize_one(client, utts[i % len(utts)], realtime=False, chunk_ms=args.chunk_ms)
            if w.code != "OK":
                print(f"asr-loadgen: warm-up utterance failed: {w.code} {w.details}", file=sys.stderr)
        info: dict[str, float] = {}
        if args.metrics:
            with contextlib.suppress(OSError, ValueError):
                info = scrape(args.metrics).flat(*SERVER_INFO_METRICS)
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
        "machine": machine(load_start),
        "server_info": info,
        "levels": [asdict(lv) for lv in levels],
    }
