"""scripts/bench_grpc_floor.py runs end to end: its bare grpc.aio server takes real-time calls and the
script prints the server's CPU per call for each message size."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_grpc_floor.py"


def test_prints_the_servers_cpu_per_call_for_each_message_size() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--calls", "4", "--seconds", "1", "--chunk-ms", "20,100"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    rows = re.findall(r"^\| 4 x (\d+) ms \| ([0-9.]+) \|$", out, re.MULTILINE)
    assert [size for size, _ in rows] == ["20", "100"], out
    assert all(float(pct) > 0 for _, pct in rows), out
