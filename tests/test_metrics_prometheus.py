"""The metrics against a real Prometheus: the real server (bundled tiny.en, loopback) under a short
concurrent load, scraped every second by Debian's prometheus with the committed prometheus.yml and
rules. Checks what operators rely on: encoder time and batch size have data, batching on gives more
than one utterance per encoder pass and batching off exactly one, every dashboard and rule query
evaluates (and returns data unless it only can on a GPU node or when something is wrong), the HPA's
adapter queries return per-pod values, and `promtool check metrics` accepts the exposition."""

from __future__ import annotations

import asyncio
import math
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest

from clients.client import RecognizerClient
from tests.support.audio import RATE, silence, speak
from tests.support.prom import (
    Prometheus,
    adapter_queries,
    dashboard_expressions,
    rules,
    run_prometheus,
    tool,
)
from tests.support.server import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SENTENCE = "Please transfer me to the billing department today."
STREAMS = 6
# Long enough that six streams' utterances, ending within a few hundred milliseconds of one
# another on a 2-core machine, meet in one window.
WINDOW_MS = 300
# Alerts that must stay silent on a healthy server with no errors and a short queue.
QUIET_ALERTS = {
    "AsrServerDown",
    "AsrServerAbsent",
    "AsrErrorRatioHigh",
    "AsrKvSlotsExhausted",
    "AsrQueueBacklog",
}


@dataclass
class Loaded:
    server: ServerProcess
    prom: Prometheus
    exposition: str  # /metrics text read straight from the server after the load


def _utterance() -> np.ndarray:
    # Trailing silence so that the endpointer ends the utterance before the stream closes.
    return np.concatenate([silence(0.3), speak(SENTENCE), silence(1.0)])


