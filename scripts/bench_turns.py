"""End of turn: false cuts at a mid-sentence pause and true end -> speech_final latency, silence-only
endpointing at several timeouts against the turn model, in one run.

    python scripts/bench_turns.py [--out bench-out/turns] [--docs]

Real speech only (scripts/real_speech.py: jfk.flac, pocketsphinx-testdata's 5 librivox sentences and 5
"cards" utterances). Each clip's word timings come from the server itself (Deepgram pre-recorded, the
SDK's transcribe_file); a pause of 0.6, 0.7 or 0.8 s (by turns) of low noise is inserted at the word
boundary nearest the clip's middle (at least one word on each side), then the call is 0.5 s of noise,
the clip with its pause, and 3 s of noise (longer than --turn-max-silence-s), as 8 kHz mu-law in 20 ms
frames paced in real time, then CloseStream.

One `asr-server` on loopback (--turn-model on, defaults otherwise); the Deepgram SDK's live client opens
one call at a time, each clip once per configuration (the order rotated clip by clip):
silence-only (`turn_model=false`) at endpointing 300, 500, 800 and 1000 ms, and the turn model
(`turn_model=true`) at endpointing 200 and 300 ms.

- false cut: a final with speech_final=true that ends before the pause's end (the turn cut in two);
- latency: when the first speech_final final ending after the pause arrived - when the frame holding the
  true end (the last word's end) was sent. It includes the silence wait and the decode.

The same calls also go through the endpointer alone (service/pipeline/endpointing.py on the mu-law
decoded as the server decodes it, the turn model asked at once): when, in audio seconds after the true
end, each configuration ends the turn. That figure does not depend on this machine's load; the live
latency adds the model call's and the decode's wall time on it.

Cost per turn decision: the server's asr_turn_model_seconds (wall time of each batched call, on this
loaded machine) over the turns it judged, and a CPU-time micro-benchmark of TurnModel.complete at batch
1, 4 and 16 (features included).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import soxr

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from deepgram import AsyncDeepgramClient  # noqa: E402
from deepgram.environment import DeepgramClientEnvironment  # noqa: E402
from deepgram.listen.v1.types import ListenV1Results  # noqa: E402

from harness.server import ServerProcess  # noqa: E402
from scripts.docs_section import write_section  # noqa: E402
from scripts.real_speech import real_clips  # noqa: E402

RATE = 16000
FRAME = 160  # 20 ms of 8 kHz mu-law
LEAD_S, TAIL_S = 0.5, 3.0
PAUSES = (0.6, 0.7, 0.8)
NOISE_DBFS = -60.0
# (label, query): silence-only at several timeouts, and the turn model
CONFIGS: list[tuple[str, dict[str, str]]] = [
    *[(f"silence {ms} ms", {"endpointing": str(ms), "turn_model": "false"}) for ms in (300, 500, 800, 1000)],
    *[
        (f"turn model, endpointing {ms} ms", {"endpointing": str(ms), "turn_model": "true"})
        for ms in (200, 300)
    ],
]


@dataclass
class Clip:
    name: str
    mulaw: bytes
    pause_start_s: float  # in the call's audio
    pause_end_s: float
    true_end_s: float


@dataclass
class Outcome:
    false_cuts: int = 0  # a turn end at the inserted pause
    early_ends: int = 0  # a turn end anywhere before the true end (jfk has long pauses of its own)
    latencies: list[float] = field(default_factory=list)
    missed: int = 0


def load16k(path: Path) -> np.ndarray:
    audio, rate = sf.read(str(path), dtype="float32", always_2d=True)
    audio = audio.mean(axis=1)
    return audio if rate == RATE else soxr.resample(audio, rate, RATE).astype(np.float32)


def noise(seconds: float, rng: np.random.Generator) -> np.ndarray:
    return (rng.standard_normal(round(seconds * RATE)) * 10 ** (NOISE_DBFS / 20)).astype(np.float32)


def mulaw8k(audio: np.ndarray) -> bytes:
    raw = (np.clip(audio, -1, 1) * 32767).round().astype("<i2").tobytes()
    out = subprocess.run(
        ["sox", "-D", "-t", "raw", "-r", str(RATE), "-e", "signed", "-b", "16", "-c", "1", "-",
         "-r", "8000", "-e", "mu-law", "-b", "8", "-t", "raw", "-"],
        input=raw, capture_output=True, check=True,
    )  # fmt: skip
    return out.stdout


def client(server: ServerProcess) -> AsyncDeepgramClient:
    http = server.http_url
    env = DeepgramClientEnvironment(
        base=http, production=http.replace("http://", "ws://"), agent=http, agent_rest=http
    )
    return AsyncDeepgramClient(api_key="bench", environment=env)


async def word_times(server: ServerProcess, audio: np.ndarray) -> list[tuple[float, float]]:
    pcm = (np.clip(audio, -1, 1) * 32767).round().astype("<i2").tobytes()
    response: Any = await client(server).listen.v1.media.transcribe_file(
        request=pcm, model="nova-3", encoding="linear16",
        request_options={"additional_query_parameters": {"sample_rate": RATE}},
    )  # fmt: skip
    words = response.results.channels[0].alternatives[0].words
    return [(float(w.start), float(w.end)) for w in words]


async def build_clips(server: ServerProcess) -> list[Clip]:
    rng = np.random.default_rng(0)
    clips = []
    for i, (path, _text) in enumerate(real_clips()):
        audio = load16k(path)
        words = await word_times(server, audio)
        if len(words) < 3:
            print(f"{path.name}: {len(words)} words, skipped", flush=True)
            continue
        middle = len(audio) / RATE / 2
        k = min(range(len(words) - 1), key=lambda j: abs((words[j][1] + words[j + 1][0]) / 2 - middle))
        cut_s = (words[k][1] + words[k + 1][0]) / 2
        cut = round(cut_s * RATE)
        pause = PAUSES[i % len(PAUSES)]
        call = np.concatenate(
            [noise(LEAD_S, rng), audio[:cut], noise(pause, rng), audio[cut:], noise(TAIL_S, rng)]
        )
        call += noise(len(call) / RATE, rng)  # the line's own noise floor under the speech too
        clips.append(
            Clip(
                name=path.name,
                mulaw=mulaw8k(call),
                pause_start_s=LEAD_S + cut_s,
                pause_end_s=LEAD_S + cut_s + pause,
                true_end_s=LEAD_S + words[-1][1] + pause,
            )
        )
    return clips


async def one_call(
    server: ServerProcess, clip: Clip, query: dict[str, str]
) -> tuple[list[Any], list[float], list[float]]:
    """The call's Results with their arrival times, and each frame's send time."""
    results: list[Any] = []
    arrived: list[float] = []
    sent: list[float] = []
    options = {"encoding": "mulaw", "sample_rate": 8000, "channels": 1}
    async with client(server).listen.v1.connect(
        model="nova-3", request_options={"additional_query_parameters": {**options, **query}}
    ) as sock:

        async def receive() -> None:
            while True:
                try:
                    message = await sock.recv()
                except Exception:
                    return
                if isinstance(message, ListenV1Results):
                    results.append(message)
                    arrived.append(time.monotonic())

        receiver = asyncio.create_task(receive())
        start = time.monotonic()
        for n, at in enumerate(range(0, len(clip.mulaw), FRAME)):
            await asyncio.sleep(max(0.0, start + (n + 1) * FRAME / 8000 - time.monotonic()))
            sent.append(time.monotonic())
            await sock.send_media(clip.mulaw[at : at + FRAME])
        await sock.send_close_stream()
        await asyncio.wait_for(receiver, 60)
    return results, arrived, sent


def score(clip: Clip, results: list[Any], arrived: list[float], sent: list[float], out: Outcome) -> None:
    turn_ends = [(r, t) for r, t in zip(results, arrived, strict=True) if r.is_final and r.speech_final]
    ends = [r.start + r.duration for r, _ in turn_ends]
    if any(clip.pause_start_s - 0.3 <= e < clip.pause_end_s for e in ends):
        out.false_cuts += 1
    if any(e < clip.true_end_s - 0.3 for e in ends):
        out.early_ends += 1
    after = [t for r, t in turn_ends if r.start + r.duration >= clip.true_end_s - 0.3]
    if not after:
        out.missed += 1
        return
    frame = min(int(clip.true_end_s * 8000) // FRAME, len(sent) - 1)
    out.latencies.append(after[0] - sent[frame])


async def run_all(server: ServerProcess, clips: list[Clip]) -> dict[str, Outcome]:
    outcomes = {label: Outcome() for label, _ in CONFIGS}
    for i, clip in enumerate(clips):
        # one call at a time (this machine's 2 shared cores saturate with several), the order rotated
        # clip by clip so that drift in the machine's load falls on every configuration
        for label, query in CONFIGS[i % len(CONFIGS) :] + CONFIGS[: i % len(CONFIGS)]:
            score(clip, *(await one_call(server, clip, query)), outcomes[label])
        print(
            f"{clip.name}: "
            + ", ".join(f"{label}: {o.false_cuts} cuts, {o.latencies[-1:]}" for label, o in outcomes.items()),
            flush=True,
        )
    return outcomes


def offline(clips: list[Clip]) -> dict[str, Outcome]:
    """Each configuration's endpointer over each call's audio: false cuts, and the audio seconds from the
    true end to where the turn ended (the decision alone: no model or decode wall time)."""
    from service.pipeline.audio import StreamDecoder
    from service.pipeline.endpointing import Endpointer, TurnJudging, Utterance
    from service.pipeline.turn_model import load_turn_model
    from service.vocabulary.endpointing import EndpointSettings

    model = load_turn_model()
    outcomes = {label: Outcome() for label, _ in CONFIGS}
    for clip in clips:
        audio = StreamDecoder("MULAW", 8000, 1).feed(clip.mulaw)[0]
        for label, query in CONFIGS:
            turn = TurnJudging() if query["turn_model"] == "true" else None
            ep = Endpointer(EndpointSettings(min_silence_s=int(query["endpointing"]) / 1000), turn=turn)
            ends: list[tuple[float, float]] = []  # (speech end, where in the audio it was decided)
            for at in range(0, len(audio), 320):
                events = ep.feed(audio[at : at + 320])
                question = ep.question()
                if question is not None:
                    events += ep.judged(float(model.complete([question])[0]))
                ends += [(e.end_s, (at + 320) / RATE) for e in events if isinstance(e, Utterance)]
            o = outcomes[label]
            if any(clip.pause_start_s - 0.3 <= end < clip.pause_end_s for end, _ in ends):
                o.false_cuts += 1
            if any(end < clip.true_end_s - 0.3 for end, _ in ends):
                o.early_ends += 1
            final = [decided for end, decided in ends if end >= clip.true_end_s - 0.3]
            if final:
                o.latencies.append(final[0] - clip.true_end_s)
            else:
                o.missed += 1
    return outcomes


def table_rows(outcomes: dict[str, Outcome], n: int, what: str) -> list[str]:
    rows = [
        f"| configuration | false cuts at the pause | clips with any turn end before the true end "
        f"| {what} p50 s | p90 s | max s | no turn end |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, o in outcomes.items():
        lat = sorted(o.latencies)
        p50 = statistics.median(lat) if lat else float("nan")
        p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))] if lat else float("nan")
        mx = max(lat) if lat else float("nan")
        rows.append(
            f"| {label} | {o.false_cuts}/{n} | {o.early_ends}/{n} | {p50:.2f} | {p90:.2f} | {mx:.2f} | {o.missed} |"
        )
    return rows


def cpu_cost() -> list[tuple[int, float]]:
    """(batch, CPU ms per turn) of TurnModel.complete on 8 s of audio, features included."""
    from service.pipeline.turn_model import TurnModel

    model = TurnModel()
    rng = np.random.default_rng(1)
    rows = []
    for batch in (1, 4, 16):
        audios = [rng.standard_normal(8 * RATE).astype(np.float32) * 0.1 for _ in range(batch)]
        model.complete(audios)  # warm
        rounds = max(2, 16 // batch)
        started = time.process_time()
        for _ in range(rounds):
            model.complete(audios)
        rows.append((batch, (time.process_time() - started) / rounds / batch * 1000))
    return rows


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "turns")
    p.add_argument("--docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = load()
    server = ServerProcess(
        "--turn-model", "on", http=True, log_format="text", log_path=args.out / "server.log"
    )
    try:
        server.wait_serving(300)
        clips = asyncio.run(build_clips(server))
        print(f"{len(clips)} clips; load average {load()}", flush=True)
        before = server.metrics()
        outcomes = asyncio.run(run_all(server, clips))
        after = server.metrics()
    finally:
        server.stop(grace_s=30)
    load_end = load()

    def delta(name: str) -> float:
        return sum(v for _, v in after.series(name)) - sum(v for _, v in before.series(name))

    judged = delta("asr_turn_model_batch_sum")
    calls = delta("asr_turn_model_seconds_count")
    wall_ms = delta("asr_turn_model_seconds_sum") / max(judged, 1) * 1000
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout
    n = len(clips)
    rows = [
        f"Run {started}, commit {commit.strip()}, {os.cpu_count()} CPUs shared with other work (load average "
        f"{load_start} at start, {load_end} at end), one `asr-server` (tiny.en, `--threads 2`), Deepgram SDK "
        f"live clients on loopback, one call at a time. Data: {n} real "
        "clips (jfk.flac, pocketsphinx-testdata librivox and cards) as 8 kHz mu-law, a 0.6/0.7/0.8 s pause "
        "inserted at the word boundary nearest each clip's middle, 3 s of silence after the true end.",
        "",
        "Live, through the server (wall clock: includes the model call and the decode on this machine):",
        "",
        *table_rows(outcomes, n, "true end → speech_final"),
        "",
        "The endpointer's decision alone, on the same audio (audio seconds after the true end; machine-independent):",
        "",
        *table_rows(offline(clips), n, "true end → turn ended"),
    ]
    rows += [
        "",
        f"Turn model in the server: {judged:.0f} pauses judged in {calls:.0f} calls, {wall_ms:.1f} ms wall per "
        "pause (batched, features included, on this loaded machine).",
        "",
        "| batch | CPU ms per turn decision (features + model) |",
        "|---:|---:|",
        *[f"| {b} | {ms:.1f} |" for b, ms in cpu_cost()],
    ]
    table = "\n".join(rows)
    print(table)
    (args.out / "table.md").write_text(table + "\n")
    if args.docs:
        write_section(
            "## End of turn: the turn model against silence-only endpointing", "scripts/bench_turns.py", table
        )


if __name__ == "__main__":
    main()
