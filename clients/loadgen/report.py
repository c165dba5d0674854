"""asr-loadgen's reports: a run's markdown table, the table of a baseline run against a batched one,
and a run's files (LABEL.json, .md, .png)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from clients.loadgen.plot import plot


def fmt(v: float | None, spec: str = "{:.2f}") -> str:
    """`v` formatted by `spec`, or "-" for no value."""
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else spec.format(v)


def mib(v: float | None) -> str:
    return "-" if v is None else f"{v / 2**20:.0f}"


def server_cpu_per_utterance(level: dict[str, Any]) -> float | None:
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
            f"| {lv['audio_s_per_s']:.2f} | {fmt(lv['latency_p50_s'])} | {fmt(lv['latency_p95_s'])} "
            f"| {fmt(lv['latency_p99_s'])} | {fmt(wer, '{:.1f}')} | {errs} | {mib(lv['peak_rss_bytes'])} "
            f"| {fmt(server_cpu_per_utterance(lv), '{:.3f}')} |"
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
            f"| {a['concurrency']} | {a['utt_per_s']:.2f} | {b['utt_per_s']:.2f} | {fmt(change, '{:+.1f}%')} "
            f"| {fmt(a['latency_p95_s'])} | {fmt(b['latency_p95_s'])} "
            f"| {fmt(wa, '{:.1f}')} | {fmt(wb, '{:.1f}')} "
            f"| {mib(a['peak_rss_bytes'])} / {mib(b['peak_rss_bytes'])} "
            f"| {fmt(server_cpu_per_utterance(a), '{:.3f}')} / {fmt(server_cpu_per_utterance(b), '{:.3f}')} |"
        )
    return "\n".join(rows) + "\n"


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
