"""`asr-loadgen`: drive concurrent StreamingRecognize streams and report throughput, latency, WER.

    asr-loadgen make-manifest --out DIR [--telephone] [--count N]
    asr-loadgen run --server 127.0.0.1:50051 --manifest DIR/manifest.jsonl \\
        [--concurrency 1,4,16,64] [--utterances-per-level N | --duration S] [--realtime] \\
        [--chunk-ms 20] [--metrics http://127.0.0.1:9464/metrics] [--out DIR] [--label NAME]
    asr-loadgen compare BASELINE.json BATCHED.json [--out DIR]
    asr-loadgen capacity --server 127.0.0.1:50051 --metrics http://127.0.0.1:9464/metrics \\
        [--calls 128] [--chunk-ms 20] [--seconds 30] [--manifest DIR/manifest.jsonl]

One gRPC stream per utterance: config, the audio in `--chunk-ms` chunks, half-close, then
read finals until the server closes the stream. Each of the N workers runs one such stream
after another. Per-utterance streams measure the engine rather than our endpointing: the
half-close ends the utterance at a known instant (the last audio byte), so latency is exactly
"last audio byte sent -> final result received", with no VAD silence timer inside it, and a
failed utterance cannot take others down with it. Opening a stream on an established HTTP/2
connection costs well under a millisecond, so per-utterance streams do not skew throughput.

`--realtime` paces each stream at the audio's own rate (a live call); otherwise audio is sent
as fast as possible (a replay of recorded calls, the throughput test).

`capacity` holds N calls open at once, each paced in real time for `--seconds` (line noise by
default: the frontends' per-chunk work with no engine work at all; or a manifest's speech), then
half-closes them. It reports whether the server kept up (a stream's close lag, last chunk sent ->
stream closed, at p95 <= 0.5 s with no errors), the server's CPU summed over all its processes
(process_cpu_seconds_total) per second of call audio (% of a core per call) and per process, and the
IPC time per utterance (asr_ipc_seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from clients.loadgen.capacity import capacity_line, run_capacity
from clients.loadgen.plot import plot
from clients.loadgen.report import compare_table, markdown_table, write_outputs
from clients.loadgen.run import DEFAULT_CONCURRENCY, run_sweep
from clients.manifest import build_manifest


def concurrency_list(s: str) -> list[int]:
    try:
        values = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--concurrency: expected comma-separated integers, got {s!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--concurrency: every level must be at least 1, got {s!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asr-loadgen", description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("make-manifest", help="speak the default call-center sentences into DIR")
    m.add_argument("--out", required=True, type=Path, help="folder for the audio and manifest.jsonl")
    m.add_argument(
        "--telephone", action="store_true", help="list the 8 kHz mu-law files (default: 16 kHz LINEAR16)"
    )
    m.add_argument(
        "--count", type=int, default=40, help="utterances (sentences repeat with other voices past 40)"
    )

    r = sub.add_parser("run", help="sweep concurrency levels against a running server")
    r.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of the gRPC server")
    r.add_argument("--manifest", required=True, type=Path, help="manifest.jsonl (see make-manifest)")
    r.add_argument(
        "--concurrency", type=concurrency_list, default=list(DEFAULT_CONCURRENCY), help="e.g. 1,4,16,64"
    )
    g = r.add_mutually_exclusive_group()
    g.add_argument(
        "--utterances-per-level",
        type=int,
        default=0,
        help="utterances per level (default: the manifest's size, at least 3 x concurrency)",
    )
    g.add_argument("--duration", type=float, default=None, help="seconds per level instead of a count")
    r.add_argument(
        "--realtime", action="store_true", help="pace audio at its own rate (default: as fast as possible)"
    )
    r.add_argument("--chunk-ms", type=int, default=20, help="audio per message")
    r.add_argument("--metrics", default=None, help="server metrics URL, for peak RSS and per-stage costs")
    r.add_argument("--warmup", type=int, default=1, help="untimed utterances before the first level")
    r.add_argument("--token", default=None, help="bearer token, when the server requires one")
    r.add_argument(
        "--wait-ready", type=float, default=120.0, help="seconds to wait for the server to be SERVING"
    )
    r.add_argument(
        "--out", type=Path, default=Path("bench-out/loadgen"), help="folder for LABEL.json/.md/.png"
    )
    r.add_argument("--label", default="run", help="name of this run (file names, plot legend)")

    k = sub.add_parser(
        "capacity",
        help="N live calls at once (line noise or a manifest's speech, real-time): kept up? CPU per call?",
    )
    k.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of the gRPC server")
    k.add_argument(
        "--metrics", required=True, help="server metrics URL (process_cpu_seconds_total, asr_ipc_seconds)"
    )
    k.add_argument("--calls", type=int, default=128, help="calls live at once")
    k.add_argument("--chunk-ms", type=int, default=20, help="audio per message")
    k.add_argument("--seconds", type=float, default=30.0, help="audio per call")
    k.add_argument(
        "--manifest", type=Path, default=None,
        help="speech from this manifest, looped per call (default: line noise, 8 kHz mu-law)",
    )  # fmt: skip
    k.add_argument(
        "--connections", type=int, default=32,
        help="TCP connections the calls share (SO_REUSEPORT spreads connections, not calls, over frontends)",
    )  # fmt: skip
    k.add_argument(
        "--client-processes", type=int, default=1,
        help="processes the calls are split over, so that the load generator itself keeps pace",
    )  # fmt: skip
    k.add_argument("--token", default=None, help="bearer token, when the server requires one")
    k.add_argument(
        "--wait-ready", type=float, default=120.0, help="seconds to wait for the server to be SERVING"
    )
    k.add_argument("--json-out", type=Path, default=None, help="also write the report here")

    c = sub.add_parser("compare", help="table of a baseline run against a batched run")
    c.add_argument("baseline", type=Path)
    c.add_argument("batched", type=Path)
    c.add_argument("--out", type=Path, default=None, help="also write compare.md and compare.png here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "make-manifest":
        path = build_manifest(args.out, args.count, ("MULAW",) if args.telephone else ("LINEAR16",))
        print(path)
        return 0
    if args.cmd == "compare":
        base, batched = (json.loads(p.read_text()) for p in (args.baseline, args.batched))
        table = compare_table(base, batched)
        print(table, end="")
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "compare.md").write_text(table)
            plot([base, batched], args.out / "compare.png")
        return 0
    if args.cmd == "capacity":
        bad = [
            f"{flag} must be at least {low} (got {value})"
            for flag, value, low in (
                ("--calls", args.calls, 1), ("--chunk-ms", args.chunk_ms, 1), ("--seconds", args.seconds, 0.1),
                ("--connections", args.connections, 1), ("--client-processes", args.client_processes, 1),
            )
            if value < low
        ]  # fmt: skip
        if bad:
            print("asr-loadgen: " + "; ".join(bad), file=sys.stderr)
            return 2
        report = asyncio.run(run_capacity(args))
        print(json.dumps(report, indent=2))
        print(capacity_line(report), file=sys.stderr)
        if args.json_out:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps(report, indent=2) + "\n")
        return 0 if not report["errors"] else 1
    if args.utterances_per_level < 0 or (args.duration is not None and args.duration <= 0):
        print("asr-loadgen: --utterances-per-level and --duration must be positive", file=sys.stderr)
        return 2
    result = asyncio.run(run_sweep(args))
    paths = write_outputs(result, args.out, args.label)
    print(markdown_table(result), end="")
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    failed = sum(sum(lv["errors"].values()) for lv in result["levels"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
