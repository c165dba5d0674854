"""A server's Prometheus exposition, parsed with prometheus_client's own parser, and what a benchmark
reads from it: one series, a sum over label sets, a breakdown by one label, the change between two
scrapes."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs
SeriesKey = tuple[str, Labels]  # (sample name, labels), e.g. ("asr_ipc_seconds_sum", ())


@dataclass(frozen=True)
class Metrics(Mapping[SeriesKey, float]):
    """Every sample of one exposition, by (sample name, labels)."""

    samples: dict[SeriesKey, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Metrics:
        out: dict[SeriesKey, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return cls(out)

    def __getitem__(self, key: SeriesKey) -> float:
        return self.samples[key]

    def __iter__(self) -> Iterator[SeriesKey]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def series(self, name: str, **labels: str) -> Iterator[tuple[dict[str, str], float]]:
        """(labels, value) of every series of sample `name` whose labels include `labels`."""
        want = labels.items()
        for (n, lab), value in self.samples.items():
            if n == name and want <= dict(lab).items():
                yield dict(lab), value

    def has(self, name: str, **labels: str) -> bool:
        return next(self.series(name, **labels), None) is not None

    def sum(self, name: str, **labels: str) -> float:
        """The sum over every series of `name` whose labels include `labels` (0 for none), e.g.
        process_cpu_seconds_total over every process of a multi-process server."""
        return sum(value for _, value in self.series(name, **labels))

    def by(self, name: str, label: str, missing: str = "") -> dict[str, float]:
        """`name` summed per value of `label` (`missing` where a series lacks it), sorted by value."""
        out: dict[str, float] = {}
        for lab, value in self.series(name):
            key = lab.get(label, missing)
            out[key] = out.get(key, 0.0) + value
        return dict(sorted(out.items()))

    def histogram(self, name: str, **labels: str) -> tuple[float, float]:
        """(count, sum) of histogram `name` over its label sets."""
        return self.sum(f"{name}_count", **labels), self.sum(f"{name}_sum", **labels)

    def since(self, before: Metrics) -> Metrics:
        """What each series gained since `before` (a series new since then counts from 0): for counters
        and histograms, whose values only grow while the process lives."""
        return Metrics({k: v - before.samples.get(k, 0.0) for k, v in self.samples.items()})

    def flat(self, *prefixes: str) -> dict[str, float]:
        """The series whose name starts with one of `prefixes` (all without), keyed `name{k=v,...}`: for
        a JSON report."""
        out = {}
        for (name, lab), value in self.samples.items():
            if not prefixes or name.startswith(prefixes):
                labels = ",".join(f"{k}={v}" for k, v in lab)
                out[f"{name}{{{labels}}}" if labels else name] = value
        return out


def scrape(url: str, timeout: float = 10.0) -> Metrics:
    """GET a /metrics URL and parse it."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return Metrics.parse(r.read().decode())
