"""Engine micro-benchmark: what batching buys, measured side by side in one run.

  1. Encoder: B utterances as a loop of B single calls vs one batch-B call (log-mel,
     encoder and cross-attention K/V, as the scheduler runs them), per encoder context.
  2. Decoder: time of one decode step vs the number of sequences in it.

Runs unchanged on CUDA (`--device cuda`). Prints a markdown table and, with --write,
replaces the "Engine micro-benchmark" section of docs/benchmarks.md. End-to-end
throughput through the server (encoder batching off vs on) is scripts/bench_loadgen_ab.py.

    python scripts/bench_engine.py --model tiny.en --batch-sizes 1,4,16,64 --write
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from functools import partial

import numpy as np
import torch
from docs_section import write_section  # beside this script

from engine.config import EngineConfig
from engine.runner import ModelRunner
from engine.weights import load

SECTION = "## Engine micro-benchmark"


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def timed(fn, repeats: int, sync) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm: allocator, kernels, oneDNN primitives
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def encode_loop(runner: ModelRunner, audio: list[np.ndarray]) -> None:
    """The baseline: one encoder call per utterance."""
    for row, clip in enumerate(audio):
        runner.encode([clip], [row], [runner.audio_ctx_for(len(clip))])


def encode_batch(runner: ModelRunner, audio: list[np.ndarray]) -> None:
    runner.encode(audio, list(range(len(audio))), [runner.audio_ctx_for(len(clip)) for clip in audio])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--utterance-seconds", type=float, default=4.0, help="length of each test utterance")
    parser.add_argument("--contexts", default="full,trim", help="encoder contexts to measure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="replace the section in docs/benchmarks.md")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    weights = load(args.model)
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, kv_slots=max(sizes))
    rng = np.random.default_rng(0)
    audio = [
        (rng.standard_normal(int(16000 * args.utterance_seconds)) * 0.05).astype(np.float32)
        for _ in range(max(sizes))
    ]
    lines = [
        SECTION,
        "",
        f"`python scripts/bench_engine.py --model {args.model} --batch-sizes {args.batch_sizes}` on "
        f"{machine()}, {datetime.date.today()}; {args.utterance_seconds:g} s utterances, median of {args.repeats}.",
        "",
        "| encoder context | B | loop of B single calls (s) | one batch-B call (s) | per utterance: loop / batch (ms) | batch speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for context in args.contexts.split(","):
        config.encoder_context = context  # type: ignore[assignment]
        runner = ModelRunner(weights, config)
        for b in sizes:
            reps = (
                1
                if b * (30 if context == "full" else 1) > 200 and runner.device.type == "cpu"
                else args.repeats
            )
            loop = timed(partial(encode_loop, runner, audio[:b]), reps, runner.sync)
            batch = timed(partial(encode_batch, runner, audio[:b]), reps, runner.sync)
            lines.append(
                f"| {context} | {b} | {loop:.3f} | {batch:.3f} | {1000 * loop / b:.1f} / {1000 * batch / b:.1f} "
                f"| {loop / batch:.2f}x |"
            )
            print(lines[-1], flush=True)
        del runner
    config.encoder_context = "trim"
    runner = ModelRunner(weights, config)
    encode_batch(runner, audio)
    prompt = runner.rules.vocab
    lines += [
        "",
        "| decode batch | step time (ms) | per sequence (ms) | vs batch 1 per sequence |",
        "|---|---|---|---|",
    ]
    base = 0.0
    for b in sizes:
        runner.prefill([[prompt.sot, prompt.no_timestamps]] * b, [0] * b, slice(0, b))
        tokens, lengths = [prompt.sot] * b, [40] * b  # a step 40 tokens into each sequence
        step = timed(partial(runner.step, tokens, lengths), max(args.repeats, 10), runner.sync)
        base = base or step
        lines.append(f"| {b} | {1000 * step:.1f} | {1000 * step / b:.2f} | {base * b / step:.1f}x |")
        print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.write:
        write_section(SECTION, "scripts/bench_engine.py", "\n".join(lines[2:]))


if __name__ == "__main__":
    main()
