"""Prometheus helpers for tests: the PromQL of the dashboard and rules, promtool, a real Prometheus."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from harness.server import REPO, end_process
from service.runtime.ports import free_port

DEPLOY = REPO / "deploy"
DASHBOARD_JSON = DEPLOY / "grafana" / "asr-dashboard.json"
RULES_FILE = DEPLOY / "prometheus" / "asr-rules.yaml"
RULES_TESTS = DEPLOY / "prometheus" / "tests" / "asr-rules.test.yaml"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
ADAPTER_CONFIG = DEPLOY / "k8s" / "prometheus-adapter" / "config.yaml"

# Grafana variables as Prometheus sees them once Grafana has filled them in ("All" selected).
GRAFANA_VARS = {"$__rate_interval": "1m", "$namespace": ".*", "$pod": ".*"}


def tool(name: str) -> str:
    """Path of a command-line tool the deploy tests need; fails (never skips) when it is missing."""
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    assert path, f"{name} is not installed (see deploy/README.md, 'Checks')"
    return path


def fill_grafana_vars(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr.replace("$labels", "").replace("$value", ""), f"unfilled variable in {expr}"
    return expr


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana variables filled in) for every target of the committed dashboard."""
    dashboard = json.loads(DASHBOARD_JSON.read_text(encoding="utf-8"))
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((panel["title"], fill_grafana_vars(target["expr"])))
    return out


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES_FILE.read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"]]


def adapter_queries() -> list[tuple[str, str]]:
    """(custom metric name, metricsQuery) of each prometheus-adapter rule, filled in the way the adapter
    fills them for an HPA asking about two pods of namespace asr."""
    out = []
    for rule in yaml.safe_load(ADAPTER_CONFIG.read_text(encoding="utf-8"))["rules"]:
        series = rule["seriesQuery"].split("{")[0].strip("'\"")
        query = (
            rule["metricsQuery"]
            .replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", 'namespace="asr",pod=~"asr-server-a|asr-server-b"')
            .replace("<<.GroupBy>>", "pod")
        )
        out.append((rule["name"]["as"], query))
    return out


def promtool_check_expressions(exprs: list[str]) -> subprocess.CompletedProcess[str]:
    """`promtool check rules` on a throwaway rule file holding each expression as a recording rule."""
    doc = {
        "groups": [
            {"name": "check", "rules": [{"record": f"check_{i}", "expr": e} for i, e in enumerate(exprs)]}
        ]
    }
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(doc, f)
    try:
        return subprocess.run([tool("promtool"), "check", "rules", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)


@dataclass
class Prometheus:
    url: str

    def _get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; raises on a PromQL error (HTTP 400/422)."""
        return list(self._get("/api/v1/query", query=expr)["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/targets")["activeTargets"])

    def rule_groups(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/rules")["groups"])


@contextmanager
def run_prometheus(metrics_port: int, scrape_interval: str = "1s") -> Iterator[Prometheus]:
    """A real Prometheus on loopback scraping 127.0.0.1:`metrics_port`, configured from the committed
    deploy/prometheus/prometheus.yml (only the target, the intervals and the rule path changed)."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text(encoding="utf-8"))
    config["global"]["scrape_interval"] = scrape_interval
    config["global"]["evaluation_interval"] = scrape_interval
    config["rule_files"] = [str(RULES_FILE)]
    (job,) = config["scrape_configs"]
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{metrics_port}"]
    workdir = Path(tempfile.mkdtemp(prefix="asr-prom-"))
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    port = free_port()
    log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [
            tool("prometheus"),
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (workdir / "prometheus.log").read_text(errors="replace")
            assert time.monotonic() < deadline, "Prometheus did not become ready in 30 s"
            time.sleep(0.1)
        yield prom
    finally:
        end_process(proc, grace_s=10)
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)
