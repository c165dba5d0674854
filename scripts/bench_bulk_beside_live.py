"""Live calls beside a bulk job of recordings: end of speech -> final latency alone vs beside the bulk
job, and the bulk job's completion time alone vs beside the live calls, in one run on one server.

    python scripts/bench_bulk_beside_live.py [--calls 4] [--recordings 8] [--concurrency 4] [--docs]

Real speech only (scripts/real_speech.py): jfk.flac and pocketsphinx-testdata's librivox and cards
clips, as 8 kHz mu-law. A live call streams the 11 clips one after another (0.5 s of silence before
each, 1.5 s after), in 20 ms frames paced in real time; `--calls` of them run at once, each starting at
another clip. A recording of the bulk job is the 11 clips joined with 0.8 s pauses (~60 s), one
`Recognize` call each, at most `--concurrency` at once (as `asr-client FOLDER --concurrency` sends
them). Three phases on one `asr-server` with default flags: live calls alone, the bulk job alone, both
at once.

Latency of a final = when it is received - when the audio at its `end_offset` was sent (it includes
the endpointer's silence wait). The bulk job's completion time runs from its first request to its last
response. The server's CPU seconds per phase come from its /metrics (process_cpu_seconds_total).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from clients.scoring import corpus_wer  # noqa: E402
from harness.live import PacedCall  # noqa: E402
from harness.server import ServerProcess  # noqa: E402
from harness.stats import percentile  # noqa: E402
from scripts.docs_section import write_section  # noqa: E402
from scripts.real_speech import build_real_manifest  # noqa: E402

FRAME_S = 0.02
RATE = 8000
LEAD_S, TAIL_S, PAUSE_S = 0.5, 1.5, 0.8
SILENCE = b"\xff"  # mu-law zero


@dataclass
class Clip:
    name: str
    mulaw: bytes
    text: str


@dataclass
class Phase:
    latencies: list[float] = field(default_factory=list)
    live_codes: list[str] = field(default_factory=list)
    bulk_codes: list[str] = field(default_factory=list)
    bulk_texts: list[list[str]] = field(default_factory=list)
    bulk_s: float = float("nan")
    wall_s: float = 0.0
    cpu_s: float = 0.0


def real_clips(work: Path) -> list[Clip]:
    manifest = build_real_manifest(work)
    out = []
    for line in manifest.read_text().splitlines():
        entry = json.loads(line)
        out.append(Clip(entry["source"], (work / entry["audio"]).read_bytes(), entry["text"]))
    return out


async def live_call(channel: aio.Channel, clips: list[Clip], phase: Phase) -> None:
    """One paced call through every clip; each final's latency goes into `phase`."""
    data = b"".join(SILENCE * round(LEAD_S * RATE) + c.mulaw + SILENCE * round(TAIL_S * RATE) for c in clips)
    config = asr_pb2.StreamingRecognitionConfig(
        config=asr_pb2.RecognitionConfig(encoding=asr_pb2.MULAW, sample_rate_hertz=RATE)
    )
    paced = PacedCall(config, data, round(FRAME_S * RATE), FRAME_S)
    call = asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(paced.requests(), timeout=900)
    try:
        async for response in call:
            now = time.monotonic()
            for r in response.results:
                if r.is_final:
                    phase.latencies.append(paced.latency_s(r.end_offset.ToNanoseconds() / 1e9, now))
    except aio.AioRpcError:
        pass
    phase.live_codes.append((await call.code()).name)


async def bulk_job(
    channel: aio.Channel, recording: bytes, count: int, concurrency: int, phase: Phase
) -> None:
    stub = asr_pb2_grpc.RecognizerStub(channel)
    config = asr_pb2.RecognitionConfig(encoding=asr_pb2.MULAW, sample_rate_hertz=RATE)
    slots = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with slots:
            try:
                response = await stub.Recognize(
                    asr_pb2.RecognizeRequest(config=config, audio_content=recording), timeout=900
                )
                phase.bulk_codes.append("OK")
                phase.bulk_texts.append([r.alternatives[0].transcript for r in response.results])
            except aio.AioRpcError as e:
                phase.bulk_codes.append(e.code().name)

    start = time.monotonic()
    await asyncio.gather(*(one() for _ in range(count)))
    phase.bulk_s = time.monotonic() - start


async def run_phase(
    server: ServerProcess, clips: list[Clip], args: argparse.Namespace, live: bool, bulk: bool
) -> Phase:
    phase = Phase()
    recording = SILENCE * round(LEAD_S * RATE) + b"".join(
        c.mulaw + SILENCE * round(PAUSE_S * RATE) for c in clips
    )
    cpu = server_cpu_s(server)
    start = time.monotonic()
    async with aio.insecure_channel(server.target) as channel:
        jobs = []
        if live:
            jobs += [live_call(channel, clips[i:] + clips[:i], phase) for i in range(args.calls)]
        if bulk:
            jobs.append(bulk_job(channel, recording, args.recordings, args.concurrency, phase))
        await asyncio.gather(*jobs)
    phase.wall_s = time.monotonic() - start
    phase.cpu_s = server_cpu_s(server) - cpu
    return phase


