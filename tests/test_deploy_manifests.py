"""deploy/k8s: every overlay renders with kustomize, validates against Kubernetes 1.33 (built-in kinds)
and the custom resources' own schemas, passes yamllint, and agrees with the server it deploys: ports,
health service name, flags, drain time, metrics port and job name."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from service.config import ServerConfig, parse_args
from service.runtime.server import SERVICE_NAME
from tests.support.prom import (
    ADAPTER_CONFIG,
    DASHBOARD_JSON,
    DEPLOY,
    RULES_FILE,
    adapter_queries,
    promtool_check_expressions,
    tool,
)

K8S = DEPLOY / "k8s"
TOOLS = DEPLOY / "tools"
OVERLAYS = ["gke-gb300", "cpu-dev"]
K8S_VERSION = "1.33"
# gke-gb300 with the Prometheus Operator component added (the ServiceMonitor/PrometheusRule path).
VARIANT = "gke-gb300+prometheus-operator"
# CRD schemas vendored from the projects that define them (deploy/tools/vendor_crd_schema.py): GMP's
# PodMonitoring/Rules, and GKE's own GCPBackendPolicy/HealthCheckPolicy (GoogleCloudPlatform/
# gke-gateway-api), checked in addition to the npm models.
GMP_SCHEMAS = {
    ("monitoring.googleapis.com/v1", "PodMonitoring"): TOOLS
    / "schemas"
    / "monitoring.googleapis.com_podmonitorings.json",
    ("monitoring.googleapis.com/v1", "Rules"): TOOLS / "schemas" / "monitoring.googleapis.com_rules.json",
    ("networking.gke.io/v1", "GCPBackendPolicy"): TOOLS
    / "schemas"
    / "networking.gke.io_gcpbackendpolicies.json",
    ("networking.gke.io/v1", "HealthCheckPolicy"): TOOLS
    / "schemas"
    / "networking.gke.io_healthcheckpolicies.json",
}
NPM_GROUPS = ("gateway.networking.k8s.io/", "networking.gke.io/", "monitoring.coreos.com/")


def _kustomize(path: Path) -> list[dict[str, Any]]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@functools.cache
def rendered(name: str) -> list[dict[str, Any]]:
    if name != VARIANT:
        return _kustomize(K8S / "overlays" / name)
    with tempfile.TemporaryDirectory() as tmp:
        rel = functools.partial(os.path.relpath, start=tmp)
        Path(tmp, "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [rel(K8S / "overlays" / "gke-gb300")],
                    "components": [rel(K8S / "components" / "prometheus-operator")],
                }
            )
        )
        return _kustomize(Path(tmp))


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(docs, "Deployment", "asr-server")["spec"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == "asr-server"]
    return c


def server_config(docs: list[dict[str, Any]]) -> ServerConfig:
    return parse_args(container(docs)["args"])


def is_custom(doc: dict[str, Any]) -> bool:
    return doc["apiVersion"].startswith(NPM_GROUPS) or (doc["apiVersion"], doc["kind"]) in GMP_SCHEMAS


ALL = [*OVERLAYS, VARIANT]


# --- rendering and schemas -------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", ALL)
def test_builtin_kinds_validate_strictly_against_kubernetes(overlay: str) -> None:
    docs = [d for d in rendered(overlay) if not is_custom(d)]
    assert {"Deployment", "Service", "PodDisruptionBudget", "ServiceAccount"} <= {d["kind"] for d in docs}
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")


@functools.cache
def _npm_ready() -> str:
    node = tool("node")
    if not (TOOLS / "node_modules" / "@kubernetes-models").is_dir():
        # The same command CI runs; reaches only the npm registry.
        subprocess.run(
            [tool("npm"), "ci", "--no-audit", "--no-fund"], cwd=TOOLS, check=True, capture_output=True
        )
    return node


def validate_with_npm_models(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = subprocess.run(
        [_npm_ready(), str(TOOLS / "validate-crs.mjs")],
        input=json.dumps(docs),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout))


@pytest.mark.parametrize("overlay", ALL)
def test_custom_resources_validate_against_their_schemas(overlay: str) -> None:
    docs = [d for d in rendered(overlay) if is_custom(d)]
    npm_docs = [d for d in docs if d["apiVersion"].startswith(NPM_GROUPS)]
    for result in validate_with_npm_models(npm_docs):
        assert result["ok"] is True, f"{result['kind']}/{result['name']}: {result['error']}"
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in GMP_SCHEMAS:
            vendored = json.loads(GMP_SCHEMAS[key].read_text(encoding="utf-8"))
            version = doc["apiVersion"].split("/")[1]
            jsonschema.validate(doc, vendored["versions"][version])
    if overlay != "cpu-dev":
        assert {
            "Gateway",
            "HTTPRoute",
            "HealthCheckPolicy",
            "GCPBackendPolicy",
            "PodMonitoring",
            "Rules",
        } <= {d["kind"] for d in docs}
    if overlay == VARIANT:
        assert {"ServiceMonitor", "PrometheusRule"} <= {d["kind"] for d in docs}
    # GKE's Gateway controller does not accept GRPCRoute: a route it ignores leaves the API unreachable.
    assert "GRPCRoute" not in {d["kind"] for d in docs}


def test_prometheus_adapter_kustomization_validates_strictly() -> None:
    docs = _kustomize(K8S / "prometheus-adapter")
    assert {"ConfigMap", "ServiceAccount", "Deployment", "Service"} <= {d["kind"] for d in docs}
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")


def test_schema_checks_can_fail() -> None:
    """The validators reject a wrong object: a probe with a string port, an HTTPRoute with a string
    backend port, a PodMonitoring endpoint with no port, a GRPC health check without its settings."""
    deployment = one(rendered("cpu-dev"), "Deployment")
    bad = json.loads(json.dumps(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    route = json.loads(json.dumps(one(rendered("gke-gb300"), "HTTPRoute", "asr")))
    route["spec"]["rules"][0]["backendRefs"][0]["port"] = "grpc"
    (result,) = validate_with_npm_models([route])
    assert result["ok"] is False
    monitoring = json.loads(json.dumps(one(rendered("gke-gb300"), "PodMonitoring")))
    del monitoring["spec"]["endpoints"][0]["port"]
    schema = json.loads(GMP_SCHEMAS[("monitoring.googleapis.com/v1", "PodMonitoring")].read_text())[
        "versions"
    ]["v1"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitoring, schema)
    health = json.loads(json.dumps(one(rendered("gke-gb300"), "HealthCheckPolicy")))
    health["spec"]["default"]["config"]["type"] = "GRPC2"
    schema = json.loads(GMP_SCHEMAS[("networking.gke.io/v1", "HealthCheckPolicy")].read_text())["versions"][
        "v1"
    ]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(health, schema)


def test_yamllint_is_clean() -> None:
    out = subprocess.run(
        [tool("yamllint"), "--strict", "-c", str(DEPLOY / ".yamllint.yaml"), "deploy"],
        capture_output=True,
        text=True,
        cwd=DEPLOY.parent,
    )
    assert out.returncode == 0, out.stdout + out.stderr


# --- consistency with the server -----------------------------------------------------------------


@functools.cache
def server_help() -> str:
    out = subprocess.run([tool("asr-server"), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_args_are_flags_the_server_accepts(overlay: str) -> None:
    args = container(rendered(overlay))["args"]
    help_text = server_help()
    for arg in args:
        assert arg.startswith("--"), arg
        flag = arg.split("=", 1)[0]
        assert re.search(rf"(^|\s){re.escape(flag)}[\s,=]", help_text), f"asr-server --help has no {flag}"
    server_config(rendered(overlay))  # parses and passes the server's own validation


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_and_health_service_match_the_server(overlay: str) -> None:
    docs = rendered(overlay)
    config = server_config(docs)
    c = container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    served = {"grpc": config.port, "metrics": config.metrics_port, "http": config.http_port}
    if config.audiosocket_port:
        served["audiosocket"] = config.audiosocket_port
    if config.siprec_port:
        served["sip-udp"] = served["sip-tcp"] = config.siprec_port
    assert ports == served
    assert config.host == "[::]"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": config.port, "service": SERVICE_NAME}, probe
    service = one(docs, "Service", "asr-server")
    svc_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert svc_ports["grpc"]["targetPort"] == "grpc" and svc_ports["grpc"]["port"] == config.port
    assert svc_ports["grpc"]["appProtocol"] in ("kubernetes.io/h2c", "grpc")
    assert svc_ports["metrics"]["targetPort"] == "metrics"
    # The HTTP door speaks HTTP/1.1: its own Service port, not the gRPC port's H2C.
    assert svc_ports["http"]["targetPort"] == "http" and svc_ports["http"]["port"] == config.http_port
    assert svc_ports["http"]["appProtocol"] == "http"
    headless = one(docs, "Service", "asr-server-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert [p["targetPort"] for p in headless["spec"]["ports"]] == ["grpc"]


def test_audiosocket_is_exposed_to_the_pbx_network_only() -> None:
    """gke-gb300 takes Asterisk's AudioSocket (TCP, no credentials) on an internal passthrough load
    balancer: the Service's port reaches the container's, its source ranges and the server's allowed
    peers name the same network, and the client's address reaches the pod (externalTrafficPolicy Local)
    so the server's own check sees Asterisk, not a node."""
    docs = rendered("gke-gb300")
    config = server_config(docs)
    assert config.audiosocket_port and config.audiosocket_host == "0.0.0.0"
    service = one(docs, "Service", "asr-telephony")
    assert service["metadata"]["annotations"]["networking.gke.io/load-balancer-type"] == "Internal"
    assert service["spec"]["type"] == "LoadBalancer" and service["spec"]["externalTrafficPolicy"] == "Local"
    (port,) = service["spec"]["ports"]
    assert (port["port"], port["targetPort"], port["protocol"]) == (
        config.audiosocket_port,
        "audiosocket",
        "TCP",
    )
    peers = {p.strip() for p in config.audiosocket_allowed_peers.split(",")}
    assert set(service["spec"]["loadBalancerSourceRanges"]) == peers
    assert not [
        d for d in rendered("cpu-dev") if d["kind"] == "Service" and d["spec"].get("type") == "LoadBalancer"
    ]


