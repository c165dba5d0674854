"""Throughput and p95 latency against concurrency, for one asr-loadgen run or a comparison."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot(results: Sequence[dict[str, Any]], out: Path) -> None:
    """Throughput and p95 latency against concurrency, one line per result."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for res in results:
        lv = res["levels"]
        xs = [x["concurrency"] for x in lv]
        ax1.plot(xs, [x["utt_per_s"] for x in lv], marker="o", label=res.get("label") or "run")
        p95 = [x["latency_p95_s"] if x["latency_p95_s"] is not None else math.nan for x in lv]
        ax2.plot(xs, p95, marker="o", label=res.get("label") or "run")
    for ax, title, ylabel in (
        (ax1, "Throughput", "utterances/s"),
        (ax2, "Latency p95 (last byte -> final)", "seconds"),
    ):
        ax.set_xscale("log", base=2)
        ticks = sorted({x["concurrency"] for res in results for x in res["levels"]})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
