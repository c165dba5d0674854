#!/usr/bin/env python
"""Capacity of asr-server's frontends (issue 12): live calls per configuration, and speaking calls
through the server against the in-process engine, in one run, one table.

    python scripts/bench_capacity.py [--seconds 20] [--before REF] [--out bench-out/capacity] [--write]

1. Line noise (8 kHz mu-law hiss, no speech: the frontends' per-chunk work and nothing for the
   engine), paced in real time: 128 calls in 20 ms chunks and 256 calls in 100 ms chunks, each with
   --frontends 1 and 2; a fresh server per configuration. `asr-loadgen capacity` reports whether
   the server kept up (close lag p95 <= 0.5 s), its CPU over all its processes per call, and per
   process. With --before REF, each row also runs REF's code (git archive) just before this checkout's.
2. Calls held: line-noise calls in 20 ms chunks up a ladder (16, 32, 48, ...) on one server per
   --frontends value, until a step does not keep up.
3. 16 speaking calls sent as fast as possible (`asr-loadgen run --concurrency 16`) through the
   server, then the same clips submitted at once to an in-process `engine.Engine` with the same
   settings: throughput ratio, on REAL speech (pocketsphinx-testdata librivox + cards, and
   jfk.flac, each as 8 kHz mu-law) and on ESPEAK speech (`asr-loadgen make-manifest --telephone`).

--write puts the table into docs/benchmarks.md under "## Capacity: frontends and calls".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout

from clients import loadgen  # noqa: E402
from clients.loadgen.report import fmt  # noqa: E402
from clients.manifest import build_manifest  # noqa: E402
from harness.server import ServerProcess, checkout  # noqa: E402
from harness.usage import Stopwatch  # noqa: E402
from scripts.docs_section import write_section  # noqa: E402
from scripts.real_speech import build_real_manifest  # noqa: E402

SECTION = "## Capacity: frontends and calls"
NOISE_RUNS = [(128, 20), (256, 100)]  # (calls, chunk ms): the two live-call targets
TARGET_PCT = {20: 0.4, 100: 0.2}  # % of a core per call, by chunk ms (issue 12)
HELD_LADDER = (16, 32, 48, 64, 96, 128, 192, 256)  # calls, 20 ms chunks
SPEAKING_CALLS = 16
SPEAKING_TARGET = 0.95  # through the server >= 95% of the in-process engine's throughput


@contextlib.contextmanager
def server(
    frontends: int, threads: int, log: Path, *extra: str, source: Path | None = None
) -> Iterator[tuple[str, str]]:
    """asr-server on loopback with free ports: (gRPC target, metrics URL) once SERVING; `source`: the
    code of an older ref (harness.server.checkout) instead of this checkout's."""
    flags = ["--frontends", str(frontends), "--log-level", "warning", "--max-streams", "1024", *extra]
    with ServerProcess(*flags, threads=threads, log_format="text", log_path=log, source=source) as process:
        process.wait_serving(300)
        yield process.target, process.metrics_url


# --- the runs ---


def noise_run(
    calls: int, chunk_ms: int, frontends: int, args: argparse.Namespace, source: Path | None = None
) -> dict[str, Any]:
    label = f"noise-{calls}x{chunk_ms}ms-f{frontends}" + ("-before" if source else "")
    report = args.out / f"{label}.json"
    print(f"== {label}", file=sys.stderr, flush=True)
    profile = ("--debug-profile-dir", str(args.out.resolve())) if args.profile else ()
    log = args.out / f"server-{label}.log"
    with server(frontends, args.threads, log, *profile, source=source) as (target, metrics):
        loadgen.main(
            ["capacity", "--server", target, "--metrics", metrics, "--calls", str(calls),
             "--chunk-ms", str(chunk_ms), "--seconds", str(args.seconds),
             "--client-processes", str(args.client_processes), "--json-out", str(report)]
        )  # fmt: skip
    return dict(json.loads(report.read_text()))


