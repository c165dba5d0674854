"""`asr-bench`: the one front door to the benchmarks (scripts/bench_*.py in a checkout).

    asr-bench                    every benchmark, with what it measures
    asr-bench NAME [ARGS...]     run one (`asr-bench NAME --help` for its options)
    asr-bench ab [ARGS...]       any two servers side by side: flag sets or git refs (scripts/bench_loadgen_ab.py)

A benchmark is a module `scripts/bench_NAME.py` with a `main()`; its first docstring line is its
description here, so a new benchmark appears without being registered. docs/benchmarks.md starts
with the current figures, each with the command that printed it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.server import REPO

SCRIPTS = REPO / "scripts"
ALIASES = {"ab": "loadgen_ab"}  # the generic A/B has a short name


def benchmarks(scripts: Path = SCRIPTS) -> dict[str, str]:
    """NAME -> the first line of its docstring, read without importing it (imports load torch)."""
    found = {}
    for path in sorted(scripts.glob("bench_*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        found[path.stem.removeprefix("bench_")] = doc.strip().split("\n")[0]
    return found


def usage(known: dict[str, str]) -> str:
    width = max(map(len, [*known, *ALIASES]))
    lines = ["usage: asr-bench NAME [ARGS...]   (asr-bench NAME --help)", "", "benchmarks:"]
    lines += [f"  {name:<{width}}  {doc}" for name, doc in known.items()]
    lines += [f"  {alias:<{width}}  = {target}" for alias, target in ALIASES.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not SCRIPTS.is_dir():
        print(f"asr-bench runs from a checkout: no {SCRIPTS}", file=sys.stderr)
        return 2
    known = benchmarks()
    if not args or args[0] in ("-h", "--help"):
        print(usage(known))
        return 0
    name = ALIASES.get(args[0], args[0])
    if name not in known:
        print(f"asr-bench: no benchmark {args[0]!r}\n\n{usage(known)}", file=sys.stderr)
        return 2
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    module = importlib.import_module(f"scripts.bench_{name}")
    # each benchmark parses sys.argv as a script would (some take argv, some read it): give it its own
    sys.argv = [f"asr-bench {args[0]}", *args[1:]]
    run = module.main
    result = run(args[1:]) if inspect.signature(run).parameters else run()
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
