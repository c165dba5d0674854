"""Run every query of the dashboard against a Prometheus and show what each panel would draw.

    python deploy/grafana/query_panels.py --prometheus http://127.0.0.1:9090 [--namespace local] [--pod .*]

For a machine with no Grafana: it fills in the dashboard's variables the way Grafana does, asks
Prometheus's HTTP API for each target, and prints panel, legend, series count and the first value.
Exits 1 if a panel that should have data has none (GPU panels need DCGM, so they only warn).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
import urllib.request
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent / "asr-dashboard.json"


def query(prometheus: str, expr: str) -> list[dict[str, object]]:
    url = f"{prometheus.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return list(body["data"]["result"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument(
        "--namespace", default=".*", help="value of the dashboard's namespace variable (regex)"
    )
    parser.add_argument("--pod", default=".*", help="value of the dashboard's pod variable (regex)")
    parser.add_argument("--rate-interval", default="1m", help="what Grafana would put in $__rate_interval")
    args = parser.parse_args()
    values = {"$__rate_interval": args.rate_interval, "$namespace": args.namespace, "$pod": args.pod}
    missing = 0
    for panel in json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in values.items():
                expr = expr.replace(var, value)
            result = query(args.prometheus, expr)
            first = result[0]["value"][1] if result else "-"  # type: ignore[index]
            gpu = "DCGM_FI_" in expr
            mark = "ok" if result else ("no GPU" if gpu else "NO DATA")
            missing += not result and not gpu
            print(
                f"{mark:8} {panel['title'][:44]:44} {target.get('legendFormat', '')[:28]:28} {len(result):3} {first}"
            )
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
