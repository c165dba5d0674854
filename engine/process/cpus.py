"""How many CPUs this process may really use: its affinity mask, capped by a cgroup CPU quota (a pod's
limit). The engine sizes its intra-op threads by it, the supervisor its frontends: torch's own default
counts the host's cores and knows no quota, so in a pod limited to 2 CPUs of a 64-core node it ran 32
threads that the kernel then throttled and descheduled in turn, each op waiting for its slowest thread."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def usable_cpus(cgroup: Path = CGROUP) -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (rounded up)."""
    cpus = len(os.sched_getaffinity(0))
    quota: float | None = None
    with contextlib.suppress(OSError, ValueError):
        text = (cgroup / "cpu.max").read_text().split()  # cgroup v2: "max 100000" or "200000 100000"
        if text[0] != "max":
            quota = int(text[0]) / int(text[1])
    if quota is None:
        with contextlib.suppress(OSError, ValueError):  # cgroup v1
            us = int((cgroup / "cpu/cpu.cfs_quota_us").read_text())
            period = int((cgroup / "cpu/cpu.cfs_period_us").read_text())
            if us > 0:
                quota = us / period
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return cpus
