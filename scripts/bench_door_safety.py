"""A well-behaved live call alone and beside each attack of issue 26, in one run on one server: its
end of speech -> final latency, whether it ended OK with all its finals, and the frontends' memory
before and after a Configure flood.

    python scripts/bench_door_safety.py [--before REF] [--docs] [--server-args '...']

With `--before REF` every phase also runs on a server from git REF's tree (the same flags), one after
the other in the same run, so a fix's effect reads side by side.

The good call: real speech (scripts/real_speech.py: jfk.flac and pocketsphinx-testdata's clips, as
8 kHz mu-law; the first `--clips` of them, 0.5 s of silence before each and 1.5 s after), streamed
over asr.v1 in 20 ms frames paced in real time. Each attack runs from its own connection(s) for as long
as the good call lasts:

- finalize-flood: Deepgram `/v1/listen?endpointing=false`, 3200 bytes of audio + `Finalize`, looped.
- silent-readers: `--silent-readers` Deepgram sockets that send `Finalize` after `Finalize` and never
  read the answers (harness/raw_websocket.py).
- configure-flood: one Deepgram socket sending `Configure` with 100 fresh keyterms, looped (the
  frontends' resident memory is read before and after).
- phrase-lists: Google Speech `StreamingRecognize` configs with 200,000 phrases, one after another.
- fast-noise: an asr.v1 stream sending noise alternating in level, as fast as the server takes it.

Latency of a final = when it is received - when the audio at its `end_offset` was sent (it includes
the endpointer's silence wait).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import websockets
from asr.v1 import asr_pb2, asr_pb2_grpc
from google.cloud import speech_v1
from google.cloud.speech_v1.services.speech.transports.grpc import SpeechGrpcTransport
from grpc import aio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from harness.live import PacedCall  # noqa: E402
from harness.raw_websocket import masked_text_frame, silent_websocket  # noqa: E402
from harness.server import ServerProcess, checkout, short_commit  # noqa: E402
from harness.stats import percentile  # noqa: E402
from harness.usage import cpu_model  # noqa: E402
from scripts.docs_section import write_section  # noqa: E402
from scripts.real_speech import build_real_manifest  # noqa: E402

FRAME_S = 0.02
RATE = 8000
LEAD_S, TAIL_S = 0.5, 1.5
SILENCE = b"\xff"  # mu-law zero
ATTACKS = ("finalize-flood", "silent-readers", "configure-flood", "phrase-lists", "fast-noise")


@dataclass
class Phase:
    latencies: list[float] = field(default_factory=list)
    finals: int = 0
    code: str = ""
    attack: dict[str, Any] = field(default_factory=dict)
    frontend_rss_mib: tuple[float, float] = (math.nan, math.nan)


def good_audio(work: Path, clips: int) -> bytes:
    manifest = build_real_manifest(work)
    entries = [json.loads(line) for line in manifest.read_text().splitlines()][:clips]
    return b"".join(
        SILENCE * round(LEAD_S * RATE) + (work / e["audio"]).read_bytes() + SILENCE * round(TAIL_S * RATE)
        for e in entries
    )


async def good_call(target: str, audio: bytes, phase: Phase) -> None:
    config = asr_pb2.StreamingRecognitionConfig(
        config=asr_pb2.RecognitionConfig(encoding=asr_pb2.MULAW, sample_rate_hertz=RATE)
    )
    paced = PacedCall(config, audio, round(FRAME_S * RATE), FRAME_S)
    async with aio.insecure_channel(target) as channel:
        call = asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(paced.requests(), timeout=600)
        with contextlib.suppress(aio.AioRpcError):
            async for response in call:
                now = time.monotonic()
                for r in response.results:
                    if r.is_final:
                        phase.finals += 1
                        phase.latencies.append(paced.latency_s(r.end_offset.ToNanoseconds() / 1e9, now))
        phase.code = (await call.code()).name


def mulaw_noise(seconds: float, seed: int = 0) -> bytes:
    """Noise whose level alternates by 12 dB every 100 ms, as mu-law bytes (never speech to the VAD)."""
    rng = np.random.default_rng(seed)
    n = round(seconds * RATE)
    levels = np.where((np.arange(n) // 800) % 2 == 0, 0.02, 0.08)
    x = np.clip(rng.standard_normal(n) * levels, -1, 1)
    mu = np.sign(x) * np.log1p(255 * np.abs(x)) / np.log1p(255)
    return (((mu + 1) / 2 * 255).astype(np.uint8) ^ 0x80).tobytes()


def listen_url(server: ServerProcess, query: str) -> str:
    return f"ws://127.0.0.1:{server.http_port}/v1/listen?encoding=mulaw&sample_rate=8000&{query}"


async def finalize_flood(server: ServerProcess, stop: asyncio.Event, out: dict[str, Any]) -> None:
    chunk = mulaw_noise(0.4)
    sent = 0
    try:
        async with websockets.connect(listen_url(server, "endpointing=false"), max_size=None) as ws:
            reader = asyncio.create_task(_drain(ws))
            while not stop.is_set():
                await ws.send(chunk)
                await ws.send(json.dumps({"type": "Finalize"}))
                sent += 1
                await asyncio.sleep(0)
            reader.cancel()
    except websockets.ConnectionClosed as e:
        out["closed"] = f"{e.rcvd.code if e.rcvd else None} {e.rcvd.reason if e.rcvd else ''}"[:120]
    out["finalizes_sent"] = sent


async def _drain(ws: Any) -> None:
    with contextlib.suppress(websockets.ConnectionClosed):
        async for _ in ws:
            pass


async def silent_readers(server: ServerProcess, stop: asyncio.Event, out: dict[str, Any], count: int) -> None:

    async def one() -> str:
        path = "/v1/listen?encoding=mulaw&sample_rate=8000&endpointing=false"
        sock = await silent_websocket("127.0.0.1", server.http_port, path)
        loop = asyncio.get_running_loop()
        frame = masked_text_frame(json.dumps({"type": "Finalize"}))
        try:
            while not stop.is_set():
                await asyncio.wait_for(loop.sock_sendall(sock, frame), 5)
                await asyncio.sleep(0.001)
            return "held to the end"
        except (TimeoutError, OSError) as e:
            return type(e).__name__
        finally:
            sock.close()

    results = await asyncio.gather(*(one() for _ in range(count)))
    out["sockets"] = {r: results.count(r) for r in sorted(set(results))}


async def configure_flood(server: ServerProcess, stop: asyncio.Event, out: dict[str, Any]) -> None:
    sent = 0
    try:
        async with websockets.connect(listen_url(server, "endpointing=false"), max_size=None) as ws:
            reader = asyncio.create_task(_drain(ws))
            while not stop.is_set():
                terms = [f"term{sent}x{i}" for i in range(100)]
                await ws.send(json.dumps({"type": "Configure", "keyterms": terms}))
                sent += 1
                if sent % 50 == 0:
                    await ws.send(json.dumps({"type": "KeepAlive"}))
                await asyncio.sleep(0)
            reader.cancel()
    except websockets.ConnectionClosed as e:
        out["closed"] = f"{e.rcvd.code if e.rcvd else None} {e.rcvd.reason if e.rcvd else ''}"[:120]
    out["configures_sent"] = sent


def phrase_lists(server: ServerProcess, stop: asyncio.Event, out: dict[str, Any]) -> None:
    phrases = [f"phrase number {i}" for i in range(200_000)]
    config = speech_v1.StreamingRecognitionConfig(
        config=speech_v1.RecognitionConfig(
            encoding=speech_v1.RecognitionConfig.AudioEncoding.MULAW,
            sample_rate_hertz=RATE,
            language_code="en-US",
            speech_contexts=[speech_v1.SpeechContext(phrases=phrases)],
        )
    )
    codes: dict[str, int] = {}
    with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", -1)]) as channel:
        client = speech_v1.SpeechClient(transport=SpeechGrpcTransport(channel=channel))
        while not stop.is_set():
            try:  # the client's helper sends `config` first, then the (here no) audio requests
                for _ in client.streaming_recognize(config=config, requests=iter(()), timeout=30):  # type: ignore[call-arg]  # speech_v1.SpeechClient is the helpers mixin at run time
                    pass
                code = "OK"
            except Exception as e:  # the door's answer, whatever its class
                code = type(e).__name__
            codes[code] = codes.get(code, 0) + 1
    out["configs"] = codes


async def fast_noise(server: ServerProcess, stop: asyncio.Event, out: dict[str, Any]) -> None:
    chunk = mulaw_noise(1.0, seed=1)
    sent_s = 0.0

    async def requests() -> Any:
        nonlocal sent_s
        yield asr_pb2.StreamingRecognizeRequest(
            streaming_config=asr_pb2.StreamingRecognitionConfig(
                config=asr_pb2.RecognitionConfig(encoding=asr_pb2.MULAW, sample_rate_hertz=RATE)
            )
        )
        while not stop.is_set():
            yield asr_pb2.StreamingRecognizeRequest(audio_content=chunk)
            sent_s += 1.0

    started = time.monotonic()
    async with aio.insecure_channel(server.target) as channel:
        call = asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(requests(), timeout=600)
        with contextlib.suppress(aio.AioRpcError):
            async for _ in call:  # the requests end (a half-close) once the good call is over
                pass
        out["code"] = (await call.code()).name
    out["audio_s_per_wall_s"] = round(sent_s / max(time.monotonic() - started, 1e-9), 1)


def frontend_rss_mib(server: ServerProcess) -> float:
    """Resident memory of the frontend processes: the server's children that listen on its gRPC port
    (the engine process listens on none)."""
    total = 0
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            ports = {c.laddr.port for c in child.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
            if server.port in ports:
                total += child.memory_info().rss
    return total / 2**20


async def run_phase(
    server: ServerProcess, audio: bytes, attack: str | None, args: argparse.Namespace
) -> Phase:
    phase = Phase()
    stop = asyncio.Event()
    before = frontend_rss_mib(server)
    attackers: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {
        "finalize-flood": lambda: finalize_flood(server, stop, phase.attack),
        "silent-readers": lambda: silent_readers(server, stop, phase.attack, args.silent_readers),
        "configure-flood": lambda: configure_flood(server, stop, phase.attack),
        "phrase-lists": lambda: asyncio.to_thread(phrase_lists, server, stop, phase.attack),
        "fast-noise": lambda: fast_noise(server, stop, phase.attack),
    }
    task = asyncio.create_task(attackers[attack]()) if attack else None
    await asyncio.sleep(1.0 if attack else 0)  # the attack under way before the call starts
    await good_call(server.target, audio, phase)
    stop.set()
    if task:
        try:
            await asyncio.wait_for(task, 60)
        except TimeoutError:
            phase.attack["note"] = "attacker still blocked 60 s after the call"
    phase.frontend_rss_mib = (before, frontend_rss_mib(server))
    return phase


def pct(values: list[float], q: float) -> float:
    return math.nan if (v := percentile(values, q)) is None else v


def report(run: dict[str, Any]) -> str:
    lines = [
        f"Run {run['started']} on {run['commit']}, {run['cpu']}, load average at start {run['load']}; "
        f"good call: {run['clips']} real clips ({run['speech_s']:.1f} s of audio), server flags "
        f"`{run['server_args'] or '(defaults)'}`.",
        "",
        "| phase | good call | finals | p50 latency s | p95 latency s | frontends RSS MiB before -> after "
        "| the attacker got |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, p in run["phases"].items():
        lines.append(
            f"| {name} | {p['code']} | {p['finals']} | {pct(p['latencies'], 50):.2f} | "
            f"{pct(p['latencies'], 95):.2f} | {p['frontend_rss_mib'][0]:.0f} -> {p['frontend_rss_mib'][1]:.0f} | "
            f"{json.dumps(p['attack'])} |"
        )
    return "\n".join(lines)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        audio = good_audio(Path(tmp), args.clips)
    run: dict[str, Any] = {
        **args.header,
        "clips": args.clips,
        "speech_s": len(audio) / RATE,
        "server_args": args.server_args,
        "phases": {},
    }
    for label, source in args.sources:
        await run_server(label, source, audio, args, run)
    return run


async def run_server(
    label: str, source: Path | None, audio: bytes, args: argparse.Namespace, run: dict[str, Any]
) -> None:
    flags = args.server_args.split()
    with ServerProcess("--log-level", "warning", *flags, http=True, source=source) as server:
        server.wait_serving()
        for attack in (None, *args.attacks):
            name = f"{label}: {attack or 'alone'}"
            print(f"phase {name} ...", flush=True)
            p = await run_phase(server, audio, attack, args)
            run["phases"][name] = {
                "code": p.code,
                "finals": p.finals,
                "latencies": p.latencies,
                "attack": p.attack,
                "frontend_rss_mib": p.frontend_rss_mib,
            }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clips", type=int, default=3, help="real clips in the good call")
    p.add_argument("--silent-readers", type=int, default=16, help="sockets of the silent-readers attack")
    p.add_argument("--attacks", nargs="*", default=list(ATTACKS), choices=ATTACKS)
    p.add_argument("--server-args", default="", help="more asr-server flags, e.g. '--max-queue 16'")
    p.add_argument("--before", help="also run every phase on a server from this git ref, first")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "door-safety")
    p.add_argument("--docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.header = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": short_commit(),
        "cpu": cpu_model(),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    with contextlib.ExitStack() as stack:
        args.sources = [("this tree", None)]
        if args.before:
            args.sources.insert(0, (args.before[:9], stack.enter_context(checkout(args.before))))
        run = asyncio.run(measure(args))
    (args.out / "run.json").write_text(json.dumps(run, indent=1))
    body = report(run)
    print(body)
    if args.docs:
        write_section("## A good call beside attacks on the doors", "scripts/bench_door_safety.py", body)


if __name__ == "__main__":
    main()
