"""What a process tree used: wall time, CPU seconds, peak memory.

CPU seconds count every thread, so they stay meaningful on a shared machine where other work
stretches wall times. A tree's CPU is its processes' that are still running plus what the ended
ones it waited for used (the kernel adds those to their parent's children times). Reading other
processes needs psutil (the dev extra); this process alone (`descendants=False`) needs nothing.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any


def machine(load_at_start: float) -> dict[str, Any]:
    """The machine a run's figures come from and how busy it was: the 1-minute load average at the
    run's start (`os.getloadavg()[0]` then) and now. A busy shared machine explains slow figures."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_1m_start_end": [round(load_at_start, 2), round(os.getloadavg()[0], 2)],
    }


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else its architecture."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if "model name" in line:
                return line.split(":", 1)[1].strip()
    return platform.machine()


def _tree(pid: int | None) -> list[Any]:
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_seconds(pid: int | None = None, *, descendants: bool = True) -> float:
    """User + system CPU seconds process `pid` (default: this one) has used so far, every thread; with
    `descendants`, those of every process below it too."""
    if pid is None and not descendants:
        return time.process_time()
    import psutil

    total = 0.0
    for proc in _tree(pid) if descendants else [psutil.Process(pid)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):  # ended while we read
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def peak_rss_bytes(pid: int | None = None, *, descendants: bool = True) -> int:
    """Peak resident memory (the kernel's VmHWM) of process `pid` (default: this one); with
    `descendants`, the sum of every live process's own peak below it too (an upper bound on the tree's
    peak: the processes need not have peaked at once). Linux only."""
    pids = [p.pid for p in _tree(pid)] if descendants else [pid or os.getpid()]
    total = 0
    for p in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # ended while we read
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024  # kB
    return total


class Stopwatch:
    """Wall time and CPU seconds of a process tree (default: this process and its descendants) from
    `start()` (or entering the `with` block) to `stop()` (or leaving it); read while running, the
    figures so far."""

    def __init__(self, pid: int | None = None, *, descendants: bool = True) -> None:
        self.pid = pid
        self.descendants = descendants
        self._wall0 = self._cpu0 = 0.0
        self._wall: float | None = None
        self._cpu: float | None = None

    def _cpu_now(self) -> float:
        return cpu_seconds(self.pid, descendants=self.descendants)

    def start(self) -> Stopwatch:
        self._wall, self._cpu = None, None
        self._cpu0, self._wall0 = self._cpu_now(), time.perf_counter()
        return self

    def stop(self) -> Stopwatch:
        self._wall = time.perf_counter() - self._wall0
        self._cpu = self._cpu_now() - self._cpu0
        return self

    @property
    def wall_s(self) -> float:
        return self._wall if self._wall is not None else time.perf_counter() - self._wall0

    @property
    def cpu_s(self) -> float:
        return self._cpu if self._cpu is not None else self._cpu_now() - self._cpu0

    def __enter__(self) -> Stopwatch:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def median_wall_s(fn: Callable[[], object], repeats: int, sync: Callable[[], object] = lambda: None) -> float:
    """Median wall seconds of `fn()` over `repeats` calls after one untimed warm-up call (allocator,
    kernel selection, oneDNN primitives); `sync` waits for queued device work (torch.cuda.synchronize)."""
    return interleaved_median_wall_s({"fn": fn}, repeats, sync)["fn"]


def interleaved_median_wall_s(
    fns: Mapping[str, Callable[[], object]], repeats: int, sync: Callable[[], object] = lambda: None
) -> dict[str, float]:
    """`median_wall_s` of several variants at once: each warmed once, then `repeats` rounds calling each
    in turn, so that a shared machine's drifting load falls on every variant alike."""
    for fn in fns.values():
        fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(x) for name, x in samples.items()}
