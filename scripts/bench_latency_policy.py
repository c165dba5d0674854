#!/usr/bin/env python
"""End of speech -> final under load, before and after the scheduling policy, in one run.

    python scripts/bench_latency_policy.py [--before REF] [--concurrency 16] [--utterances 32]
        [--rounds 3] [--budgets-ms 30,100] [--out DIR] [-- extra asr-server flags for every server]

On REAL speech: pocketsphinx-testdata's librivox and cards clips and ../shared/data/jfk.flac, made
telephone audio by sox (8 kHz G.711 mu-law), the manifest written to DIR/manifest. One `asr-server`
per configuration, all started on loopback (free ports) and kept up; then `--rounds` rounds, each
driving every server in turn (rotating order) with `asr-loadgen run --realtime` at one concurrency
(streams paced at the audio's own rate, as live calls). On a shared machine whose load drifts, the
rotation spreads the drift over every configuration instead of handing it to one.

  before          the code at REF (default: where this branch left main), extracted with
                  `git archive`: finals first, oldest first, no encoder budget
  after           this checkout, default flags
  after+budget B  this checkout with --encoder-budget-while-decoding-ms B (each B in --budgets-ms)

Latency is asr-loadgen's: last audio byte sent (half-close, the end of speech) -> final received,
so the endpointer's silence wait is not in it. Prints one markdown table (p50, p95, p99 over every
round's utterances, the utterances finalized, the ratio of each p95 to the before p95, the load
average as each round began) and writes DIR/latency.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout

from clients import loadgen  # noqa: E402
from harness.server import ServerProcess, checkout, merge_base, split_server_args  # noqa: E402
from harness.stats import percentile  # noqa: E402
from scripts.real_speech import build_real_manifest  # noqa: E402


@dataclass
class Server:
    label: str
    flags: list[str]
    process: ServerProcess
    latencies: list[float] = field(default_factory=list)
    utterances: int = 0
    failed: int = 0  # not OK, or OK without a final
    loads: list[float] = field(default_factory=list)  # 1-min load average as each round began


def start_server(label: str, src: Path | None, flags: list[str], args: argparse.Namespace) -> Server:
    """A server of `src`'s code (None: this checkout's), server defaults plus `flags`."""
    log = args.out / f"server-{label.replace(' ', '_')}.log"
    process = ServerProcess(
        *flags, *args.server_args, threads=None, log_format="text", source=src, log_path=log
    )
    print(f"== {label}: {' '.join(process.argv[1:])}  (code: {src or REPO})", file=sys.stderr, flush=True)
    return Server(label, flags, process)


def run_round(server: Server, round_no: int, args: argparse.Namespace, manifest: Path) -> None:
    """One loadgen level against `server`: `--utterances` streams from `--concurrency` live callers."""
    label = f"{server.label.replace(' ', '_')}-round{round_no}"
    server.loads.append(round(os.getloadavg()[0], 2))
    loadgen.main(
        [
            "run", "--server", server.process.target, "--manifest", str(manifest), "--realtime",
            "--concurrency", str(args.concurrency), "--utterances-per-level", str(args.utterances),
            "--out", str(args.out), "--label", label, "--wait-ready", "300",
            "--warmup", "1" if round_no == 0 else "0",
        ]
    )  # fmt: skip
    level = json.loads((args.out / f"{label}.json").read_text())["levels"][0]
    for sample in level["samples"]:
        server.utterances += 1
        if sample["code"] == "OK" and sample["latency_s"] is not None:
            server.latencies.append(sample["latency_s"])
        else:
            server.failed += 1


def summary(server: Server) -> dict[str, Any]:
    lat = server.latencies
    return {
        "label": server.label,
        "flags": " ".join(server.flags) or "(defaults)",
        "p50": percentile(lat, 50),
        "p95": percentile(lat, 95),
        "p99": percentile(lat, 99),
        "finalized": len(lat),
        "utterances": server.utterances,
        "loads": server.loads,
    }


def table(rows: list[dict[str, Any]], concurrency: int) -> str:
    base = rows[0]["p95"]
    out = [
        f"| configuration ({concurrency} real-time calls) | flags | p50 s | p95 s | p99 s | finalized | "
        "p95 vs before | load (1 min) at each round's start |",
        "|---|---|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        ratio = f"{r['p95'] / base:.2f}x" if base and r["p95"] else "-"
        loads = ", ".join(f"{x:.1f}" for x in r["loads"])
        out.append(
            f"| {r['label']} | `{r['flags']}` | {r['p50']:.2f} | {r['p95']:.2f} | {r['p99']:.2f} "
            f"| {r['finalized']}/{r['utterances']} | {ratio} | {loads} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    argv, server_args = split_server_args(sys.argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--before", default="", help="git ref of the 'before' code (default: merge-base with main)"
    )
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--utterances", type=int, default=32, help="utterances per configuration and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds (each drives every configuration once)")
    p.add_argument(
        "--budgets-ms", default="50", help="comma list of --encoder-budget-while-decoding-ms to try"
    )
    p.add_argument("--out", type=Path, default=Path("bench-out/latency-policy"))
    args = p.parse_args(argv)
    args.server_args = server_args
    args.out.mkdir(parents=True, exist_ok=True)
    ref = args.before or merge_base()
    manifest = build_real_manifest(args.out / "manifest")
    started = time.time()
    servers: list[Server] = []
    with checkout(ref) as before_src:
        try:
            configs: list[tuple[str, Path | None, list[str]]] = [
                (f"before ({ref[:7]})", before_src, []),
                ("after", None, []),
            ]
            for b in filter(None, args.budgets_ms.split(",")):
                configs.append((f"after+budget {b} ms", None, ["--encoder-budget-while-decoding-ms", b]))
            servers = [start_server(label, src, flags, args) for label, src, flags in configs]
            for server in servers:
                server.process.wait_serving(300)
            # Every server stays up; one is driven at a time, in an order that rotates each round, so
            # that the load of a shared machine drifting during the run falls on every configuration.
            for r in range(args.rounds):
                for i in range(len(servers)):
                    run_round(servers[(i + r) % len(servers)], r, args, manifest)
        finally:
            for server in servers:
                server.process.stop(grace_s=60)
    rows = [summary(server) for server in servers]
    md = table(rows, args.concurrency)
    note = (
        f"\nReal speech: {len(manifest.read_text().splitlines())} clips (pocketsphinx librivox + cards, jfk), "
        f"8 kHz mu-law; {args.rounds} rounds of {args.utterances} utterances per configuration, servers up "
        f"together and driven one at a time in rotating order; latency = last audio byte -> final "
        f"(asr-loadgen --realtime); wall {time.time() - started:.0f} s; CPUs {os.cpu_count()}.\n"
    )
    print(md + note, end="")
    (args.out / "latency.md").write_text(md + note)
    (args.out / "latency.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