def test_siprec_signalling_on_load_balancers_and_media_to_the_pods_own_address() -> None:
    """gke-gb300 takes SIPREC: SIP on UDP and TCP through two internal passthrough load balancers (one
    protocol each) from the SBC network the server also allows; the SDP answer and Contact name the pod's
    own address (the downward API's status.podIP, expanded in the args), so ACK, BYE and RTP reach the pod
    that took the INVITE."""
    docs = rendered("gke-gb300")
    config = server_config(docs)
    assert config.siprec_port == 5060 and config.siprec_host == "0.0.0.0"
    assert config.siprec_media_address == "$(POD_IP)"
    (pod_ip,) = [e for e in container(docs)["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    peers = {p.strip() for p in config.siprec_allowed_peers.split(",")}
    for protocol in ("UDP", "TCP"):
        service = one(docs, "Service", f"asr-siprec-{protocol.lower()}")
        assert service["metadata"]["annotations"]["networking.gke.io/load-balancer-type"] == "Internal"
        assert service["spec"]["externalTrafficPolicy"] == "Local"
        (port,) = service["spec"]["ports"]
        assert (port["port"], port["protocol"]) == (config.siprec_port, protocol)
        assert port["targetPort"] == f"sip-{protocol.lower()}"
        assert set(service["spec"]["loadBalancerSourceRanges"]) == peers


def cpu_cores(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cpu_request_fits_the_frontends(overlay: str) -> None:
    """asr-server runs a supervisor, one engine process and --frontends gRPC frontends. With 0 the
    server derives the count from the CPU quota, which a pod without a CPU limit does not have (it
    would follow the node), so the manifests set it, and request a core for each process."""
    docs = rendered(overlay)
    config = server_config(docs)
    assert config.frontends >= 1, "set --frontends explicitly: a pod without a CPU limit has no quota"
    resources = container(docs)["resources"]
    assert cpu_cores(resources["requests"]["cpu"]) >= config.frontends + 2
    if "cpu" in resources.get("limits", {}):
        assert cpu_cores(resources["limits"]["cpu"]) >= cpu_cores(resources["requests"]["cpu"])


# Room for the last finals to be written and the process to exit after the drain.
EXIT_MARGIN_S = 5


def prestop_pause(docs: list[dict[str, Any]]) -> int:
    """Seconds of the container's preStop pause: Kubernetes' sleep action, so the image needs no shell."""
    pre_stop = container(docs)["lifecycle"]["preStop"]
    assert set(pre_stop) == {"sleep"}, f"preStop must be the native sleep action, not {pre_stop}"
    return int(pre_stop["sleep"]["seconds"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prestop_pause_then_drain_fit_in_the_grace_period(overlay: str) -> None:
    """The pod's termination: preStop pause (load balancers and DNS drop the pod while it still
    serves), SIGTERM, drain; all of it inside the grace period, or the kubelet kills the drain."""
    docs = rendered(overlay)
    config = server_config(docs)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    pause = prestop_pause(docs)
    # Long enough for the readiness probe (and the load balancer's health check) to have noticed.
    ready = container(docs)["readinessProbe"]
    assert pause >= ready["periodSeconds"] * ready["failureThreshold"]
    assert pod["terminationGracePeriodSeconds"] >= pause + config.drain_seconds + EXIT_MARGIN_S
    # A draining pod (health NOT_SERVING) is not restarted by its liveness probe mid-drain.
    live = container(docs)["livenessProbe"]
    assert live["failureThreshold"] * live["periodSeconds"] > config.drain_seconds


def test_load_balancer_draining_covers_the_pause_and_the_drain() -> None:
    """GKE's load balancer keeps a removed pod's streams for drainingTimeoutSec: shorter than pause +
    drain cuts streams the server is still finishing; longer than the grace period waits on a pod
    that is gone."""
    docs = rendered("gke-gb300")
    config = server_config(docs)
    grace = one(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    draining = one(docs, "GCPBackendPolicy")["spec"]["default"]["connectionDraining"]["drainingTimeoutSec"]
    assert prestop_pause(docs) + config.drain_seconds <= draining <= grace


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_match_the_pods(overlay: str) -> None:
    docs = rendered(overlay)
    deployment = one(docs, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert svc["spec"]["selector"].items() <= labels.items(), svc["metadata"]["name"]
    assert one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hardened_security_context_and_writable_paths(overlay: str) -> None:
    docs = rendered(overlay)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert pod["automountServiceAccountToken"] is False
    # Everything the server writes lives on an emptyDir: /tmp and the converted-model cache.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    cache_dir = server_config(docs).engine.cache_dir
    for path in ("/tmp", cache_dir):
        assert "emptyDir" in mounts[path], path
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"
    for var in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR"):
        assert any(env[var].startswith(path) for path in mounts if "emptyDir" in mounts[path]), var
    # The supervisor's work dir (the engine's IPC socket, the processes' metric files) comes from
    # tempfile.mkdtemp: $TMPDIR, else /tmp, which must be an emptyDir.
    tmpdir = env.get("TMPDIR") or "/tmp"
    assert any(tmpdir.startswith(path) for path in mounts if "emptyDir" in mounts[path]), tmpdir


def test_gke_gb300_runs_on_gb300_gpus() -> None:
    docs = rendered("gke-gb300")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    config = server_config(docs)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {
        "kubernetes.io/arch": "arm64",
        "cloud.google.com/gke-accelerator": "nvidia-gb300",
    }
    tolerated = {(t["key"], t.get("value")) for t in pod["tolerations"]}
    assert {("nvidia.com/gpu", None), ("kubernetes.io/arch", "arm64")} <= tolerated
    assert config.engine.device == "cuda" and config.engine.encoder_batching
    # The model comes from the read-only model volume; large-v3 gets 10 minutes to load.
    models = next(m for m in c["volumeMounts"] if m["name"] == "models")
    assert models["readOnly"] is True and config.engine.model.startswith(models["mountPath"] + "/")
    volume = next(v for v in pod["volumes"] if v["name"] == "models")
    assert volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io" and volume["csi"]["readOnly"] is True
    assert re.fullmatch(
        r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]", volume["csi"]["volumeAttributes"]["bucketName"].lower()
    )
    assert (
        one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]["gke-gcsfuse/volumes"]
        == "true"
    )
    startup = c["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 600
    assert "replicas" not in one(docs, "Deployment")["spec"], "the HPA owns the replica count"


def test_cpu_dev_needs_no_gpu_and_no_custom_resources() -> None:
    docs = rendered("cpu-dev")
    c = container(docs)
    config = server_config(docs)
    assert not any("nvidia.com/gpu" in r for r in c["resources"].values())
    assert "nodeSelector" not in one(docs, "Deployment")["spec"]["template"]["spec"]
    assert config.engine.model == "tiny.en" and config.engine.device == "cpu"
    assert not any(is_custom(d) for d in docs)


# gRPC services reachable through the load balancer: every door on the gRPC port, and health.
GRPC_ROUTED = {
    SERVICE_NAME,
    "google.cloud.speech.v1.Speech",
    "google.longrunning.Operations",
    "nvidia.riva.asr.RivaSpeechRecognition",
    "grpc.health.v1.Health",
}
# The HTTP port's doors: Deepgram's and OpenAI Realtime's WebSockets, OpenAI's file upload.
HTTP_ROUTED = {
    "/v1/listen",
    "/v1/realtime",
    "/v1/audio/transcriptions",
    "/v1/models",
    "/v1/telephony",
    "/v1/calls",
    "/api/v1/audiohook",
}


def test_gateway_routes_grpc_over_an_httproute_with_grpc_health_checks() -> None:
    docs = rendered("gke-gb300")
    config = server_config(docs)
    gateway = one(docs, "Gateway")
    route = one(docs, "HTTPRoute", "asr")
    (listener,) = gateway["spec"]["listeners"]
    assert listener["protocol"] == "HTTPS" and listener["allowedRoutes"]["kinds"] == [{"kind": "HTTPRoute"}]
    (parent,) = route["spec"]["parentRefs"]
    assert parent["name"] == gateway["metadata"]["name"] and parent["sectionName"] == listener["name"]
    (rule,) = route["spec"]["rules"]
    # A gRPC call is a POST to /<service>/<method>: one prefix per service reachable from outside.
    prefixes = {m["path"]["value"] for m in rule["matches"] if m["path"]["type"] == "PathPrefix"}
    assert prefixes == {f"/{name}/" for name in GRPC_ROUTED}
    assert not any("reflection" in p.lower() for p in prefixes), "reflection stays inside the cluster"
    (backend_ref,) = rule["backendRefs"]
    service = one(docs, "Service", backend_ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == backend_ref["port"]]
    assert port["targetPort"] == "grpc"
    # The pods serve plaintext gRPC (the kubelet's gRPC probes have no TLS): the load balancer must
    # speak HTTP/2 without TLS to them, which the Service port asks for.
    assert port["appProtocol"] == "kubernetes.io/h2c"
    assert not config.tls_cert
    health = one(docs, "HealthCheckPolicy")["spec"]
    assert health["default"]["config"]["type"] == "GRPC"
    assert health["default"]["config"]["grpcHealthCheck"]["grpcServiceName"] == SERVICE_NAME
    assert health["default"]["config"]["grpcHealthCheck"]["port"] == config.port
    assert health["targetRef"]["name"] == service["metadata"]["name"]
    backend = one(docs, "GCPBackendPolicy")["spec"]
    assert backend["targetRef"]["name"] == service["metadata"]["name"]
    assert backend["default"]["timeoutSec"] >= 3600, "a stream lasts as long as the call"


def test_gateway_routes_the_http_doors_websockets_included() -> None:
    """The HTTP port's doors go through the same listener on a second HTTPRoute, to the HTTP/1.1 port.
    GKE's Gateway claims no HTTPRoute timeouts (its conformance run exempts HTTPRouteRequestTimeout and
    HTTPRouteBackendTimeout), so a WebSocket call's length is the backend service timeout that the
    GCPBackendPolicy on the Service sets, which covers this port's backend service too, as the gRPC
    health check does."""
    docs = rendered("gke-gb300")
    config = server_config(docs)
    gateway = one(docs, "Gateway")
    (listener,) = gateway["spec"]["listeners"]
    route = one(docs, "HTTPRoute", "asr-http")
    (parent,) = route["spec"]["parentRefs"]
    assert parent["name"] == gateway["metadata"]["name"] and parent["sectionName"] == listener["name"]
    (rule,) = route["spec"]["rules"]
    assert {m["path"]["value"] for m in rule["matches"] if m["path"]["type"] == "PathPrefix"} == HTTP_ROUTED
    assert "timeouts" not in rule
    (backend_ref,) = rule["backendRefs"]
    service = one(docs, "Service", backend_ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == backend_ref["port"]]
    assert port["targetPort"] == "http" and backend_ref["port"] == config.http_port
    # HTTP/1.1 to the pods: Google's load balancers carry a WebSocket upgrade over an HTTP backend.
    assert port["appProtocol"] == "http"
    backend = one(docs, "GCPBackendPolicy")["spec"]
    assert backend["targetRef"] == {"group": "", "kind": "Service", "name": service["metadata"]["name"]}
    assert backend["default"]["timeoutSec"] >= 3600, "a WebSocket is cut at the backend service timeout"
    assert one(docs, "HealthCheckPolicy")["spec"]["targetRef"]["name"] == service["metadata"]["name"]
    # Nothing else routes these paths: one prefix, one backend.
    grpc_rule = one(docs, "HTTPRoute", "asr")["spec"]["rules"][0]
    assert not HTTP_ROUTED & {m["path"]["value"] for m in grpc_rule["matches"]}


def readme_gpu_pool() -> tuple[int, int]:
    """(nodes, GPUs per node) of the gb300 node pool that deploy/README.md tells the operator to create."""
    text = (DEPLOY / "README.md").read_text(encoding="utf-8")
    command = text[text.index("gcloud container node-pools create gb300") :]
    command = command[: command.index("\n\n")]
    nodes = re.search(r"--num-nodes=(\d+)", command)
    gpus = re.search(r"--accelerator=type=nvidia-gb300,count=(\d+)", command)
    assert nodes and gpus, command
    return int(nodes.group(1)), int(gpus.group(1))


def test_gpu_rollouts_need_no_spare_gpu_and_the_hpa_fits_the_pool() -> None:
    docs = rendered("gke-gb300")
    deployment = one(docs, "Deployment")
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    # A surge pod needs a free GPU, which a reservation-bound pool does not have: it would stay
    # Pending and the rollout would never finish. Replace one pod at a time, as the PDB allows.
    assert rolling == {"maxSurge": 0, "maxUnavailable": 1}
    assert one(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] >= rolling["maxUnavailable"]
    gpus_per_pod = int(container(docs)["resources"]["limits"]["nvidia.com/gpu"])
    nodes, gpus_per_node = readme_gpu_pool()
    hpa = one(docs, "HorizontalPodAutoscaler")["spec"]
    assert hpa["maxReplicas"] * gpus_per_pod <= nodes * gpus_per_node, (
        "replicas above the pool's GPUs stay Pending"
    )
    assert hpa["minReplicas"] < hpa["maxReplicas"]


def test_scrape_targets_match_the_metrics_port_and_the_rules_job() -> None:
    rules_text = RULES_FILE.read_text(encoding="utf-8")
    assert 'job="asr-server"' in rules_text
    docs = rendered(VARIANT)
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in container(docs)["ports"]}
    monitoring = one(docs, "PodMonitoring")
    # GMP's job label is the PodMonitoring's name; the ServiceMonitor's is the Service's name.
    assert monitoring["metadata"]["name"] == "asr-server"
    assert monitoring["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [e["port"] for e in monitoring["spec"]["endpoints"]] == ["metrics"]
    assert "metrics" in port_names
    service_monitor = one(docs, "ServiceMonitor")
    selected = [
        s
        for s in docs
        if s["kind"] == "Service"
        and service_monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    with_metrics = [s for s in selected if "metrics" in {p["name"] for p in s["spec"]["ports"]}]
    assert [s["metadata"]["name"] for s in with_metrics] == ["asr-server"], "each pod must be scraped once"
    for endpoint in service_monitor["spec"]["endpoints"]:
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"


def test_rule_objects_and_dashboard_in_the_overlays_are_the_committed_ones() -> None:
    groups = yaml.safe_load(RULES_FILE.read_text(encoding="utf-8"))["groups"]
    docs = rendered(VARIANT)
    assert one(docs, "Rules")["spec"]["groups"] == groups
    assert one(docs, "PrometheusRule")["spec"]["groups"] == groups
    dashboard = one(docs, "ConfigMap", "asr-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["asr-dashboard.json"]) == json.loads(DASHBOARD_JSON.read_text())


def test_hpa_scales_on_metrics_the_adapter_serves() -> None:
    docs = rendered("gke-gb300")
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] >= 2, "one replica would leave the PDB no room"
    served = dict(adapter_queries())
    wanted = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert wanted and set(wanted) <= served.keys()
    out = promtool_check_expressions(list(served.values()))
    assert out.returncode == 0, out.stdout + out.stderr
    adapter = _kustomize(K8S / "prometheus-adapter")
    config_map = one(adapter, "ConfigMap", "adapter-config")
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert yaml.safe_load(config_map["data"]["config.yaml"]) == yaml.safe_load(ADAPTER_CONFIG.read_text())


def test_only_the_gmp_frontend_gets_google_credentials() -> None:
    """The query frontend is the one pod that reads Cloud Monitoring: it runs as its own service
    account, so the monitoring.viewer grant (deploy/README.md) reaches no other pod."""
    adapter = _kustomize(K8S / "prometheus-adapter")
    frontend = one(adapter, "Deployment", "frontend")
    account = frontend["spec"]["template"]["spec"]["serviceAccountName"]
    assert account not in ("", "default")
    sa = one(adapter, "ServiceAccount", account)
    assert sa["metadata"]["namespace"] == frontend["metadata"]["namespace"]
    readme = (DEPLOY / "README.md").read_text(encoding="utf-8")
    member = f"subject/ns/{sa['metadata']['namespace']}/sa/{account}"
    grants = re.findall(r"--role=roles/monitoring\.viewer[^\n]*\n?[^\n]*", readme)
    assert grants and all(member in g for g in grants), grants
    assert "/sa/default" not in readme, "no grant may go to a namespace's default service account"
    # The adapter (Google's example) queries the frontend at this address.
    assert frontend["metadata"]["namespace"] == "default"
    assert one(adapter, "Service", "frontend")["spec"]["ports"][0]["port"] == 9090
