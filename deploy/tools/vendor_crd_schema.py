"""Extract the openAPIV3Schema of a CustomResourceDefinition into deploy/tools/schemas/.

Used for the GKE Managed Prometheus CRDs (PodMonitoring, Rules), which no npm model package
covers; tests/test_deploy_manifests.py validates rendered objects against these files.

    python deploy/tools/vendor_crd_schema.py CRD.yaml SOURCE-DESCRIPTION > deploy/tools/schemas/NAME.json
"""

from __future__ import annotations

import json
import sys

import yaml


def main() -> None:
    crd_path, source = sys.argv[1], sys.argv[2]
    with open(crd_path, encoding="utf-8") as f:
        crd = yaml.safe_load(f)
    out = {}
    for version in crd["spec"]["versions"]:
        out[version["name"]] = version["schema"]["openAPIV3Schema"]
    doc = {
        "$comment": f"openAPIV3Schema of {crd['metadata']['name']} from {source} (Apache-2.0)",
        "group": crd["spec"]["group"],
        "kind": crd["spec"]["names"]["kind"],
        "versions": out,
    }
    json.dump(doc, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
