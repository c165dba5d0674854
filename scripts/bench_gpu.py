#!/usr/bin/env python3
"""The GPU check's measurements, one step per subcommand (scripts/gpu_check.sh runs them,
each under its own timeout). Every step prints its markdown table as soon as it is done and
appends it to --md.

  encoder  one encoder pass over B utterances vs a loop of B single calls, full and trimmed
           context, at a model size's dimensions (`--model random:large-v3`: compute does
           not depend on the weights' values)
  engine   the engine end to end (public API) with encoder batching off vs on, C callers
           each submitting one utterance after another (starts staggered over --ramp-s),
           each utterance decoding a fixed number of tokens drawn from a call-center-like
           distribution (random weights suppress end of text: load_random in engine/model/weights.py);
           throughput, p50/p95 latency from the futures, scheduler-blocked fraction and the
           encoder's share of the scheduler's busy time from the engine's Prometheus metrics
  step     the decode step with CUDA graphs off vs on (one graph per batch bucket, engine/model/step.py) at
           each batch size, on real weights, and whether the greedy tokens agree; on a CPU (the
           rehearsal) the "on" rows run the same static bucketed shapes without the capture
  sanity   real weights (a CTranslate2 tiny.en folder) on real clips: tokens per dtype on
           --device vs float32 on the CPU, and WER against the transcripts
  server   encoder batching off vs on through asr-server (scripts/bench_loadgen_ab.py), with
           the server's CPU-seconds per second, so a frontend-bound result shows as such

    python3 scripts/bench_gpu.py encoder --model random:large-v3 --device cuda --dtype float16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import wave
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout

from engine import DecodeOptions, Engine, EngineConfig  # noqa: E402
from engine.api import SAMPLE_RATE  # noqa: E402
from harness.stats import percentile  # noqa: E402
from harness.usage import Stopwatch, median_wall_s  # noqa: E402

# Sums of the engine's histograms that the engine step reads (engine/metrics.py).
SUMS = (
    "asr_encoder_seconds_sum",
    "asr_encoder_seconds_count",
    "asr_encoder_batch_size_sum",
    "asr_scheduler_blocked_seconds_sum",
    "asr_prefill_seconds_sum",
    "asr_decode_step_seconds_sum",
    "asr_feature_seconds_sum",
)


def emit(md: Path | None, lines: list[str]) -> None:
    text = "\n".join(lines) + "\n\n"
    print(text, end="", flush=True)
    if md is not None:
        with md.open("a") as f:
            f.write(text)


def sync_for(device: str) -> Callable[[], None]:
    import torch

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return torch.cuda.synchronize
    return lambda: None


def noise(seconds: float, rng: np.random.Generator) -> np.ndarray:
    return (rng.standard_normal(int(SAMPLE_RATE * seconds)) * 0.05).astype(np.float32)


# ------------------------------------------------------------------------------ encoder


def step_encoder(args: argparse.Namespace) -> None:
    from engine.model.runner import ModelRunner
    from engine.model.weights import load

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    weights = load(args.model, args.cache_dir or None)
    rng = np.random.default_rng(0)
    audio = [noise(args.utterance_seconds, rng) for _ in range(max(sizes))]
    lines = [
        f"### Encoder pass: {args.model}, {args.device} {args.dtype}, {args.utterance_seconds:g} s utterances, "
        f"median of {args.repeats}",
        "",
        "| context | B | loop of B calls (ms) | one batch-B call (ms) | per utterance loop / batch (ms) | speed-up |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for context in args.contexts.split(","):
        config = EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            kv_slots=max(sizes),
            encoder_context=context,  # type: ignore[arg-type]
            cache_dir=args.cache_dir,
        )
        runner = ModelRunner(weights, config)
        ctx = [runner.audio_ctx_for(len(clip)) for clip in audio]

        def loop(b: int, runner: ModelRunner = runner, ctx: list[int] = ctx) -> None:
            for row in range(b):
                runner.encode([audio[row]], [row], [ctx[row]])

        def batch(b: int, runner: ModelRunner = runner, ctx: list[int] = ctx) -> None:
            runner.encode(audio[:b], list(range(b)), ctx[:b])

        for b in sizes:
            t_loop = median_wall_s(lambda b=b: loop(b), args.repeats, runner.sync)  # type: ignore[misc]
            t_batch = median_wall_s(lambda b=b: batch(b), args.repeats, runner.sync)  # type: ignore[misc]
            lines.append(
                f"| {context} ({ctx[0]} positions) | {b} | {1000 * t_loop:.1f} | {1000 * t_batch:.1f} "
                f"| {1000 * t_loop / b:.2f} / {1000 * t_batch / b:.2f} | {t_loop / t_batch:.2f}x |"
            )
            print(lines[-1], flush=True)
        del runner
    emit(args.md, lines)


# ------------------------------------------------------------------------------ engine


def metric_sums() -> dict[str, float]:
    from prometheus_client import REGISTRY

    return {name: REGISTRY.get_sample_value(name) or 0.0 for name in SUMS}


def workload(n: int, seed: int) -> list[tuple[float, int]]:
    """(audio seconds, tokens) per utterance: call-center turns are short (log-normal around
    3 s, 1..12 s) and speech runs at about 3.3 tokens a second (2.5 words/s, 1.3 tokens/word)."""
    rng = np.random.default_rng(seed)
    seconds = np.clip(rng.lognormal(np.log(3.0), 0.6, n), 1.0, 12.0)
    return [(float(s), max(3, round(3.3 * s))) for s in seconds]


def run_engine(config: EngineConfig, concurrency: int, total: int, ramp_s: float) -> dict[str, Any]:
    engine = Engine(config)
    engine.start()
    try:
        rng = np.random.default_rng(1)
        jobs = workload(total, seed=2)
        clips = [noise(s, rng) for s, _ in jobs]
        language = "en" if engine.info.multilingual else None

        def submit(i: int) -> Future[Any]:
            opts = DecodeOptions(language=language, max_new_tokens=jobs[i][1])
            return engine.submit(clips[i], opts).future

        for f in [submit(i) for i in range(min(8, total))]:  # warm the shapes up, untimed
            f.result(timeout=600)
        before = metric_sums()
        latencies: list[float] = []
        tokens = 0
        lock = threading.Lock()
        next_job = iter(range(total))
        errors: list[BaseException] = []

        def caller(k: int) -> None:
            nonlocal tokens
            time.sleep(ramp_s * k / concurrency)
            while True:
                with lock:
                    i = next(next_job, None)
                if i is None:
                    return
                try:
                    result = submit(i).result(timeout=600)
                except BaseException as exc:  # reported below, never silently dropped
                    errors.append(exc)
                    return
                with lock:
                    latencies.append(result.stats.latency_s)
                    tokens += len(result.tokens)

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(concurrency)]
        with Stopwatch(descendants=False) as timed:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wall = timed.wall_s
        after = metric_sums()
    finally:
        engine.stop()
    if errors:
        raise RuntimeError(f"{len(errors)} utterances failed; first: {errors[0]!r}")
    d = {k: after[k] - before[k] for k in SUMS}
    busy = d["asr_encoder_seconds_sum"] + d["asr_prefill_seconds_sum"] + d["asr_decode_step_seconds_sum"]
    calls = d["asr_encoder_seconds_count"]
    return {
        "utt_s": len(latencies) / wall,
        "tok_s": tokens / wall,
        "p50": percentile(latencies, 50),
        "p95": percentile(latencies, 95),
        "blocked": d["asr_scheduler_blocked_seconds_sum"] / wall,
        "enc_share": d["asr_encoder_seconds_sum"] / busy if busy else 0.0,
        "mean_batch": d["asr_encoder_batch_size_sum"] / calls if calls else 0.0,
        "n": len(latencies),
        "wall": wall,
    }


def step_engine(args: argparse.Namespace) -> None:
    levels = [int(c) for c in args.concurrency.split(",")]
    lines = [
        f"### Engine end to end: {args.model}, {args.device} {args.dtype}, {args.utterances} utterances per "
        f"run, starts staggered over {args.ramp_s:g} s, window {args.batch_window_ms:g} ms, "
        f"context {args.context}",
        "",
        "| callers | encoder batching | utt/s | tokens/s | p50 s | p95 s | scheduler blocked | "
        "encoder share of busy time | mean encoder batch | utt/s change |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in levels:
        base = 0.0
        for batching in (False, True):
            config = EngineConfig(
                model=args.model,
                device=args.device,
                dtype=args.dtype,
                cache_dir=args.cache_dir,
                encoder_batching=batching,
                kv_slots=max(c, 1),
                max_batch=max(c, 1),
                max_queue=max(256, 2 * c),
                batch_window_ms=args.batch_window_ms,
                encoder_context=args.context,
                warmup=False,
            )
            r = run_engine(config, c, max(args.utterances, c), args.ramp_s)
            change = f"{100 * (r['utt_s'] / base - 1):+.1f}%" if base else "-"
            base = base or r["utt_s"]
            lines.append(
                f"| {c} | {'on' if batching else 'off'} | {r['utt_s']:.2f} | {r['tok_s']:.0f} | {r['p50']:.3f} "
                f"| {r['p95']:.3f} | {100 * r['blocked']:.1f}% | {100 * r['enc_share']:.1f}% "
                f"| {r['mean_batch']:.1f} | {change} |"
            )
            print(lines[-1], flush=True)
    emit(args.md, lines)


# ------------------------------------------------------------------------------ step


def step_decode(args: argparse.Namespace) -> None:
    from engine.model.runner import ModelRunner
    from engine.model.step import DecodeStepper
    from engine.model.weights import load

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    slots = max(sizes)
    weights = load(str(args.weights), args.cache_dir or None)
    config = EngineConfig(
        model=str(args.weights), device=args.device, dtype=args.dtype, kv_slots=slots, cache_dir=args.cache_dir,
        cuda_graphs="off",
    )  # fmt: skip
    runner = ModelRunner(weights, config)
    rng = np.random.default_rng(0)
    audio = [noise(args.utterance_seconds, rng) for _ in range(slots)]
    runner.encode(audio, list(range(slots)), [runner.audio_ctx_for(len(clip)) for clip in audio])
    v = runner.rules.vocab
    runner.prefill([[v.sot, v.no_timestamps]] * slots, [0] * slots, slice(0, slots))
    cuda = runner.device.type == "cuda"
    eager = runner.stepper
    static = DecodeStepper(runner.model, runner.cache, runner.device, compile=False, graphs=cuda, static=True)
    label = "CUDA graphs" if cuda else "static buckets, no capture (CPU)"
    lines = [
        f"### Decode step: CUDA graphs off vs on ({args.weights.name}, {runner.device} {runner.dtype}), a step "
        f"{args.length} tokens into each sequence, median of {args.repeats}",
        "",
        f"| batch | graphs off (ms) | {label} (ms) | speed-up | same greedy token |",
        "|---:|---:|---:|---:|---:|",
    ]
    for b in sizes:

        def run(stepper: DecodeStepper, b: int = b) -> Any:
            runner.stepper = stepper
            return runner.step([v.sot] * b, [args.length] * b).argmax(dim=-1).cpu()

        same = int((run(eager) == run(static)).sum())
        t_off = median_wall_s(lambda: run(eager), args.repeats, runner.sync)
        t_on = median_wall_s(lambda: run(static), args.repeats, runner.sync)
        lines.append(f"| {b} | {1000 * t_off:.2f} | {1000 * t_on:.2f} | {t_off / t_on:.2f}x | {same}/{b} |")
        print(lines[-1], flush=True)
    if cuda:
        lines += [
            "",
            f"Graphs captured: {len(static.captured_shapes)} ({', '.join(map(str, static.captured_shapes))}).",
        ]
    emit(args.md, lines)


# ------------------------------------------------------------------------------ sanity


def read_wav(path: Path) -> np.ndarray:
    """16 kHz mono 16-bit WAV (what scripts/gpu_pack.sh writes) as float32."""
    with wave.open(str(path)) as w:
        if w.getframerate() != SAMPLE_RATE or w.getnchannels() != 1 or w.getsampwidth() != 2:
            raise ValueError(f"{path}: need 16 kHz mono 16-bit PCM, got {w.getparams()}")
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    return (pcm.astype(np.float32) / 32768.0).copy()


def transcribe(config: EngineConfig, clips: list[np.ndarray]) -> list[Any]:
    engine = Engine(config)
    engine.start()
    try:
        return [engine.submit(clip, DecodeOptions()).future.result(timeout=300) for clip in clips]
    finally:
        engine.stop()


def step_sanity(args: argparse.Namespace) -> None:
    from clients.scoring import corpus_wer

    entries = [json.loads(line) for line in args.manifest.read_text().splitlines() if line.strip()]
    clips = [read_wav(args.manifest.parent / e["audio"]) for e in entries]
    refs = [e["text"] for e in entries]
    common = {"model": str(args.weights), "cache_dir": args.cache_dir, "warmup": False}
    reference = transcribe(EngineConfig(device="cpu", dtype="float32", **common), clips)
    lines = [
        f"### Real weights: {args.weights.name} on {len(clips)} real clips ({args.manifest.parent.name}), "
        f"tokens vs CPU float32",
        "",
        "| device | dtype | clips with identical tokens | tokens differing | WER % |",
        "|---|---|---:|---:|---:|",
    ]

    def row(device: str, dtype: str, results: list[Any]) -> None:
        same = sum(r.tokens == ref.tokens for r, ref in zip(results, reference, strict=True))
        differing = sum(
            sum(a != b for a, b in zip(r.tokens, ref.tokens, strict=False))
            + abs(len(r.tokens) - len(ref.tokens))
            for r, ref in zip(results, reference, strict=True)
        )
        wer = 100 * corpus_wer(refs, [r.text for r in results])
        lines.append(f"| {device} | {dtype} | {same}/{len(clips)} | {differing} | {wer:.1f} |")
        print(lines[-1], flush=True)

    row("cpu", "float32", reference)
    for dtype in args.dtypes.split(","):
        row(args.device, dtype, transcribe(EngineConfig(device=args.device, dtype=dtype, **common), clips))
    emit(args.md, lines)


# ------------------------------------------------------------------------------ server


def step_server(args: argparse.Namespace) -> None:
    out = args.out
    cmd = [
        sys.executable, str(REPO / "scripts" / "bench_loadgen_ab.py"), "--manifest", str(args.manifest),
        "--concurrency", args.concurrency, "--utterances-per-level", str(args.utterances),
        "--chunk-ms", str(args.chunk_ms), "--wait-ready", str(args.wait_ready), "--threads", str(args.threads),
        "--out", str(out), "--",
        "--model", str(args.weights), "--device", args.device, "--kv-slots", str(args.kv_slots),
        "--max-batch", str(args.kv_slots), "--cache-dir", args.cache_dir or str(out / "cache"),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ})
    runs = {label: json.loads((out / f"{label}.json").read_text()) for label in ("baseline", "batched")}
    lines = [
        f"### Through asr-server ({args.weights.name}, {args.device}): encoder batching off vs on, "
        f"{args.chunk_ms} ms chunks, {runs['baseline']['manifest_utterances']} real clips",
        "",
        "| callers | encoder batching | utt/s | p50 s | p95 s | WER % | errors | server CPU s/utt "
        "| server CPU s per s |",
        "|---:|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for label, mode in (("baseline", "off"), ("batched", "on")):
        for lv in runs[label]["levels"]:
            cpu = lv.get("server_seconds_per_utterance", {}).get("process_cpu_seconds")
            per_s = "-" if cpu is None else f"{cpu * lv['utt_per_s']:.2f}"
            wer = "-" if lv["wer"] is None else f"{100 * lv['wer']:.1f}"
            p50 = "-" if lv["latency_p50_s"] is None else f"{lv['latency_p50_s']:.3f}"
            p95 = "-" if lv["latency_p95_s"] is None else f"{lv['latency_p95_s']:.3f}"
            errs = sum(lv["errors"].values())
            lines.append(
                f"| {lv['concurrency']} | {mode} | {lv['utt_per_s']:.2f} | {p50} | {p95} | {wer} | {errs} "
                f"| {'-' if cpu is None else f'{cpu:.3f}'} | {per_s} |"
            )
    lines += [
        "",
        "Server CPU s per s: the server process's CPU seconds (all threads) per second of wall time. "
        "Near the host's core count, or batching on and off at the same utt/s with it above ~1 (the one "
        "event-loop thread runs gRPC, G.711, resampling and VAD), the frontend sets the pace, not the GPU.",
    ]
    emit(args.md, lines)


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--md", type=Path, default=None, help="append each table to this file")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--cache-dir", default="", help="engine cache (converted weights, tokenizer files)")
    sub = p.add_subparsers(dest="step", required=True)

    e = sub.add_parser("encoder")
    e.add_argument("--model", default="random:large-v3")
    e.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    e.add_argument("--contexts", default="full,trim")
    e.add_argument("--utterance-seconds", type=float, default=4.0)
    e.add_argument("--repeats", type=int, default=3)

    g = sub.add_parser("engine")
    g.add_argument("--model", default="random:large-v3")
    g.add_argument("--concurrency", default="16,64")
    g.add_argument("--utterances", type=int, default=128, help="per run (at least the callers)")
    g.add_argument("--ramp-s", type=float, default=0.5, help="callers' first submits spread over this")
    g.add_argument("--batch-window-ms", type=float, default=10.0)
    g.add_argument("--context", default="trim", choices=("trim", "full"))

    d = sub.add_parser("step")
    d.add_argument("--weights", type=Path, required=True, help="CTranslate2 or Hugging Face Whisper folder")
    d.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    d.add_argument("--length", type=int, default=40, help="the step's position in each sequence")
    d.add_argument("--utterance-seconds", type=float, default=4.0)
    d.add_argument("--repeats", type=int, default=20)

    s = sub.add_parser("sanity")
    s.add_argument("--weights", type=Path, required=True, help="CTranslate2 or Hugging Face Whisper folder")
    s.add_argument("--manifest", type=Path, required=True, help="manifest.jsonl of 16 kHz WAVs with text")
    s.add_argument("--dtypes", default="float16,bfloat16")

    v = sub.add_parser("server")
    v.add_argument("--weights", type=Path, required=True)
    v.add_argument("--manifest", type=Path, required=True)
    v.add_argument("--out", type=Path, required=True)
    v.add_argument("--concurrency", default="16,64")
    v.add_argument("--utterances", type=int, default=128, help="per level")
    v.add_argument("--chunk-ms", type=int, default=200)
    v.add_argument("--wait-ready", type=float, default=90.0)
    v.add_argument("--threads", type=int, default=4, help="server torch threads")
    v.add_argument("--kv-slots", type=int, default=64)

    args = p.parse_args(argv)
    step = {
        "encoder": step_encoder,
        "engine": step_engine,
        "step": step_decode,
        "sanity": step_sanity,
        "server": step_server,
    }
    step[args.step](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
