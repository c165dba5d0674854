"""End of speech -> final latency with speculative end of utterance off and on, side by side in one run.

    python scripts/bench_speculative.py [--rounds 2] [--out bench-out/speculative] [--docs]

Real speech only: the pocketsphinx test clips (librivox, cards) and jfk.flac, each turned into 8 kHz
mu-law telephone audio by sox. Two `asr-server`s run on loopback, one with `--speculative-endpointing
off`, one with `on`; one call at a time, alternating between them clip by clip (the order flips every
round, so drift in the machine's load falls on both). Each call is one stream: 0.5 s of silence, the
clip, 1.5 s of silence, sent in 20 ms frames paced in real time (frame k leaves when its audio would
have been captured), then half-close.

Latency of a final = when it is received - when the audio at its `end_offset` (the endpointer's end of
speech, the same with speculation on and off) was sent. It includes the endpointer's silence wait.
Hits and misses come from each server's /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import soundfile as sf
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from harness.live import PacedCall  # noqa: E402
from harness.server import ServerProcess  # noqa: E402
from harness.stats import percentile  # noqa: E402
from scripts.docs_section import write_section  # noqa: E402
from scripts.real_speech import real_clips  # noqa: E402

FRAME_S = 0.02
RATE = 8000
LEAD_S, TAIL_S = 0.5, 1.5
MULAW_SILENCE = b"\xff"


@dataclass
class Clip:
    name: str
    mulaw: bytes


@dataclass
class Final:
    clip: str
    index: int
    text: str
    end_s: float
    latency_s: float


def to_mulaw(path: Path, work: Path) -> bytes:
    audio, rate = sf.read(path, dtype="float32", always_2d=True)
    wav, raw = work / f"{path.stem}.wav", work / f"{path.stem}.ul"
    sf.write(wav, audio.mean(axis=1), rate, subtype="PCM_16")
    subprocess.run(
        ["sox", "-D", str(wav), "-r", str(RATE), "-c", "1", "-e", "mu-law", "-b", "8", "-t", "raw", str(raw)],
        check=True,
    )
    return raw.read_bytes()


def clips(work: Path) -> list[Clip]:
    return [Clip(path.stem, to_mulaw(path, work)) for path, _ in real_clips()]


def metrics(server: ServerProcess) -> dict[str, float]:
    """What the table reads from a server's /metrics."""
    m = server.metrics()
    out = {
        f"spec_{o}": m.sum("asr_speculative_endpoints_total", outcome=o) for o in ("hit", "miss", "refused")
    }
    for name in (
        "asr_speculative_wasted_audio_seconds_total",
        "asr_utterance_latency_seconds_sum",
        "asr_utterance_latency_seconds_count",
    ):
        out[name] = m.sum(name)
    return out


async def call(server: ServerProcess, clip: Clip) -> list[Final]:
    """One paced stream; returns its finals with their latencies."""
    data = MULAW_SILENCE * round(LEAD_S * RATE) + clip.mulaw + MULAW_SILENCE * round(TAIL_S * RATE)
    config = asr_pb2.StreamingRecognitionConfig(
        config=asr_pb2.RecognitionConfig(encoding=asr_pb2.MULAW, sample_rate_hertz=RATE)
    )
    paced = PacedCall(config, data, round(FRAME_S * RATE), FRAME_S)
    finals = []
    async with aio.insecure_channel(server.target) as channel:
        async for response in asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(paced.requests()):
            now = time.monotonic()
            for r in response.results:
                if r.is_final:
                    end_s = r.end_offset.ToNanoseconds() / 1e9
                    finals.append(
                        Final(
                            clip.name,
                            r.utterance_index,
                            r.alternatives[0].transcript,
                            end_s,
                            paced.latency_s(end_s, now),
                        )
                    )
    return finals