def server_cpu_s(server: ServerProcess) -> float:
    """CPU seconds of every process of the server so far (supervisor, frontends, engine)."""
    return server.metrics().sum("process_cpu_seconds_total")


def pct(values: list[float], q: float) -> float:
    return math.nan if (v := percentile(values, q)) is None else v


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=4, help="live calls at once")
    p.add_argument("--recordings", type=int, default=8, help="recordings in the bulk job")
    p.add_argument("--concurrency", type=int, default=4, help="Recognize calls of the bulk job at once")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "bulk-beside-live")
    p.add_argument("--server-args", default="", help="more asr-server flags, e.g. '--max-recorded-rows 4'")
    p.add_argument("--docs", action="store_true", help="write the table into docs/benchmarks.md")
    p.add_argument(
        "--report", type=Path, help="only print (and with --docs write) the table of a saved run.json"
    )
    args = p.parse_args(argv)
    if args.report:
        run = json.loads(args.report.read_text())
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        run = measure(args)
        (args.out / "run.json").write_text(json.dumps(run, indent=1))
    body = report(run)
    print(body)
    if not args.report:
        (args.out / "table.md").write_text(body)
    if args.docs:
        write_section("## Live calls beside a bulk job", "scripts/bench_bulk_beside_live.py", body)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The three phases on one server; what `report` needs, as plain data."""
    with tempfile.TemporaryDirectory() as tmp:
        clips = real_clips(Path(tmp))
    speech_s = sum(len(c.mulaw) for c in clips) / RATE
    print(f"{len(clips)} real clips, {speech_s:.1f} s of speech; load average {load()}", flush=True)
    run: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "server_args": args.server_args,
        "calls": args.calls,
        "recordings": args.recordings,
        "concurrency": args.concurrency,
        "clips": len(clips),
        "speech_s": speech_s,
        "references": [c.text for c in clips],
        "phases": {},
    }
    server = ServerProcess(
        "--log-level", "warning", *args.server_args.split(),
        threads=None, log_format="text", log_path=args.out / "server.log",
    )  # fmt: skip
    try:
        server.wait_serving(300)
        for name, live, bulk in (
            ("live calls alone", True, False),
            ("bulk job alone", False, True),
            ("both", True, True),
        ):
            phase = asyncio.run(run_phase(server, clips, args, live, bulk))
            run["phases"][name] = dataclasses.asdict(phase) | {"load": load()}
            print(f"{name}: done in {phase.wall_s:.1f} s; load average {load()}", flush=True)
    finally:
        server.stop(grace_s=60)
    return run


def report(run: dict[str, Any]) -> str:
    def num(x: float, digits: int) -> str:
        return "—" if math.isnan(x) else f"{x:.{digits}f}"

    rows = [
        "| phase | live finals | end of speech → final p50 s | p95 s | max s | live calls OK | bulk job "
        "completion s | recordings OK | bulk WER % | server CPU s | load (1/5/15 min) at end |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    # a recording's utterances are cut at its pauses, not clip by clip: each is scored as one text
    reference = " ".join(run["references"])
    phases = {
        name: Phase(**{k: v for k, v in ph.items() if k != "load"}) for name, ph in run["phases"].items()
    }
    for name, ph in phases.items():
        lat = ph.latencies
        ok_live = f"{ph.live_codes.count('OK')}/{len(ph.live_codes)}" if ph.live_codes else "—"
        ok_bulk = f"{ph.bulk_codes.count('OK')}/{len(ph.bulk_codes)}" if ph.bulk_codes else "—"
        wer = [corpus_wer([reference], [" ".join(texts)]) for texts in ph.bulk_texts]
        rows.append(
            f"| {name} | {len(lat) or '—'} | {num(pct(lat, 50), 3)} | {num(pct(lat, 95), 3)} | "
            f"{num(max(lat, default=math.nan), 3)} | {ok_live} | {num(ph.bulk_s, 1)} | {ok_bulk} | "
            f"{num(100 * statistics.fmean(wer) if wer else math.nan, 1)} | {ph.cpu_s:.0f} | "
            f"{run['phases'][name]['load']} |"
        )
    alone, bulk_alone, both = phases["live calls alone"], phases["bulk job alone"], phases["both"]
    rows.append(
        f"| both / alone | | {pct(both.latencies, 50) / pct(alone.latencies, 50):.2f}x | "
        f"{pct(both.latencies, 95) / pct(alone.latencies, 95):.2f}x | | | "
        f"{both.bulk_s / bulk_alone.bulk_s:.2f}x | | | | |"
    )
    flags = f"`{run['server_args']}`" if run["server_args"] else "default flags"
    return "\n".join(rows) + (
        f"\n\nRun {run['started']}, one `asr-server` with {flags} (tiny.en, CPU): {run['calls']} live calls "
        f"at once, each the {run['clips']} real clips (jfk, 5 librivox, 5 cards; {run['speech_s']:.0f} s of "
        f"speech) as 8 kHz mu-law paced in real time; the bulk job {run['recordings']} recordings of those "
        f"clips joined (~{run['speech_s'] + run['clips'] * PAUSE_S:.0f} s each), {run['concurrency']} "
        "`Recognize` calls at once.\n"
    )


if __name__ == "__main__":
    main()