async def _load(target: str) -> list[str]:
    """STREAMS concurrent calls of the same sentence; the first is paced in real time with interim
    results (for time-to-first-interim), the others sent as fast as the server takes them."""
    audio = _utterance()

    async def call(i: int) -> str:
        async with RecognizerClient(target) as client:
            finals = []
            async for response in client.stream_file(audio, rate=RATE, realtime=i == 0, interim=i == 0):
                finals += [
                    r.alternatives[0].transcript for r in response.results if r.is_final and r.alternatives
                ]
            return " ".join(finals)

    # One call first, scraped before the rest: a counter's first appearance carries no rate, so
    # without it the RPC counters would show the load as no traffic at all. It is the paced one with
    # interims, so the time-to-first-interim histogram exists before the load adds to it too (its panel
    # was NaN whenever its only observation came with the series' first scrape).
    first = await call(0)
    await asyncio.sleep(2.0)
    return [first, *await asyncio.gather(*(call(i) for i in range(STREAMS)))]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def _sample(exposition: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", exposition, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def _value(result: list[dict[str, object]]) -> float:
    (series,) = result
    return float(series["value"][1])  # type: ignore[index]


@contextmanager
def loaded(encoder_batching: str) -> Iterator[Loaded]:
    server = ServerProcess(
        *("--model", "tiny.en", "--device", "cpu", "--kv-slots", "8"),
        *("--encoder-batching", encoder_batching, "--batch-window-ms", str(WINDOW_MS)),
    )
    try:
        with run_prometheus(server.metrics_port, scrape_interval="1s") as prom:
            server.wait_serving(240)
            transcripts = asyncio.run(_load(server.target))
            assert all("transfer me" in t.lower() for t in transcripts), transcripts
            exposition = _scrape(server.metrics_port)
            # Wait until Prometheus has scraped the state after the load, then two more scrapes so
            # that every rate() window holds samples from after it.
            passes = _sample(exposition, "asr_encoder_batch_size_count")
            deadline = time.monotonic() + 30
            while True:
                got = prom.query('sum(asr_encoder_batch_size_count{job="asr-server"})')
                if got and _value(got) == passes:
                    break
                assert time.monotonic() < deadline, f"Prometheus never saw {passes} encoder passes: {got}"
                time.sleep(0.25)
            time.sleep(2.5)
            yield Loaded(server, prom, exposition)
    finally:
        server.stop()


def test_encoder_batching_off_means_exactly_one_utterance_per_pass() -> None:
    with loaded("off") as run:
        prom = run.prom
        mean = _value(
            prom.query(
                'sum(asr_encoder_batch_size_sum{job="asr-server"}) / sum(asr_encoder_batch_size_count{job="asr-server"})'
            )
        )
        assert mean == 1.0
        # Every pass in the le="1.0" bucket (prometheus_client writes float bounds), and at least one pass per stream.
        ones = _value(prom.query('sum(asr_encoder_batch_size_bucket{job="asr-server", le="1.0"})'))
        total = _value(prom.query('sum(asr_encoder_batch_size_count{job="asr-server"})'))
        assert ones == total >= STREAMS


@pytest.fixture(scope="module")
def batching_on() -> Iterator[Loaded]:
    with loaded("on") as run:
        yield run


def test_encoder_time_quantile_and_batch_size_histogram_have_data(batching_on: Loaded) -> None:
    prom = batching_on.prom
    p95 = _value(
        prom.query(
            'histogram_quantile(0.95, sum by (le) (rate(asr_encoder_seconds_bucket{job="asr-server"}[1m])))'
        )
    )
    assert math.isfinite(p95) and p95 > 0
    buckets = prom.query('sum by (le) (asr_encoder_batch_size_bucket{job="asr-server"})')
    counts = {s["metric"]["le"]: float(s["value"][1]) for s in buckets}
    assert counts["+Inf"] >= 2
    # Some pass carried more than one utterance: the cumulative count grows past le="1".
    assert counts["+Inf"] > counts["1.0"]


def test_encoder_batching_on_puts_more_than_one_utterance_in_a_pass(batching_on: Loaded) -> None:
    prom = batching_on.prom
    mean = _value(
        prom.query(
            'sum(asr_encoder_batch_size_sum{job="asr-server"}) / sum(asr_encoder_batch_size_count{job="asr-server"})'
        )
    )
    assert mean > 1.0
    # The same figure the dashboard's panel shows (over its rate window).
    (panel,) = [e for t, e in dashboard_expressions() if t == "Utterances per encoder pass (mean)"]
    assert _value(prom.query(panel)) > 1.0


def test_every_dashboard_query_returns_data(batching_on: Loaded) -> None:
    empty, nan = [], []
    for title, expr in dashboard_expressions():
        result = batching_on.prom.query(expr)  # raises on a PromQL error
        if "DCGM_FI_" in expr:
            continue  # GPU nodes only: evaluating without error is all a CPU machine can show
        if not result:
            empty.append(title)
        elif not any(math.isfinite(float(s["value"][1])) for s in result):
            nan.append(title)
    assert empty == [], f"panels with no data: {empty}"
    assert nan == [], f"panels with only NaN: {nan}"


def test_every_rule_expression_evaluates(batching_on: Loaded) -> None:
    prom = batching_on.prom
    for rule in rules():
        result = prom.query(rule["expr"])
        if "record" in rule:
            assert result, f"recording rule {rule['record']} has no data"
            assert any(math.isfinite(float(s["value"][1])) for s in result), rule["record"]
        elif rule["alert"] in QUIET_ALERTS:
            assert result == [], f"{rule['alert']} would fire on a healthy server: {result}"
    # Prometheus loaded the committed rule file and evaluates it without error.
    groups = {g["name"]: g for g in prom.rule_groups()}
    assert set(groups) == {"asr-server.recording", "asr-server.alerts"}
    for group in groups.values():
        for rule in group["rules"]:
            assert rule["health"] != "err", rule


def test_target_is_up_with_the_labels_the_dashboard_filters_on(batching_on: Loaded) -> None:
    (target,) = batching_on.prom.targets()
    assert target["health"] == "up", target
    assert target["labels"]["job"] == "asr-server"
    assert {"namespace", "pod"} <= target["labels"].keys()
    assert _value(batching_on.prom.query('up{job="asr-server"}')) == 1


def test_autoscaler_metrics_have_per_pod_values(batching_on: Loaded) -> None:
    for name, query in adapter_queries():
        query = query.replace('namespace="asr"', 'namespace="local"').replace(
            'pod=~"asr-server-a|asr-server-b"', 'pod="asr-server-local"'
        )
        result = batching_on.prom.query(query)
        assert [s["metric"] for s in result] == [{"pod": "asr-server-local"}], name
        assert math.isfinite(float(result[0]["value"][1])), name


def test_promtool_check_metrics_accepts_a_live_scrape(batching_on: Loaded) -> None:
    exposition = _scrape(batching_on.server.metrics_port)
    out = subprocess.run(
        [tool("promtool"), "check", "metrics"], input=exposition, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for name in (
        "asr_encoder_seconds_bucket",
        "asr_scheduler_blocked_seconds_sum",
        "grpc_server_handled_total",
    ):
        assert re.search(rf"^{name}\{{", exposition, re.M) or re.search(rf"^{name} ", exposition, re.M), name
