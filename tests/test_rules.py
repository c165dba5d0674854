"""The Prometheus rules: promtool checks them, their unit tests pass and cover every alert both ways, the
Kubernetes objects that carry them say the same thing, and the gRPC codes they name are real."""

from __future__ import annotations

import re
import subprocess
import sys

import grpc
import yaml

from tests.support.prom import DEPLOY, RULES_FILE, RULES_TESTS, promtool_check_expressions, rules, tool

RULE_OBJECTS = {
    DEPLOY / "k8s" / "components" / "prometheus-operator" / "prometheusrule.yaml": "PrometheusRule",
    DEPLOY / "k8s" / "components" / "managed-prometheus" / "rules.yaml": "Rules",
}


def test_promtool_check_rules() -> None:
    out = subprocess.run(
        [tool("promtool"), "check", "rules", str(RULES_FILE)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout


def test_promtool_unit_tests_pass() -> None:
    out = subprocess.run(
        [tool("promtool"), "test", "rules", str(RULES_TESTS)],
        capture_output=True,
        text=True,
        cwd=RULES_TESTS.parent,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert len(alerts) >= 6
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(RULES_TESTS.read_text(encoding="utf-8"))["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert alerts - firing == set(), "alerts with no firing case"
    assert alerts - quiet == set(), "alerts with no not-firing case"
    assert (firing | quiet) - alerts == set(), "unit tests name alerts that do not exist"


def test_every_recording_rule_is_unit_tested() -> None:
    records = {r["record"] for r in rules() if "record" in r}
    tested = yaml.safe_load(RULES_TESTS.read_text(encoding="utf-8"))["tests"]
    exprs = " ".join(t["expr"] for case in tested for t in case.get("promql_expr_test", []))
    used_by_alerts = " ".join(r["expr"] for r in rules() if "alert" in r)
    untested = {r for r in records if r not in exprs and r not in used_by_alerts}
    assert untested == set()


def test_rule_objects_are_generated_from_the_rule_file() -> None:
    out = subprocess.run(
        [sys.executable, str(DEPLOY / "prometheus" / "gen_rule_objects.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    groups = yaml.safe_load(RULES_FILE.read_text(encoding="utf-8"))["groups"]
    for path, kind in RULE_OBJECTS.items():
        obj = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert obj["kind"] == kind
        assert obj["spec"]["groups"] == groups


def test_rule_expressions_parse() -> None:
    out = promtool_check_expressions([r["expr"] for r in rules()])
    assert out.returncode == 0, out.stdout + out.stderr


def test_status_codes_in_rules_are_the_names_the_server_exports() -> None:
    # service/runtime/interceptors.py labels grpc_code, and service/recognizer/recognizer.py asr_door_calls_total's
    # code, with the same names (grpc.StatusCode's: OK, INVALID_ARGUMENT, ...).
    names = {code.name for code in grpc.StatusCode}
    text = RULES_FILE.read_text(encoding="utf-8")
    quoted = re.findall(r'\b(?:grpc_)?code=~?"([^"]+)"', text)
    assert quoted
    for alternatives in quoted:
        for code in alternatives.split("|"):
            assert code in names, code
    assert "OK" not in "|".join(quoted), "OK must never count as an error"


def test_alerts_have_severity_and_text() -> None:
    for rule in rules():
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
            assert rule.get("for"), f"{rule['alert']} would fire on a single bad scrape"