def held_calls(frontends: int, args: argparse.Namespace) -> dict[str, Any]:
    """The most line-noise calls in 20 ms chunks that one server keeps up with: calls up a ladder,
    --held-seconds each, on one server, until a step misses (every step's streams close before the
    next starts, so no backlog carries over)."""
    held, missed = 0, None
    with server(frontends, args.threads, args.out / f"server-held-f{frontends}.log") as (target, metrics):
        for calls in HELD_LADDER:
            label = f"held-{calls}-f{frontends}"
            print(f"== {label}", file=sys.stderr, flush=True)
            loadgen.main(
                ["capacity", "--server", target, "--metrics", metrics, "--calls", str(calls),
                 "--chunk-ms", "20", "--seconds", str(args.held_seconds),
                 "--client-processes", str(args.client_processes), "--json-out", str(args.out / f"{label}.json")]
            )  # fmt: skip
            report = json.loads((args.out / f"{label}.json").read_text())
            if not report["kept_up"]:
                missed = report
                break
            held = calls
    return {"frontends": frontends, "held": held, "missed": missed}


def server_speaking(manifest: Path, label: str, utterances: int, args: argparse.Namespace) -> dict[str, Any]:
    print(f"== {label} through the server", file=sys.stderr, flush=True)
    with server(args.speaking_frontends, args.threads, args.out / f"server-{label}.log") as (target, metrics):
        loadgen.main(
            ["run", "--server", target, "--manifest", str(manifest), "--concurrency", str(SPEAKING_CALLS),
             "--utterances-per-level", str(utterances), "--metrics", metrics, "--warmup", "2",
             "--out", str(args.out), "--label", label]
        )  # fmt: skip
    run = json.loads((args.out / f"{label}.json").read_text())
    return {**run["levels"][0], "loadavg_1m": run["machine"]["loadavg_1m_start_end"][0]}


def in_process_speaking(manifest: Path, utterances: int, threads: int) -> dict[str, float]:
    """The same clips, in the same order and number, submitted at once to an in-process engine with
    the server's settings (decoded and resampled by the service's own code)."""
    # as asr-server does (service/runtime/supervisor.py main): spinning OpenMP workers starve everything else
    # on a busy machine, and the comparison is with the server's engine process
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from engine import Engine, EngineConfig
    from service.pipeline.audio import decode_file

    rows = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    clips = [
        decode_file((manifest.parent / r["audio"]).read_bytes(), r["encoding"], r["sample_rate"], 1)[0][0]
        for r in rows
    ]
    from prometheus_client import REGISTRY

    def fallbacks() -> float:
        # one series per reason (no_eot, repeat, compression): the unlabelled name has no sample
        return sum(
            s.value
            for metric in REGISTRY.collect()
            if metric.name == "asr_encoder_fallbacks"
            for s in metric.samples
            if s.name == "asr_encoder_fallbacks_total"
        )

    engine = Engine(EngineConfig(threads=threads))
    engine.start()
    try:
        engine.warmup()
        before = fallbacks()
        load = os.getloadavg()[0]
        with Stopwatch() as timed:
            handles = [engine.submit(clips[i % len(clips)]) for i in range(utterances)]
            for h in handles:
                h.future.result()
        wall = timed.wall_s
    finally:
        engine.stop()
    return {
        "utt_per_s": utterances / wall,
        "wall_s": wall,
        "full_context_fallbacks": fallbacks() - before,
        "loadavg_1m": load,
    }


# --- the table ---


