"""The Grafana dashboard: generated from deploy/grafana/dashboard.py, every query parses, every metric it
names is one the server registers, and the panels the operators asked for are there."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import prometheus_client

import engine.metrics  # noqa: F401 - registers the engine's metrics
import service.metrics  # noqa: F401 - registers the service's metrics
from tests.support.prom import DASHBOARD_JSON, DEPLOY, dashboard_expressions, promtool_check_expressions

REQUIRED_PANELS = {
    "Scheduler-blocked fraction": "asr_scheduler_blocked_seconds_sum",
    "Encoder pass time": "asr_encoder_seconds_bucket",
    "Encoder batch size distribution": "asr_encoder_batch_size_bucket",
    "Decode step time": "asr_decode_step_seconds_bucket",
    "Sequences per decode step": "asr_decode_batch_size",
    "Utterances by outcome": "asr_utterances_total",
    "Audio seconds per second (real-time factor)": "asr_engine_audio_seconds_total",
    "End of speech to final result": "asr_utterance_latency_seconds_bucket",
    "Queue depth and decoding sequences": "asr_utterances_waiting",
    "KV-cache slots": "asr_kv_slots_free",
    "Active streams": "asr_active_streams",
    "Recognizer RPCs by method and gRPC code": "grpc_server_handled_total",
    "Calls by door": "asr_door_calls_total",
    "Open calls by door": "asr_door_active_calls",
    "Calls by door and status code": "asr_door_calls_total",
    "Server-side error ratio by door": "asr_door_calls_total",
    "GPU utilization": "DCGM_FI_DEV_GPU_UTIL",
    "GPU memory": "DCGM_FI_DEV_FB_USED",
    "GPU graphics/compute engine active": "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "GPU SM active": "DCGM_FI_PROF_SM_ACTIVE",
    "CPU": "process_cpu_seconds_total",
    "Resident memory": "process_resident_memory_bytes",
    "CPU by process": "process_cpu_seconds_total",
    "Resident memory by process": "process_resident_memory_bytes",
}
# Names a query may use that the server does not register itself.
EXTERNAL = re.compile(r"^(DCGM_FI_\w+|process_\w+)$")
PROMQL_WORDS = {
    "sum", "by", "rate", "increase", "histogram_quantile", "or", "and", "le", "avg", "max", "min", "count",
    "namespace", "pod", "grpc_method", "grpc_code", "grpc_service", "outcome", "exported_namespace", "exported_pod",
    "process", "class", "door", "kind", "code",
}  # fmt: skip


def test_committed_json_is_what_the_generator_writes() -> None:
    out = subprocess.run(
        [sys.executable, str(DEPLOY / "grafana" / "dashboard.py")], capture_output=True, text=True, check=True
    )
    assert out.stdout == DASHBOARD_JSON.read_text(encoding="utf-8"), (
        "run: python deploy/grafana/dashboard.py > deploy/grafana/asr-dashboard.json"
    )


def test_every_query_parses() -> None:
    exprs = [e for _, e in dashboard_expressions()]
    assert len(exprs) >= 20
    out = promtool_check_expressions(exprs)
    assert out.returncode == 0, out.stdout + out.stderr


def _registered_names() -> set[str]:
    names = set()
    for metric in prometheus_client.REGISTRY.collect():
        for sample in metric.samples:
            names.add(sample.name)
        names.add(metric.name)
        names |= {metric.name + s for s in ("_bucket", "_sum", "_count", "_total")}
    return names


def test_every_metric_in_the_dashboard_is_exported_by_the_server() -> None:
    registered = _registered_names()
    for title, expr in dashboard_expressions():
        stripped = re.sub(r'"[^"]*"', "", expr)  # label values
        stripped = re.sub(r"\[[^\]]*\]", "", stripped)  # ranges
        for word in re.findall(r"[A-Za-z_][A-Za-z0-9_:]*", stripped):
            if word in PROMQL_WORDS or EXTERNAL.match(word):
                continue
            assert word in registered, f"panel {title!r} queries {word}, which the server does not export"


def test_required_panels_are_present() -> None:
    by_title: dict[str, list[str]] = {}
    for title, expr in dashboard_expressions():
        by_title.setdefault(title, []).append(expr)
    for title, metric in REQUIRED_PANELS.items():
        assert title in by_title, f"missing panel {title!r}"
        assert any(metric in e for e in by_title[title]), f"panel {title!r} does not query {metric}"
    encoder = by_title["Encoder pass time"]
    assert {q for e in encoder for q in re.findall(r"histogram_quantile\((0\.\d+)", e)} == {
        "0.5",
        "0.95",
        "0.99",
    }


def test_every_query_filters_on_namespace_and_pod_variables() -> None:
    dashboard = json.loads(DASHBOARD_JSON.read_text(encoding="utf-8"))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["namespace"]["query"].startswith("label_values(")
    assert "$namespace" in variables["pod"]["query"]
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert "$namespace" in target["expr"] and "$pod" in target["expr"], panel["title"]
            assert target["datasource"] == "${datasource}", panel["title"]


def test_panels_do_not_overlap() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in json.loads(DASHBOARD_JSON.read_text(encoding="utf-8"))["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {
            (x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & taken, f"panel {panel['title']!r} overlaps another"
        taken |= cells


def test_process_series_are_summed_per_pod() -> None:
    """The supervisor's /metrics carries process_* once per server process (label `process`): a query
    that does not sum them would draw one line per process where the panel means the pod."""
    queries = [(t, e) for t, e in dashboard_expressions() if "process_" in e]
    assert len(queries) >= 4
    for title, expr in queries:
        assert re.match(r"^sum by \(pod(, process)?\) \(", expr), (
            f"panel {title!r} does not sum per pod: {expr}"
        )
