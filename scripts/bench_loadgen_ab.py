#!/usr/bin/env python
"""Any two servers side by side, in one run: the same loadgen sweep against A, then B (`asr-bench ab`).

    asr-bench ab [--a FLAGS] [--b FLAGS] [--a-ref REF] [--b-ref REF] [--a-label L] [--b-label L]
        [--manifest FILE | --count 40] [--concurrency 1,4,16,64] [--utterances-per-level N]
        [--out DIR] [--with-peers] [-- flags for both servers]

A and B are fresh `asr-server`s on loopback (free ports), each with its own flags (`--a`, `--b`,
one shell-quoted string each) and its own source (`--a-ref`, `--b-ref`: a git ref of this
repository, run on this interpreter's packages; default: this checkout). The defaults are the
product's first claim: encoder batching off (A, "baseline") vs on (B, "batched"). Writes:
  DIR/{A,B}.{json,md,png}   each sweep (named by the labels)
  DIR/compare.md, .png      the A/B table (concurrency, A utt/s, B utt/s, change, WER both)
  DIR/server-{A,B}.log      the servers' logs (KV-cache size at start)
With --with-peers it then runs scripts/bench_peers.py on the same manifest (DIR/peers.*) and
prints the CPU targets of B against faster-whisper int8 sequential (DIR/targets.md).

Without --manifest it speaks the default 8 kHz mu-law call-center manifest into DIR/manifest.
Anything after `--` goes to both servers unchanged (e.g. `-- --quantize int8 --kv-slots 64`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout

from clients import loadgen  # noqa: E402
from clients.loadgen.cli import concurrency_list  # noqa: E402
from clients.loadgen.plot import plot  # noqa: E402
from clients.loadgen.report import compare_table  # noqa: E402
from clients.loadgen.run import DEFAULT_CONCURRENCY  # noqa: E402
from clients.manifest import build_manifest  # noqa: E402
from harness.server import ServerProcess, checkout, split_server_args  # noqa: E402


def run_side(label: str, flags: list[str], ref: str | None, args: argparse.Namespace, manifest: Path) -> Path:
    """One side's sweep: its server (flags, source) started, measured, stopped; the sweep's JSON."""
    with contextlib.ExitStack() as stack:
        source = stack.enter_context(checkout(ref)) if ref else None
        return sweep(label, flags, source, args, manifest)


def sweep(
    label: str, flags: list[str], source: Path | None, args: argparse.Namespace, manifest: Path
) -> Path:
    log_path = args.out / f"server-{label}.log"
    with ServerProcess(
        *flags, threads=args.threads, log_format="text", log_path=log_path, source=source
    ) as server:
        print(f"== {label}: {' '.join(server.argv[1:])}", file=sys.stderr, flush=True)
        server.wait_serving(args.wait_ready)
        lg = [
            "run", "--server", server.target, "--manifest", str(manifest),
            "--concurrency", ",".join(map(str, args.concurrency)), "--metrics", server.metrics_url,
            "--out", str(args.out), "--label", label, "--chunk-ms", str(args.chunk_ms),
        ]  # fmt: skip
        if args.utterances_per_level:
            lg += ["--utterances-per-level", str(args.utterances_per_level)]
        if args.realtime:
            lg.append("--realtime")
        loadgen.main(lg)  # non-zero when some utterances failed: they are in the table
    return args.out / f"{label}.json"


def targets(batched: dict[str, Any], peers: dict[str, Any]) -> str:
    """The issue's CPU targets, from this run's figures."""
    fw = next((s for s in peers["systems"] if s["system"] == "fw-int8-seq" and "error" not in s), None)
    if fw is None:
        return "faster-whisper int8 sequential did not run: no targets to compare against.\n"
    levels = {lv["concurrency"]: lv for lv in batched["levels"]}
    rows = ["| target | ours | faster-whisper int8 seq | met |", "|---|---:|---:|---|"]
    if 16 in levels:
        lv = levels[16]
        ratio = lv["utt_per_s"] / fw["utt_per_s"]
        rows.append(
            f"| c=16 throughput >= 2x | {lv['utt_per_s']:.2f} utt/s ({ratio:.2f}x) | {fw['utt_per_s']:.2f} utt/s "
            f"| {'yes' if ratio >= 2 else 'no'} |"
        )
        if lv["wer"] is not None:
            d = 100 * (lv["wer"] - fw["wer"])
            rows.append(
                f"| c=16 WER <= +0.5 pt | {100 * lv['wer']:.1f}% ({d:+.1f} pt) | {100 * fw['wer']:.1f}% "
                f"| {'yes' if d <= 0.5 else 'no'} |"
            )
    if 1 in levels and levels[1]["latency_p50_s"] is not None:
        p50 = levels[1]["latency_p50_s"]
        rows.append(
            f"| c=1 latency <= fw s/utt | p50 {p50:.3f} s | {fw['s_per_utt']:.3f} s "
            f"| {'yes' if p50 <= fw['s_per_utt'] else 'no'} |"
        )
    if 64 in levels and levels[64]["peak_rss_bytes"]:
        rss = levels[64]["peak_rss_bytes"] / 2**30
        rows.append(f"| c=64 peak RSS < 2 GiB | {rss:.2f} GiB | - | {'yes' if rss < 2 else 'no'} |")
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv, server_args = split_server_args(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--manifest", type=Path, default=None, help="default: speak the 8 kHz manifest into OUT")
    p.add_argument("--count", type=int, default=40, help="utterances in the generated manifest")
    p.add_argument("--concurrency", type=concurrency_list, default=list(DEFAULT_CONCURRENCY))
    p.add_argument("--utterances-per-level", type=int, default=0)
    p.add_argument("--realtime", action="store_true")
    p.add_argument("--chunk-ms", type=int, default=20, help="audio per message (asr-loadgen --chunk-ms)")
    p.add_argument(
        "--wait-ready", type=float, default=300.0, help="seconds each server may take to be SERVING"
    )
    p.add_argument("--threads", type=int, default=2, help="server torch threads")
    p.add_argument(
        "--with-peers", action="store_true", help="also run scripts/bench_peers.py on the manifest"
    )
    p.add_argument("--out", type=Path, default=Path("bench-out/ab"))
    p.add_argument("--a", default="--encoder-batching off", help="server A's flags (one quoted string)")
    p.add_argument("--b", default="--encoder-batching on", help="server B's flags (one quoted string)")
    p.add_argument(
        "--a-ref", default=None, help="git ref whose service and engine A runs (default: this tree)"
    )
    p.add_argument(
        "--b-ref", default=None, help="git ref whose service and engine B runs (default: this tree)"
    )
    p.add_argument("--a-label", default="baseline")
    p.add_argument("--b-label", default="batched")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.a_label == args.b_label:
        p.error("--a-label and --b-label must differ (they name the output files)")

    manifest = args.manifest or build_manifest(args.out / "manifest", args.count, ("MULAW",))
    t0 = time.monotonic()
    sides = [
        (args.a_label, [*shlex.split(args.a), *server_args], args.a_ref),
        (args.b_label, [*shlex.split(args.b), *server_args], args.b_ref),
    ]
    base, batched = (
        json.loads(run_side(label, f, ref, args, manifest).read_text()) for label, f, ref in sides
    )
    table = compare_table(base, batched)
    described = "; ".join(
        f"{label}: `{' '.join(f) or '(defaults)'}`" + (f" at {ref}" if ref else "") for label, f, ref in sides
    )
    head = (
        f"A/B, {base['date']}, {base['machine']['platform']}, "
        f"{base['manifest_utterances']} utterances from {manifest}; {described}\n\n"
    )
    (args.out / "compare.md").write_text(head + table)
    plot([base, batched], args.out / "compare.png")
    print(f"A/B took {time.monotonic() - t0:.0f} s", file=sys.stderr)

    if args.with_peers:
        cmd = [sys.executable, str(REPO / "scripts" / "bench_peers.py"), "--manifest", str(manifest),
               "--out", str(args.out), "--label", "peers", "--threads", str(args.threads)]  # fmt: skip
        subprocess.run(cmd, check=False, env={**os.environ})
        peers = json.loads((args.out / "peers.json").read_text())
        t = targets(batched, peers)
        (args.out / "targets.md").write_text(t)
        print((args.out / "peers.md").read_text(), end="")
        print()
        print(t, end="")
        print()
    print(head + table, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
