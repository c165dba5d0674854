"""Each engine lever's effect, side by side in one run, on the same manifest.

Every configuration transcribes the whole manifest with all utterances submitted at once
(the scheduler's windows, slots and continuous batching doing their job) and reports
throughput, WER, CPU per utterance, full-context fallbacks and scheduler-blocked time,
with ratios against the first configuration (Whisper's full 30 s context, fp32).

    python scripts/bench_levers.py --manifest bench-out/ab/manifest/manifest.jsonl --write
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from docs_section import write_section  # beside this script
from prometheus_client import REGISTRY

from clients.scoring import corpus_wer
from engine import Engine, EngineConfig
from service.audio import decode_file

SECTION = "## Engine levers"

LEVERS: list[tuple[str, dict[str, Any]]] = [
    ("full context, fp32 (baseline)", {"encoder_context": "full"}),
    ("trimmed context, margin 1 s", {"encoder_context": "trim", "trim_margin_s": 1.0}),
    ("trimmed context, margin 2 s (default)", {"encoder_context": "trim", "trim_margin_s": 2.0}),
    ("trimmed + int8 quantized", {"encoder_context": "trim", "quantize": True}),
    ("full + int8 quantized", {"encoder_context": "full", "quantize": True}),
    (
        "trimmed, encoder batch <= 4 while decoding",
        {"encoder_context": "trim", "max_encoder_batch_while_decoding": 4},
    ),
    ("trimmed, encoder batching off", {"encoder_context": "trim", "encoder_batching": False}),
]
COUNTERS = ("asr_encoder_fallbacks_total", "asr_scheduler_blocked_seconds_sum", "asr_encoder_seconds_sum")


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def run(config: EngineConfig, clips: list[Any], refs: list[str]) -> dict[str, float]:
    engine = Engine(config)
    engine.start()
    engine.warmup()
    before = {n: sample(n) for n in COUNTERS}
    cpu0, wall0 = time.process_time(), time.perf_counter()
    handles = [engine.submit(clip) for clip in clips]
    texts = [h.future.result().text for h in handles]
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    engine.stop()
    delta = {n: sample(n) - before[n] for n in COUNTERS}
    return {
        "utt_per_s": len(clips) / wall,
        "wer": corpus_wer(refs, texts),
        "cpu_s_per_utt": cpu / len(clips),
        "fallbacks": delta["asr_encoder_fallbacks_total"],
        "blocked_fraction": delta["asr_scheduler_blocked_seconds_sum"] / wall,
        "encoder_s_per_utt": delta["asr_encoder_seconds_sum"] / len(clips),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="replace the section in docs/benchmarks.md")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.manifest.read_text().splitlines() if line.strip()]
    clips = [
        decode_file((args.manifest.parent / r["audio"]).read_bytes(), r["encoding"], r["sample_rate"], 1)[0][
            0
        ]
        for r in rows
    ]
    refs = [r["text"] for r in rows]
    results = []
    for name, overrides in LEVERS:
        config = EngineConfig(model=args.model, threads=args.threads, **overrides)
        results.append((name, run(config, clips, refs)))
        print(name, results[-1][1], flush=True)
    base = results[0][1]
    lines = [
        SECTION,
        "",
        f"`python scripts/bench_levers.py --manifest {args.manifest}` on {platform.machine()}, "
        f"{args.threads} threads, torch {torch.__version__}, {datetime.date.today()}: {len(clips)} utterances "
        f"({sum(len(c) for c in clips) / 16000:.0f} s of 8 kHz call-center audio), all submitted at once, "
        f"model {args.model}. One run, one configuration after another; ratios against the first row.",
        "",
        "| configuration | utt/s | vs baseline | WER % | CPU s/utt | encoder s/utt | full-context fallbacks | scheduler blocked (fraction of wall) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results:
        lines.append(
            f"| {name} | {r['utt_per_s']:.2f} | {r['utt_per_s'] / base['utt_per_s']:.2f}x | {100 * r['wer']:.1f} "
            f"| {r['cpu_s_per_utt']:.3f} | {r['encoder_s_per_utt']:.3f} | {r['fallbacks']:.0f} | {r['blocked_fraction']:.2f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.json_out:
        args.json_out.write_text(json.dumps(dict(results), indent=1))
    if args.write:
        write_section(SECTION, "scripts/bench_levers.py", "\n".join(lines[2:]))


if __name__ == "__main__":
    main()