def table(
    noise: list[dict[str, Any]], held: list[dict[str, Any]], speaking: list[dict[str, Any]], head: str
) -> str:
    lines = [
        head,
        "",
        "| line noise, real-time calls | frontends | kept up (p95 lag <= 0.5 s) | close lag p50 / p95 / max s "
        "| server CPU % of a core per call (target) | server cores used | engine / frontends / supervisor CPU s "
        "| errors | client cores, sent late by at most | load average |",
        "|---|---:|---|---|---|---:|---|---|---|---:|",
    ]
    for r in noise:
        by = r["server_cpu_s_by_process"]
        fronts = sum(v for k, v in by.items() if k.startswith("frontend"))
        errs = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "0"
        pct = r["cpu_per_call_pct"]
        target = TARGET_PCT.get(r["chunk_ms"])
        met = (
            "" if pct is None or target is None else (" met" if pct <= target and r["kept_up"] else " missed")
        )
        code = f", {r['code']}" if r.get("code") else ""
        lines.append(
            f"| {r['calls']} x {r['seconds_per_call']:g} s in {r['chunk_ms']} ms chunks{code} "
            f"| {r['frontends']} | {'yes' if r['kept_up'] else 'NO'} "
            f"| {fmt(r['close_lag_p50_s'])} / {fmt(r['close_lag_p95_s'])} / {fmt(r['close_lag_max_s'])} "
            f"| {fmt(pct, '{:.3f}')} (<= {target}){met} | {fmt(r['server_cores_used'])} "
            f"| {by.get('engine', 0):.1f} / {fronts:.1f} / {by.get('supervisor', 0):.1f} | {errs} "
            f"| {fmt(r['client_cores_used'])}, {r['client_send_late_max_s']:.2f} s "
            f"| {r['loadavg_1m_start_end'][0]:.1f} |"
        )
    if held:
        lines += [
            "",
            f"| calls held at p95 close lag <= 0.5 s (line noise, 20 ms chunks, ladder {HELD_LADDER}) | frontends "
            "| held | first missed: calls, p95 lag s, CPU % of a core per call, server cores used, load average |",
            "|---|---:|---:|---|",
        ]
        for h in held:
            m = h["missed"]
            miss = (
                "none missed"
                if m is None
                else f"{m['calls']}, {fmt(m['close_lag_p95_s'])}, {fmt(m['cpu_per_call_pct'], '{:.3f}')}, "
                f"{fmt(m['server_cores_used'])}, {m['loadavg_1m_start_end'][0]:.1f}"
            )
            lines.append(f"| line noise, 20 ms chunks | {h['frontends']} | {h['held']} | {miss} |")
    lines += [
        "",
        f"| {SPEAKING_CALLS} speaking calls, as fast as possible | clips | server utt/s | in-process utt/s "
        f"| server / in-process (target >= {SPEAKING_TARGET:.0%}) | server p95 latency s | WER % | IPC mean ms "
        "| errors | in-process full-context fallbacks | load average server / in-process |",
        "|---|---:|---:|---:|---|---:|---:|---:|---|---:|---|",
    ]
    for s in speaking:
        lv, ratio = s["server"], s["server"]["utt_per_s"] / s["in_process"]["utt_per_s"]
        ipc = lv["server_seconds_per_utterance"].get("asr_ipc_seconds")
        errs = ", ".join(f"{k} {v}" for k, v in sorted(lv["errors"].items())) or "0"
        lines.append(
            f"| {s['set']} | {lv['utterances']} | {lv['utt_per_s']:.2f} | {s['in_process']['utt_per_s']:.2f} "
            f"| {ratio:.0%} {'met' if ratio >= SPEAKING_TARGET else 'missed'} | {fmt(lv['latency_p95_s'])} "
            f"| {fmt(None if lv['wer'] is None else 100 * lv['wer'], '{:.1f}')} "
            f"| {fmt(None if ipc is None else 1000 * ipc)} | {errs} "
            f"| {s['in_process']['full_context_fallbacks']:.0f} "
            f"| {lv['loadavg_1m']:.1f} / {s['in_process']['loadavg_1m']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0, help="audio per live call")
    p.add_argument("--frontends", default="1,2", help="frontend counts for the line-noise runs")
    p.add_argument(
        "--held-seconds", type=float, default=10.0,
        help="audio per call on each step of the calls-held ladder (0: skip the ladder)",
    )  # fmt: skip
    p.add_argument("--speaking-frontends", type=int, default=1, help="frontends for the speaking runs")
    p.add_argument("--speaking-utterances", type=int, default=32, help="clips per speaking run (cycled)")
    p.add_argument("--client-processes", type=int, default=2, help="load generator processes")
    p.add_argument("--threads", type=int, default=2, help="torch threads (server and in-process engine)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="cProfile each frontend (OUT/frontend-*.prof) and print its top",
    )
    p.add_argument(
        "--before",
        default="",
        help="a git ref whose server also runs each line-noise row, just before this one",
    )
    p.add_argument("--skip-noise", action="store_true")
    p.add_argument("--skip-speaking", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench-out/capacity"))
    p.add_argument("--write", action="store_true", help=f"write the table to docs/benchmarks.md ({SECTION})")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    started = time.monotonic()

    noise: list[dict[str, Any]] = []
    if not args.skip_noise:
        with contextlib.ExitStack() as stack:
            # (label, code): with --before, each line-noise row runs that ref's server right before this one
            sources: list[tuple[str, Path | None]] = [("", None)]
            if args.before:
                sources.insert(0, (f"before ({args.before[:7]})", stack.enter_context(checkout(args.before))))
            for calls, chunk_ms in NOISE_RUNS:
                for frontends in (int(x) for x in args.frontends.split(",")):
                    for name, source in sources:
                        r = noise_run(calls, chunk_ms, frontends, args, source)
                        r["frontends"] = frontends
                        r["code"] = name
                        noise.append(r)

    held: list[dict[str, Any]] = []
    if args.held_seconds > 0:
        for frontends in (int(x) for x in args.frontends.split(",")):
            held.append(held_calls(frontends, args))

    speaking: list[dict[str, Any]] = []
    if not args.skip_speaking:
        sets = [
            ("REAL (librivox + cards + jfk, 8 kHz mu-law)", build_real_manifest(args.out / "real")),
            ("ESPEAK (make-manifest --telephone)", build_manifest(args.out / "espeak", 16, ("MULAW",))),
        ]
        for name, manifest in sets:
            label = "speaking-" + name.split()[0].lower()
            through = server_speaking(manifest, label, args.speaking_utterances, args)
            local = in_process_speaking(manifest, args.speaking_utterances, args.threads)
            speaking.append({"set": name, "server": through, "in_process": local})
            print(f"{name}: server {through['utt_per_s']:.2f} utt/s, in-process {local['utt_per_s']:.2f}",
                  file=sys.stderr, flush=True)  # fmt: skip

    if args.profile:
        import pstats

        for prof in sorted(args.out.glob("frontend-*.prof")):
            print(f"== {prof.name}: top 25 by own time", file=sys.stderr)
            pstats.Stats(str(prof), stream=sys.stderr).sort_stats("tottime").print_stats(25)
    load_end = os.getloadavg()
    head = (
        f"`python scripts/bench_capacity.py --seconds {args.seconds:g}{' --before ' + args.before if args.before else ''}` on {platform.machine()}, "
        f"{os.cpu_count()} CPUs shared with other work (load average {load_start[0]:.1f} at the start, "
        f"{load_end[0]:.1f} at the end), {dt.date.today()}, tiny.en, --threads {args.threads}, "
        f"{args.client_processes} load-generator processes on the same machine; a fresh server per row; "
        f"took {time.monotonic() - started:.0f} s; calls-held ladder: {args.held_seconds:g} s per step. Speaking rows: {args.speaking_utterances} clips per set "
        f"(cycled), --frontends {args.speaking_frontends}, in-process: all clips submitted at once."
    )
    text = table(noise, held, speaking, head)
    (args.out / "capacity.json").write_text(
        json.dumps({"noise": noise, "held": held, "speaking": speaking}, indent=1)
    )
    (args.out / "capacity.md").write_text(text)
    print(text)
    if args.write:
        write_section(SECTION, "scripts/bench_capacity.py", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
