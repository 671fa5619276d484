"""deploy/k8s, checked offline: every manifest against the Kubernetes OpenAPI schemas bundled in
`kubernetes-validate` (strict: unknown fields fail), and the wiring a schema cannot see: selectors
match pod labels, probes are gRPC health probes on declared ports (the gateway's, its /health),
Services target real ports, metrics ports are the services' defaults, the worker list handed to
the scheduler names exactly the StatefulSet's pods. Where `kustomize` or `kubectl` is installed,
the rendered output is validated as well.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml  # noqa: E402  (a test dependency: pyyaml)

from tests.helpers.environment import clear_kvfleet_env

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
K8S_VERSION = "1.30.0"  # grpc probes are GA since 1.27; validate against a widely deployed release
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
EXPECTED_KINDS = {
    ("v1", "Namespace"),
    ("v1", "Service"),
    ("v1", "PersistentVolumeClaim"),
    ("apps/v1", "Deployment"),
    ("apps/v1", "StatefulSet"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
}


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def _kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())


def _documents() -> list[dict[str, Any]]:
    docs = []
    for name in _kustomization()["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S_DIR / name).read_text()) if d is not None]
    return docs


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in _documents() if d["kind"] == kind]


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in _of_kind(kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _workloads() -> list[dict[str, Any]]:
    return [d for d in _documents() if d["kind"] in WORKLOAD_KINDS]


def _containers(workload: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from workload["spec"]["template"]["spec"]["containers"]


def _config_literals() -> dict[str, str]:
    (gen,) = [g for g in _kustomization()["configMapGenerator"] if g["name"] == "kvfleet-config"]
    return dict(lit.split("=", 1) for lit in gen["literals"])


def test_kustomization_lists_every_manifest_and_nothing_missing() -> None:
    k = _kustomization()
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    listed = set(k["resources"])
    on_disk = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, f"unlisted: {on_disk - listed}, missing: {listed - on_disk}"
    assert k["namespace"] == _one("Namespace", "kvfleet")["metadata"]["name"]
    assert [i["name"] for i in k["images"]] == ["kvfleet"]


def test_every_document_has_a_known_kind_and_a_unique_name() -> None:
    docs = _documents()
    assert {(d["apiVersion"], d["kind"]) for d in docs} == EXPECTED_KINDS
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), keys
    for d in docs:
        assert "namespace" not in d["metadata"], "the kustomization sets the namespace"


@pytest.mark.parametrize("doc", _documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_matches_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    import kubernetes_validate as kv  # a test dependency (offline schemas)

    try:
        kv.validate(doc, K8S_VERSION, strict=True)
    except kv.ValidationError as exc:
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


@pytest.mark.parametrize(
    "kind,name",
    [
        ("Deployment", "kvfleet-scheduler"),
        ("StatefulSet", "kvfleet-worker"),
        ("Deployment", "kvfleet-telemetry"),
        ("Deployment", "kvfleet-gateway"),
    ],
)
def test_selector_matches_the_pod_template_labels(kind: str, name: str) -> None:
    w = _one(kind, name)
    selector = w["spec"]["selector"]["matchLabels"]
    labels = w["spec"]["template"]["metadata"]["labels"]
    assert selector and selector.items() <= labels.items(), (selector, labels)


def test_grpc_services_have_grpc_health_probes_on_a_declared_port() -> None:
    for w in _workloads():
        if w["metadata"]["name"] == "kvfleet-gateway":
            continue
        for c in _containers(w):
            ports = {p["containerPort"] for p in c["ports"]}
            for probe in ("readinessProbe", "livenessProbe"):
                assert "grpc" in c[probe], f"{w['metadata']['name']}: {probe} must be a grpc probe"
                assert c[probe]["grpc"]["port"] in ports, (w["metadata"]["name"], probe)
            if "startupProbe" in c:
                assert c["startupProbe"]["grpc"]["port"] in ports


def test_gateway_is_ready_on_its_health_endpoint() -> None:
    (c,) = list(_containers(_one("Deployment", "kvfleet-gateway")))
    port_names = {p["name"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # not httpGet: /health is 503 while the scheduler is away, which is no reason to restart
    assert c["livenessProbe"]["tcpSocket"]["port"] in port_names


@pytest.mark.parametrize(
    "name,config",
    [
        ("kvfleet-scheduler", "scheduler_svc.config.SchedulerConfig"),
        ("kvfleet-worker", "worker_svc.config.WorkerConfig"),
    ],
)
def test_metrics_port_is_declared_annotated_and_the_service_default(name: str, config: str) -> None:
    import importlib

    module, cls = config.rsplit(".", 1)
    default = getattr(importlib.import_module(module), cls).__dataclass_fields__["metrics_port"].default
    (w,) = [w for w in _workloads() if w["metadata"]["name"] == name]
    (c,) = list(_containers(w))
    metrics = [p["containerPort"] for p in c["ports"] if p["name"] == "metrics"]
    assert metrics == [default]
    annotations = w["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(default) and annotations["prometheus.io/scrape"] == "true"


def test_containers_run_the_kustomized_image_with_a_service_entry_point() -> None:
    image = _kustomization()["images"][0]["name"]
    commands = {
        "kvfleet-scheduler": "scheduler",
        "kvfleet-worker": "worker",
        "kvfleet-telemetry": "telemetry",
        "kvfleet-gateway": "gateway",
    }
    for w in _workloads():
        (c,) = list(_containers(w))
        assert c["image"].split(":")[0] == image
        assert c["args"][0] == commands[w["metadata"]["name"]]
        assert w["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001  # the image's user


def test_services_select_a_workload_and_target_a_named_port() -> None:
    for svc in _of_kind("Service"):
        selector = svc["spec"]["selector"]
        targets = [w for w in _workloads() if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(targets) == 1, f"Service {svc['metadata']['name']} selects {len(targets)} workloads"
        port_names = {p["name"] for c in _containers(targets[0]) for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, (svc["metadata"]["name"], port)


def test_workers_are_a_statefulset_behind_a_headless_service() -> None:
    sts = _one("StatefulSet", "kvfleet-worker")
    svc = _one("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    (c,) = list(_containers(sts))
    env = {e["name"]: e for e in c["env"]}
    assert env["KVFLEET_WORKER_ID"]["value"] == "$(POD_NAME)"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_scheduler_worker_list_names_every_statefulset_pod() -> None:
    sts = _one("StatefulSet", "kvfleet-worker")
    name, svc, replicas = sts["metadata"]["name"], sts["spec"]["serviceName"], sts["spec"]["replicas"]
    (c,) = list(_containers(sts))
    port = c["ports"][0]["containerPort"]
    listed = _config_literals()["KVFLEET_WORKERS"].split(",")
    assert listed == [f"{name}-{i}.{svc}:{port}" for i in range(replicas)]


def test_env_from_config_maps_that_exist_and_telemetry_endpoint_resolves() -> None:
    generated = {g["name"] for g in _kustomization()["configMapGenerator"]}
    for w in _workloads():
        for c in _containers(w):
            for src in c.get("envFrom", []):
                assert src["configMapRef"]["name"] in generated
    endpoint = _config_literals()["OTEL_EXPORTER_OTLP_ENDPOINT"]
    tel = _one("Service", "kvfleet-telemetry")
    assert endpoint == f"http://{tel['metadata']['name']}:{tel['spec']['ports'][0]['port']}"


def test_telemetry_keeps_its_store_on_the_claim() -> None:
    dep = _one("Deployment", "kvfleet-telemetry")
    pvc = _one("PersistentVolumeClaim", "kvfleet-telemetry-data")
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    (c,) = list(_containers(dep))
    data = [m for m in c["volumeMounts"] if m["mountPath"] == "/data"]
    assert len(data) == 1
    assert volumes[data[0]["name"]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    assert "/data/telemetry.db" in c["args"]


def test_telemetry_serves_the_jaeger_query_api_on_its_service() -> None:
    """Grafana's Jaeger data source reads http://kvfleet-telemetry.kvfleet:16686: the entry point's
    --http-port default, declared on the container and exposed by the Service."""
    from telemetry_svc.http_api import JAEGER_QUERY_PORT

    (c,) = list(_containers(_one("Deployment", "kvfleet-telemetry")))
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == JAEGER_QUERY_PORT
    assert "--http-port" not in c["args"]  # the default, then
    svc_ports = {p["name"]: p for p in _one("Service", "kvfleet-telemetry")["spec"]["ports"]}
    assert svc_ports["http"]["port"] == JAEGER_QUERY_PORT and svc_ports["http"]["targetPort"] == "http"


def test_kustomize_build_renders_valid_manifests_when_kustomize_is_installed() -> None:
    """The rendered output (namespace, labels, generated ConfigMap, image) against the schemas;
    runs where `kustomize` or `kubectl` is on PATH (both work offline), skipped elsewhere."""
    import kubernetes_validate as kv  # a test dependency (offline schemas)

    cmd = _kustomize_command()
    if cmd is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    out = subprocess.run([*cmd, str(K8S_DIR)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "Namespace",
            "ConfigMap",
            "PersistentVolumeClaim",
            "Deployment",
            "Deployment",
            "Deployment",
            "StatefulSet",
            "Service",
            "Service",
            "Service",
            "Service",
            "NetworkPolicy",
            "NetworkPolicy",
        ]
    ), kinds
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    for d in docs:
        kv.validate(d, K8S_VERSION, strict=True)
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "kvfleet"
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvfleet"
        if d["kind"] in WORKLOAD_KINDS:
            (c,) = d["spec"]["template"]["spec"]["containers"]
            # the generator's hashed name is substituted, so a config change rolls the pods
            assert [e["configMapRef"]["name"] for e in c.get("envFrom", [])] in ([], [config_map["metadata"]["name"]])


def _pod_labels(kind: str, name: str) -> dict[str, str]:
    return _one(kind, name)["spec"]["template"]["metadata"]["labels"]


def _env(kind: str, name: str) -> dict[str, dict[str, Any]]:
    (c,) = list(_containers(_one(kind, name)))
    return {e["name"]: e for e in c.get("env", [])}


def test_only_the_scheduler_reaches_the_workers_grpc_port() -> None:
    """Any pod could otherwise drive a worker (run steps, read the KV of others' prompts): the
    workers have no mutual TLS here, so the network is their gate."""
    sts = _one("StatefulSet", "kvfleet-worker")
    (c,) = list(_containers(sts))
    grpc_port = {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"]
    scheduler = _pod_labels("Deployment", "kvfleet-scheduler")
    workers = sts["spec"]["template"]["metadata"]["labels"]
    policies = [
        p for p in _of_kind("NetworkPolicy") if p["spec"]["podSelector"]["matchLabels"].items() <= workers.items()
    ]
    assert len(policies) == 1, "one NetworkPolicy must select the worker pods"
    spec = policies[0]["spec"]
    assert "Ingress" in spec["policyTypes"]
    admitting_grpc = [
        rule
        for rule in spec["ingress"]
        if "ports" not in rule or any(p["port"] in ("grpc", grpc_port) for p in rule["ports"])
    ]
    assert admitting_grpc, "no rule lets the scheduler in"
    for rule in admitting_grpc:
        assert rule.get("from"), f"the worker's gRPC port is open to every source: {rule}"
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, f"only pods of this namespace, by label: {peer}"
            assert peer["podSelector"]["matchLabels"].items() <= scheduler.items(), peer
            assert peer["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == "scheduler", peer
    # whatever else is open is the metrics port only
    for rule in spec["ingress"]:
        if rule not in admitting_grpc:
            assert {p["port"] for p in rule["ports"]} == {"metrics"}, rule


def test_the_scheduler_wants_a_token_and_the_gateway_passes_callers_through(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway_svc.__main__ import parse_args
    from gateway_svc.config import AuthMode

    token = _env("Deployment", "kvfleet-scheduler")["KVFLEET_API_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token["name"] and token["key"] and not token.get("optional", False)  # no Secret, no open start
    assert "KVFLEET_API_TOKEN" not in _config_literals()
    gateway = _env("Deployment", "kvfleet-gateway")
    assert "KVFLEET_API_TOKEN" not in gateway and "KVFLEET_GATEWAY_ALLOW_ANONYMOUS" not in gateway
    for k in [k for k in os.environ if k.startswith("KVFLEET_")]:
        monkeypatch.delenv(k)
    for name, e in gateway.items():
        if name.startswith("KVFLEET_GATEWAY_"):
            monkeypatch.setenv(name, e["value"])
    config, _ = parse_args([])
    assert config.auth_mode is AuthMode.PASS_THROUGH


def test_telemetry_asks_the_scheduler_service_with_its_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trace UI's live scheduler page (README, "The trace UI"): telemetry is told the
    scheduler's Service and port, and holds the client API token the scheduler wants."""
    from telemetry_svc.__main__ import parse_args

    env = _env("Deployment", "kvfleet-telemetry")
    service = _one("Service", "kvfleet-scheduler")
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert env["KVFLEET_TELEMETRY_SCHEDULER"]["value"] == f"kvfleet-scheduler:{grpc_port}"
    scheduler_token = _env("Deployment", "kvfleet-scheduler")["KVFLEET_API_TOKEN"]["valueFrom"]
    assert env["KVFLEET_API_TOKEN"]["valueFrom"] == scheduler_token
    clear_kvfleet_env(monkeypatch)
    monkeypatch.setenv("KVFLEET_TELEMETRY_SCHEDULER", env["KVFLEET_TELEMETRY_SCHEDULER"]["value"])
    assert parse_args(["--db", "/data/telemetry.db"])[0].scheduler == f"kvfleet-scheduler:{grpc_port}"


def test_workers_and_the_scheduler_share_the_worker_secret_from_one_secret() -> None:
    """Behind the NetworkPolicy the workers still check the scheduler's secret: a policy that is
    not enforced (a CNI without NetworkPolicy support) must not leave them open."""
    refs = {
        name: _env(kind, name)["KVFLEET_WORKER_SECRET"]["valueFrom"]["secretKeyRef"]
        for kind, name in (("StatefulSet", "kvfleet-worker"), ("Deployment", "kvfleet-scheduler"))
    }
    assert refs["kvfleet-worker"] == refs["kvfleet-scheduler"] == {"name": "kvfleet-worker-secret", "key": "secret"}
    assert "KVFLEET_WORKER_SECRET" not in _config_literals()
    for kind, name in (("Deployment", "kvfleet-gateway"), ("Deployment", "kvfleet-telemetry")):
        assert "KVFLEET_WORKER_SECRET" not in _env(kind, name), name
    # the comment at the top of kustomization.yaml says how to make it
    assert (
        "create secret generic kvfleet-worker-secret --from-literal=secret="
        in (K8S_DIR / "kustomization.yaml").read_text()
    )


def test_only_kvfleets_exporters_reach_telemetrys_grpc_port() -> None:
    """Telemetry's writes decide experiments: only the scheduler, workers and gateway (its OTLP
    exporters) may reach its gRPC port from inside the cluster, and every one of them exists."""
    policy = _one("NetworkPolicy", "kvfleet-telemetry")["spec"]
    telemetry = _one("Deployment", "kvfleet-telemetry")
    assert policy["podSelector"]["matchLabels"].items() <= telemetry["spec"]["template"]["metadata"]["labels"].items()
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = [r for r in policy["ingress"] if {"port": "grpc", "protocol": "TCP"} in r["ports"]]
    assert rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    # the other rule opens the trace API (reads only) to Grafana, and nothing more
    (other,) = [r for r in policy["ingress"] if r is not rule]
    assert other["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert other["from"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "grafana"}}}
    ]
    declared = {p["name"] for c in _containers(telemetry) for p in c["ports"]}
    assert "grpc" in declared
    components = set()
    for peer in rule["from"]:
        assert set(peer) == {"podSelector"}, peer
        components.add(peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"])
        matched = [
            w
            for w in _workloads()
            if peer["podSelector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert matched, f"no workload matches {peer}"
    assert components == {"scheduler", "worker", "gateway"}
