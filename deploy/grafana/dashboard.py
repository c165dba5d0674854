"""The asr-server Grafana dashboard, generated with grafanalib.

    python deploy/grafana/dashboard.py > deploy/grafana/asr-dashboard.json

The first row answers the operators' question at a glance: is the encoder blocking decoding, and
what does batching buy? Every query filters on the dashboard's namespace and pod variables; the
Prometheus data source is a variable too, so the same JSON works with GKE Managed Prometheus (its
Grafana data source or the frontend) and with a plain Prometheus.

tests/test_dashboard.py checks the committed JSON equals this script's output;
tests/test_metrics_prometheus.py runs every query against a real Prometheus.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from grafanalib import core as g
from grafanalib._gen import DashboardEncoder

DATASOURCE = "${datasource}"
SEL = 'namespace=~"$namespace", pod=~"$pod"'
# DCGM-Exporter (with DCGM_EXPORTER_KUBERNETES) labels each GPU's series with the namespace/pod using
# it. GMP's PodMonitoring/ClusterPodMonitoring (which GKE's managed DCGM package deploys) adds its own
# target labels namespace/pod, so the exporter's arrive renamed exported_namespace/exported_pod; a
# Prometheus scraping with honor_labels keeps them as namespace/pod. Both are queried (deploy/README.md).
DCGM_SEL = ('exported_namespace=~"$namespace", exported_pod=~"$pod"', SEL)
RATE = "$__rate_interval"
RECOGNIZER = 'grpc_service="asr.v1.Recognizer"'
# Status codes that mean the server failed the call (not the caller's bad request or hang-up).
SERVER_ERROR_CODES = "UNKNOWN|INTERNAL|UNAVAILABLE|DATA_LOSS|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED"


def quantiles(metric: str, qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
            f"p{round(q * 100)}",
        )
        for q in qs
    ]


def mean(metric: str) -> str:
    return f"sum(rate({metric}_sum{{{SEL}}}[{RATE}])) / sum(rate({metric}_count{{{SEL}}}[{RATE}]))"


def dcgm(metric: str, scale: str = "") -> str:
    return " or ".join(f"{metric}{{{sel}}}{scale}" for sel in DCGM_SEL)


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]
    unit: str = "short"
    description: str = ""
    kind: str = "timeseries"  # timeseries | heatmap | table
    width: int = 8
    extra: dict[str, object] = field(default_factory=dict)


ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Encoder and scheduler: is the encoder blocking decoding?",
        [
            Panel(
                "Scheduler-blocked fraction",
                [(f"sum by (pod) (rate(asr_scheduler_blocked_seconds_sum{{{SEL}}}[{RATE}]))", "{{pod}}")],
                unit="percentunit",
                description="Fraction of wall time in which sequences ready to decode waited on an encoder pass. "
                "Compare with encoder batching on and off.",
                extra={"valueMin": 0, "valueMax": 1},
            ),
            Panel(
                "Encoder pass time",
                quantiles("asr_encoder_seconds"),
                unit="s",
                description="Wall time of one encoder call (log-mel, encoder, cross-attention K/V), all its utterances.",
            ),
            Panel(
                "Utterances per encoder pass (mean)",
                [(mean("asr_encoder_batch_size"), "mean batch")],
                description="What micro-batching buys: above 1, several utterances share one encoder pass.",
            ),
            Panel(
                "Encoder batch size distribution",
                [(f"sum by (le) (increase(asr_encoder_batch_size_bucket{{{SEL}}}[{RATE}]))", "{{le}}")],
                kind="heatmap",
                description="Encoder passes by number of utterances (histogram buckets).",
                width=12,
            ),
            Panel(
                "Encoder busy fraction",
                [(f"sum by (pod) (rate(asr_encoder_seconds_sum{{{SEL}}}[{RATE}]))", "{{pod}}")],
                unit="percentunit",
                description="Share of wall time the encoder ran, per pod.",
                width=12,
            ),
        ],
    ),
    (
        "Decoding",
        [
            Panel(
                "Decode step time",
                quantiles("asr_decode_step_seconds"),
                unit="s",
                description="One decode step for all active sequences.",
            ),
            Panel(
                "Sequences per decode step",
                [
                    (mean("asr_decode_batch_size"), "mean"),
                    (
                        f"histogram_quantile(0.95, sum by (le) (rate(asr_decode_batch_size_bucket{{{SEL}}}[{RATE}])))",
                        "p95",
                    ),
                ],
            ),
            Panel(
                "Tokens generated",
                [(f"sum by (pod) (rate(asr_tokens_generated_total{{{SEL}}}[{RATE}]))", "{{pod}}")],
                unit="short",
                description="Decoder tokens per second.",
            ),
        ],
    ),
    (
        "Throughput and latency",
        [
            Panel(
                "Utterances by outcome",
                [(f"sum by (outcome) (rate(asr_utterances_total{{{SEL}}}[{RATE}]))", "{{outcome}}")],
                unit="reqps",
            ),
            Panel(
                "Audio seconds per second (real-time factor)",
                [
                    (f"sum(rate(asr_engine_audio_seconds_total{{{SEL}}}[{RATE}]))", "transcribed"),
                    (f"sum(rate(asr_audio_seconds_total{{{SEL}}}[{RATE}]))", "received"),
                ],
                description="Seconds of audio per second of wall time: how many real-time calls are being served.",
            ),
            Panel(
                "End of speech to final result",
                quantiles("asr_utterance_latency_seconds"),
                unit="s",
                description="From an utterance's end being detected to its final result leaving the server.",
            ),
            Panel(
                "Time to first interim result",
                quantiles("asr_time_to_first_interim_seconds", (0.5, 0.95)),
                unit="s",
                description="Streams that asked for interim results: speech start to the first partial hypothesis.",
            ),
        ],
    ),
    (
        "Queue and capacity",
        [
            Panel(
                "Queue depth and decoding sequences",
                [
                    (f"sum by (pod, class) (asr_utterances_waiting{{{SEL}}})", "waiting {{pod}} {{class}}"),
                    (f"sum by (pod) (asr_active_sequences{{{SEL}}})", "decoding {{pod}}"),
                ],
            ),
            Panel(
                "KV-cache slots",
                [
                    (f"sum by (pod) (asr_kv_slots_used{{{SEL}}})", "used {{pod}}"),
                    (f"sum by (pod) (asr_kv_slots_free{{{SEL}}})", "free {{pod}}"),
                ],
            ),
            Panel(
                "Queue wait and window wait (p95)",
                [
                    (
                        f"histogram_quantile(0.95, sum by (le, class) (rate(asr_queue_wait_seconds_bucket{{{SEL}}}[{RATE}])))",
                        "queue wait {{class}} (end of utterance to encoder pass)",
                    ),
                    (
                        f"histogram_quantile(0.95, sum by (le) (rate(asr_window_wait_seconds_bucket{{{SEL}}}[{RATE}])))",
                        "batching window open",
                    ),
                ],
                unit="s",
            ),
            Panel(
                "Active streams",
                [(f"sum by (pod) (asr_active_streams{{{SEL}}})", "{{pod}}")],
                description="Open StreamingRecognize calls.",
            ),
        ],
    ),
    (
        "Errors",
        [
            Panel(
                "Recognizer RPCs by method and gRPC code",
                [
                    (
                        f"sum by (grpc_method, grpc_code) (rate(grpc_server_handled_total{{{SEL}, {RECOGNIZER}}}[{RATE}]))",
                        "{{grpc_method}} {{grpc_code}}",
                    )
                ],
                unit="reqps",
                width=12,
            ),
            Panel(
                "Server-side error ratio",
                [
                    (
                        f'(sum(rate(grpc_server_handled_total{{{SEL}, {RECOGNIZER}, grpc_code=~"{SERVER_ERROR_CODES}"}}'
                        f"[{RATE}])) or 0 * sum(rate(grpc_server_handled_total{{{SEL}, {RECOGNIZER}}}[{RATE}])))"
                        f" / sum(rate(grpc_server_handled_total{{{SEL}, {RECOGNIZER}}}[{RATE}]))",
                        "error ratio",
                    )
                ],
                unit="percentunit",
                description=f"Calls that ended {SERVER_ERROR_CODES.replace('|', ', ')}, over all calls.",
                width=12,
            ),
        ],
    ),
    (
        "Doors: traffic and errors by protocol",
        [
            Panel(
                "Calls by door",
                [
                    (
                        f"sum by (door, kind) (rate(asr_door_calls_total{{{SEL}}}[{RATE}]))",
                        "{{door}} {{kind}}",
                    )
                ],
                unit="reqps",
                description="Streams and recordings ended per second, by the protocol they came through "
                "(asr.v1, google, riva, deepgram, openai-realtime, openai-http), refusals included.",
            ),
            Panel(
                "Open calls by door",
                [(f"sum by (door, kind) (asr_door_active_calls{{{SEL}}})", "{{door}} {{kind}}")],
                description="Streams and recordings in progress, by door.",
            ),
            Panel(
                "Calls by door and status code",
                [
                    (
                        f"sum by (door, code) (rate(asr_door_calls_total{{{SEL}}}[{RATE}]))",
                        "{{door}} {{code}}",
                    )
                ],
                unit="reqps",
                description="How each door's calls ended (google.rpc code names, whatever the door's own "
                "terms): a door whose refusals (INVALID_ARGUMENT, UNAUTHENTICATED) climb has clients "
                "speaking its protocol wrong.",
            ),
            Panel(
                "Server-side error ratio by door",
                [
                    (
                        f'(sum by (door) (rate(asr_door_calls_total{{{SEL}, code=~"{SERVER_ERROR_CODES}"}}[{RATE}]))'
                        f" or 0 * sum by (door) (rate(asr_door_calls_total{{{SEL}}}[{RATE}])))"
                        f" / sum by (door) (rate(asr_door_calls_total{{{SEL}}}[{RATE}]))",
                        "{{door}}",
                    )
                ],
                unit="percentunit",
                description=f"Calls of each door that ended {SERVER_ERROR_CODES.replace('|', ', ')}, over "
                "its calls.",
                width=24,
            ),
        ],
    ),
    (
        "GPU (DCGM exporter)",
        [
            Panel(
                "GPU utilization",
                [(dcgm("DCGM_FI_DEV_GPU_UTIL"), "{{exported_pod}}{{pod}} GPU {{gpu}}")],
                unit="percent",
                description="Coarse: the share of time any kernel ran, however little of the GPU it used.",
                width=12,
            ),
            Panel(
                "GPU graphics/compute engine active",
                [(dcgm("DCGM_FI_PROF_GR_ENGINE_ACTIVE"), "{{exported_pod}}{{pod}} GPU {{gpu}}")],
                unit="percentunit",
                description="DCGM profiling metric: fraction of cycles the graphics/compute engine was busy "
                "(0-1). Tracks GPU time better than GPU utilization.",
                extra={"valueMin": 0, "valueMax": 1},
                width=12,
            ),
            Panel(
                "GPU SM active",
                [(dcgm("DCGM_FI_PROF_SM_ACTIVE"), "{{exported_pod}}{{pod}} GPU {{gpu}}")],
                unit="percentunit",
                description="DCGM profiling metric: fraction of cycles an SM had at least one warp (0-1). Low "
                "while engine-active is high means small kernels: larger encoder batches fill the GPU better.",
                extra={"valueMin": 0, "valueMax": 1},
                width=12,
            ),
            Panel(
                "GPU memory",
                [
                    (dcgm("DCGM_FI_DEV_FB_USED", " * 1048576"), "used {{exported_pod}}{{pod}} GPU {{gpu}}"),
                    (dcgm("DCGM_FI_DEV_FB_FREE", " * 1048576"), "free {{exported_pod}}{{pod}} GPU {{gpu}}"),
                ],
                unit="bytes",
                description="Frame-buffer memory used and free (DCGM reports MiB).",
                width=12,
            ),
        ],
    ),
    (
        "Process",
        [
            # asr-server is a supervisor, one engine process and --frontends frontend processes; the
            # supervisor's /metrics has one series per process (label `process`): sum them per pod.
            Panel(
                "CPU",
                [(f"sum by (pod) (rate(process_cpu_seconds_total{{{SEL}}}[{RATE}]))", "{{pod}}")],
                description="Cores used by all the server's processes (supervisor, engine, frontends).",
            ),
            Panel(
                "Resident memory",
                [(f"sum by (pod) (process_resident_memory_bytes{{{SEL}}})", "{{pod}}")],
                unit="bytes",
                description="Resident memory of all the server's processes together (what the pod's limit "
                "bounds, apart from the page cache).",
            ),
            Panel(
                "CPU by process",
                [
                    (
                        f"sum by (pod, process) (rate(process_cpu_seconds_total{{{SEL}}}[{RATE}]))",
                        "{{pod}} {{process}}",
                    )
                ],
                description="Cores per process: an engine near one core while frontends idle points at the "
                "engine; busy frontends want a higher --frontends (and CPU request).",
                width=12,
            ),
            Panel(
                "Resident memory by process",
                [(f"sum by (pod, process) (process_resident_memory_bytes{{{SEL}}})", "{{pod}} {{process}}")],
                unit="bytes",
                description="Resident memory per process: the engine holds the model; each frontend adds its own.",
                width=12,
            ),
            Panel(
                "Model",
                [(f"asr_model_info{{{SEL}}}", "")],
                kind="table",
                description="Model, device and dtype each pod runs.",
            ),
        ],
    ),
]


def _targets(panel: Panel) -> list[g.Target]:
    fmt = {"heatmap": "heatmap", "table": "table"}.get(panel.kind, "time_series")
    return [
        g.Target(
            expr=expr,
            legendFormat=legend,
            refId=chr(ord("A") + i),
            format=fmt,
            instant=panel.kind == "table",
            datasource=DATASOURCE,
        )
        for i, (expr, legend) in enumerate(panel.targets)
    ]


def _panel(panel: Panel, pos: g.GridPos) -> g.Panel:
    common = {
        "title": panel.title,
        "description": panel.description,
        "dataSource": DATASOURCE,
        "targets": _targets(panel),
        "gridPos": pos,
    }
    if panel.kind == "heatmap":
        return g.Heatmap(
            **common,
            dataFormat="tsbuckets",
            hideZeroBuckets=True,
            yBucketBound="upper",
            legend={"show": False},
        )
    if panel.kind == "table":
        return g.Table(**common)
    return g.TimeSeries(**common, unit=panel.unit, **panel.extra)  # type: ignore[arg-type]


def _template(name: str, query: str, label: str) -> g.Template:
    return g.Template(
        name=name,
        label=label,
        query=query,
        dataSource=DATASOURCE,
        includeAll=True,
        multi=True,
        allValue=".*",
        default="$__all",
        refresh=2,
        sort=1,
    )


def build() -> g.Dashboard:
    panels: list[g.Panel] = []
    y = 0
    for row_title, row in ROWS:
        panels.append(g.RowPanel(title=row_title, gridPos=g.GridPos(h=1, w=24, x=0, y=y)))
        y += 1
        x = 0
        for panel in row:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(_panel(panel, g.GridPos(h=8, w=panel.width, x=x, y=y)))
            x += panel.width
        y += 8
    templating = g.Templating(
        list=[
            g.Template(
                name="datasource", label="Data source", query="prometheus", type="datasource", default=""
            ),
            _template("namespace", "label_values(asr_build_info, namespace)", "Namespace"),
            _template("pod", 'label_values(asr_build_info{namespace=~"$namespace"}, pod)', "Pod"),
        ]
    )
    return g.Dashboard(
        title="ASR server: encoder, scheduler, latency",
        uid="asr-server",
        description="Whisper streaming recognition: encoder time and batching, scheduler blocking, decode, "
        "latency, queue and KV slots, errors, GPU.",
        tags=["asr", "whisper", "grpc"],
        timezone="utc",
        refresh="30s",
        time=g.Time("now-1h", "now"),
        panels=panels,
        templating=templating,
    ).auto_panel_ids()


def render() -> str:
    return json.dumps(build().to_json_data(), cls=DashboardEncoder, indent=2, sort_keys=True) + "\n"


def expressions(dashboard_json: dict[str, object]) -> list[str]:
    """Every PromQL expression in a dashboard's panels (used by the tests)."""
    out = []
    for panel in dashboard_json["panels"]:  # type: ignore[attr-defined]
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append(target["expr"])
    return out


if __name__ == "__main__":
    sys.stdout.write(render())
