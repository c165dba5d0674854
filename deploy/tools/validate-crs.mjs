// Validates custom resources against the JSON schemas shipped in @kubernetes-models packages.
// Input (stdin): a JSON array of Kubernetes objects. Output (stdout): a JSON array, one entry per
// object: {kind, name, ok, error}. An object whose apiVersion/kind has no model here is reported
// with ok=null so the caller decides (it must not pass silently).
import * as gateway from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1";
import * as gkeNet from "@kubernetes-models/gke/networking.gke.io/v1";
import * as promop from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";

const models = {
  "gateway.networking.k8s.io/v1": gateway,
  "networking.gke.io/v1": gkeNet,
  "monitoring.coreos.com/v1": promop,
};

let input = "";
process.stdin.setEncoding("utf8");
for await (const chunk of process.stdin) input += chunk;

const results = JSON.parse(input).map((doc) => {
  const name = doc.metadata?.name ?? "";
  const Model = models[doc.apiVersion]?.[doc.kind];
  if (!Model) return { kind: doc.kind, apiVersion: doc.apiVersion, name, ok: null, error: "no model" };
  try {
    new Model(doc).validate();
    return { kind: doc.kind, apiVersion: doc.apiVersion, name, ok: true, error: null };
  } catch (err) {
    return { kind: doc.kind, apiVersion: doc.apiVersion, name, ok: false, error: String(err.message ?? err) };
  }
});
process.stdout.write(JSON.stringify(results) + "\n");