def pct(values: list[float], q: float) -> float:
    return percentile(values, q) or float("nan")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="passes over the 11 clips per mode")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "speculative")
    p.add_argument("--docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        speech = clips(Path(tmp))
    audio_s = sum(len(c.mulaw) for c in speech) / RATE
    print(f"{len(speech)} clips, {audio_s:.1f} s of speech; load average at start {load()}", flush=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    servers = {
        mode: ServerProcess(
            "--speculative-endpointing", mode, threads=None, log_format="text",
            log_path=args.out / f"server-{mode}.log",
        )
        for mode in ("off", "on")
    }  # fmt: skip
    try:
        for s in servers.values():
            s.wait_serving(300)
        before = {m: metrics(s) for m, s in servers.items()}
        load_start = load()
        finals: dict[str, list[Final]] = {"off": [], "on": []}
        for rnd in range(args.rounds):
            for i, clip in enumerate(speech):
                order = ("off", "on") if (i + rnd) % 2 == 0 else ("on", "off")
                for mode in order:
                    finals[mode] += asyncio.run(call(servers[mode], clip))
            print(f"round {rnd + 1}/{args.rounds} done; load average {load()}", flush=True)
        after = {m: metrics(s) for m, s in servers.items()}
        load_end = load()
    finally:
        for s in servers.values():
            s.stop(grace_s=60)

    def delta(mode: str, key: str) -> float:
        return after[mode].get(key, 0.0) - before[mode].get(key, 0.0)

    same = sum(
        (a.clip, a.index, a.text, a.end_s) == (b.clip, b.index, b.text, b.end_s)
        for a, b in zip(finals["off"], finals["on"], strict=False)
    )
    lat = {m: [f.latency_s for f in finals[m]] for m in finals}
    rows = [
        "| speculative endpointing | finals | end of speech → final p50 s | p95 s | mean s | max s "
        "| server: end confirmed → final sent, mean s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in ("off", "on"):
        confirm = delta(m, "asr_utterance_latency_seconds_sum") / max(
            delta(m, "asr_utterance_latency_seconds_count"), 1
        )
        rows.append(
            f"| {m} | {len(lat[m])} | {pct(lat[m], 50):.3f} | {pct(lat[m], 95):.3f} "
            f"| {statistics.fmean(lat[m]):.3f} | {max(lat[m]):.3f} | {confirm:.3f} |"
        )
    rows.append(
        f"| on / off | | {pct(lat['on'], 50) / pct(lat['off'], 50):.2f}x "
        f"| {pct(lat['on'], 95) / pct(lat['off'], 95):.2f}x | "
        f"{statistics.fmean(lat['on']) / statistics.fmean(lat['off']):.2f}x | | |"
    )
    hits, misses, refused = (delta("on", f"spec_{o}") for o in ("hit", "miss", "refused"))
    wasted = delta("on", "asr_speculative_wasted_audio_seconds_total")
    offered = hits + misses + refused
    body = "\n".join(rows) + (
        f"\n\nSpeculative requests (server with speculation on): {offered:.0f} offered, {hits:.0f} hits "
        f"({100 * hits / max(offered, 1):.0f}%), {misses:.0f} misses, {refused:.0f} refused; "
        f"{wasted:.1f} s of audio cancelled on misses (against {audio_s * args.rounds:.0f} s of speech "
        f"streamed).\n"
        f"Finals identical with speculation off and on (clip, index, text, end offset): "
        f"{same} of {len(finals['off'])} (on: {len(finals['on'])}).\n"
        f"Run {started}: {len(speech)} real clips (5 librivox, 5 cards, jfk) as 8 kHz mu-law, "
        f"{args.rounds} rounds, one call at a time, real-time pacing; load average (1/5/15 min) "
        f"{load_start} at start, {load_end} at end.\n"
    )
    print(body)
    (args.out / "table.md").write_text(body)
    with (args.out / "finals.tsv").open("w") as f:
        for m in ("off", "on"):
            for x in finals[m]:
                f.write(f"{m}\t{x.clip}\t{x.index}\t{x.end_s:.3f}\t{x.latency_s:.3f}\t{x.text}\n")
    if args.docs:
        write_section("## Speculative end of utterance", "scripts/bench_speculative.py", body)
    if same != len(finals["off"]) or len(finals["on"]) != len(finals["off"]):
        raise SystemExit("finals differ between speculation off and on: see finals.tsv")


if __name__ == "__main__":
    main()
