"""The one percentile of every benchmark report, the load generator's included."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def percentile(values: Iterable[float], q: float) -> float | None:
    """The `q`th percentile (0..100) by linear interpolation, numpy's default; None for no values, so
    that an empty set never passes for a zero latency."""
    data = np.fromiter(values, dtype=float)
    if data.size == 0:
        return None
    return float(np.percentile(data, q))
