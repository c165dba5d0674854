"""The benchmark harness (harness/): its percentile, its reading of a Prometheus exposition, what it
measures of a process tree, how it ends a process, and that a server of another source tree runs that
tree's code. Real processes and prometheus_client's own exposition throughout; no model is loaded."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from asr.v1 import asr_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from harness.live import PacedCall
from harness.metrics import Metrics
from harness.server import ServerProcess, end_process, source_tree, split_server_args
from harness.stats import percentile
from harness.usage import Stopwatch, cpu_seconds, peak_rss_bytes


def test_percentile_is_numpys_linear_one_and_none_for_nothing() -> None:
    values = [0.9, 0.1, 0.5, 2.0, 0.3]
    for q in (0, 50, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile(iter(values), 50) == 0.5  # any iterable, read once
    assert percentile([], 95) is None


def exposition() -> Metrics:
    registry = CollectorRegistry()
    cpu = Counter("process_cpu_seconds", "cpu", ["process"], registry=registry)
    ipc = Histogram("asr_ipc_seconds", "ipc", registry=registry)
    Gauge("asr_active_streams", "streams", registry=registry).set(3)
    cpu.labels("engine").inc(5)
    cpu.labels("frontend-0").inc(2)
    cpu.labels("frontend-1").inc(1)
    for x in (0.01, 0.02, 0.03):
        ipc.observe(x)
    return Metrics.parse(generate_latest(registry).decode())


def test_metrics_sums_breaks_down_and_subtracts_a_real_exposition() -> None:
    before = exposition()
    assert before.sum("process_cpu_seconds_total") == 8
    assert before.sum("process_cpu_seconds_total", process="frontend-0") == 2
    assert before.by("process_cpu_seconds_total", "process") == {
        "engine": 5,
        "frontend-0": 2,
        "frontend-1": 1,
    }
    count, total = before.histogram("asr_ipc_seconds")
    assert count == 3 and total == pytest.approx(0.06)
    assert before[("asr_active_streams", ())] == 3
    assert before.has("asr_active_streams") and not before.has("asr_active_streams", process="engine")
    assert before.sum("no_such_metric") == 0 and not before.has("no_such_metric")
    assert before.flat("process_cpu")["process_cpu_seconds_total{process=engine}"] == 5

    registry = CollectorRegistry()
    later = Counter("process_cpu_seconds", "cpu", ["process"], registry=registry)
    later.labels("engine").inc(7)
    later.labels("frontend-2").inc(4)
    gained = Metrics.parse(generate_latest(registry).decode()).since(before)
    # engine went 5 -> 7; frontend-2, absent before, counts from zero; the others are gone
    assert gained.by("process_cpu_seconds_total", "process") == {"engine": 2, "frontend-2": 4}


BURN = textwrap.dedent(
    """
    import sys, time
    keep = bytearray(int(sys.argv[1]))  # touched below: resident, not just reserved
    for i in range(0, len(keep), 4096):
        keep[i] = 1
    while time.process_time() < float(sys.argv[2]):
        pass
    print("ready", flush=True)
    time.sleep(600)
    """
)


@contextmanager
def child(resident_bytes: int, cpu_s: float) -> Iterator[subprocess.Popen[str]]:
    """A child process that holds `resident_bytes` and has used `cpu_s` CPU seconds, then waits."""
    proc = subprocess.Popen(
        [sys.executable, "-c", BURN, str(resident_bytes), str(cpu_s)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_stopwatch_counts_the_cpu_of_live_descendants() -> None:
    tree, alone = Stopwatch().start(), Stopwatch(descendants=False).start()
    with child(0, 0.6) as proc:  # the kernel counts in clock ticks: 0.6 s reads as 0.59 or so
        assert tree.cpu_s >= 0.5  # the child's, still running
        assert cpu_seconds(proc.pid) >= 0.5
    assert alone.stop().cpu_s < 0.5  # this process only waited
    assert tree.stop().wall_s >= alone.wall_s > 0


def test_peak_rss_of_a_tree_includes_its_children() -> None:
    own = peak_rss_bytes(descendants=False)
    with child(256 << 20, 0.0):
        assert peak_rss_bytes() >= own + (256 << 20)
        assert peak_rss_bytes(descendants=False) < own + (256 << 20)


def test_end_process_terminates_then_kills_what_ignores_sigterm() -> None:
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    assert end_process(polite, grace_s=30) == -signal.SIGTERM
    stubborn = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print('ready', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert stubborn.stdout is not None and stubborn.stdout.readline() == "ready\n"
    assert end_process(stubborn, grace_s=0.5) == -signal.SIGKILL


def test_server_flags_follow_the_double_dash() -> None:
    assert split_server_args(["--count", "2", "--", "--quantize", "off", "--"]) == (
        ["--count", "2"],
        ["--quantize", "off", "--"],
    )
    assert split_server_args(["--count", "2"]) == (["--count", "2"], [])


def test_a_server_of_another_tree_runs_that_trees_code(tmp_path: Path) -> None:
    """A before/after benchmark compares nothing if the "before" server runs this checkout's code: the
    tree's supervisor here exits at once with a mark, so only that tree's code can explain the log."""
    tree = source_tree("HEAD", tmp_path / "src", ["service"])
    (tree / "service" / "runtime" / "supervisor.py").write_text(
        "import sys\nprint('supervisor of the extracted tree', file=sys.stderr)\nsys.exit(3)\n"
    )
    server = ServerProcess(source=tree)
    try:
        with pytest.raises(RuntimeError, match="exited with 3") as failed:
            server.wait_serving(120)
        assert "supervisor of the extracted tree" in str(failed.value)
    finally:
        server.stop()


def test_a_paced_call_sends_each_frame_once_its_audio_was_spoken() -> None:
    config = asr_pb2.StreamingRecognitionConfig(config=asr_pb2.RecognitionConfig(encoding=asr_pb2.MULAW))
    paced = PacedCall(config, bytes(250), frame_bytes=100, frame_s=0.05)

    async def sent() -> list[tuple[float, asr_pb2.StreamingRecognizeRequest]]:
        return [(time.monotonic(), r) async for r in paced.requests()]

    requests = asyncio.run(sent())
    assert requests[0][1].streaming_config == config
    frames = requests[1:]
    assert [len(r.audio_content) for _, r in frames] == [100, 100, 50]
    for k, (at, _) in enumerate(frames):
        assert at >= paced.started_at + (k + 1) * 0.05  # never before its audio ended
    assert paced.latency_s(0.1, received_at=paced.started_at + 0.4) == pytest.approx(0.3)
