"""deploy/k8s: every manifest validates offline, and the objects agree with each other and the image."""

from __future__ import annotations

import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

from .helpers import (
    DEFAULT_PORT, DEFAULT_SHUTDOWN_TIMEOUT, GIB, HEALTH_PATH, K8S, METRICS_PATH, PROM, ROOT,
    k8s_manifests, k8s_object, k8s_yaml_files, load_metrics, parse_quantity_bytes, yaml_docs,
)

# The oldest Kubernetes these manifests target, and the newest the validator knows.
K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
CRD_GROUPS = ("monitoring.coreos.com/",)
POD_LABELS = {"app.kubernetes.io/name": "cpuserve"}
ADAPTER_VALUES = K8S / "prometheus-adapter" / "values.yaml"
COMPONENT = K8S / "components" / "prometheus-operator"


def manifest_ids():
    return [f"{p.relative_to(K8S)}:{d['kind']}" for p, d in k8s_manifests()]


def deployment():
    return k8s_object("Deployment")


def container():
    cs = deployment()["spec"]["template"]["spec"]["containers"]
    assert len(cs) == 1
    return cs[0]


def env(name):
    found = [e for e in container().get("env", []) if e["name"] == name]
    assert len(found) == 1, f"want one env {name}"
    return found[0]


def test_every_yaml_parses():
    files = k8s_yaml_files()
    assert files
    for path in files:
        docs = yaml_docs(path)
        assert docs, f"{path} is empty"
        for d in docs:
            assert isinstance(d, dict), path


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path,doc", list(k8s_manifests()), ids=manifest_ids())
def test_manifest_validates(path, doc, version):
    assert doc["metadata"].get("name"), f"{path}: metadata.name"
    if doc["apiVersion"].startswith(CRD_GROUPS):
        with pytest.raises(SchemaNotFoundError):
            kubernetes_validate.validate(doc, version, strict=True)
        pytest.skip(f"{doc['kind']} is a CRD ({doc['apiVersion']}): kubernetes-validate has no schema "
                    "for it offline; test_crd_required_fields checks its required fields")
    kubernetes_validate.validate(doc, version, strict=True)


def test_crd_required_fields():
    sm = k8s_object("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    svc = k8s_object("Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items(), \
        "the ServiceMonitor must select the Service"
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    assert sm["spec"]["endpoints"], "ServiceMonitor.spec.endpoints"
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in port_names
        assert ep.get("path", "/metrics") == METRICS_PATH
        assert re.fullmatch(r"\d+[smh]", ep.get("interval", "30s"))

    pr = k8s_object("PrometheusRule")
    assert pr["apiVersion"] == "monitoring.coreos.com/v1"
    groups = pr["spec"]["groups"]
    for g in groups:
        assert g["name"] and g["rules"]
        for r in g["rules"]:
            assert r.get("alert") or r.get("record")
            assert r["expr"]


def test_prometheusrule_equals_alerts_yml():
    alerts = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    assert k8s_object("PrometheusRule")["spec"]["groups"] == alerts, \
        "deploy/k8s/components/prometheus-operator/prometheusrule.yaml must carry alerts.yml's groups"


def referenced_files(kustomization_dir):
    k = yaml_docs(kustomization_dir / "kustomization.yaml")[0]
    return k, [kustomization_dir / r for r in k.get("resources", [])]


def test_kustomization_references_every_manifest():
    k, resources = referenced_files(K8S)
    assert k["kind"] == "Kustomization"
    comp, comp_resources = referenced_files(COMPONENT)
    assert comp["kind"] == "Component"
    listed = resources + comp_resources
    for path in listed:
        assert path.is_file(), f"kustomization lists missing {path}"
    manifest_files = {p for p, _ in k8s_manifests()}
    assert manifest_files == set(listed), \
        f"not in a kustomization: {sorted(map(str, manifest_files - set(listed)))}"
    text = (K8S / "kustomization.yaml").read_text()
    assert "components/prometheus-operator" in text, "the component is offered (commented) in kustomization.yaml"


KUSTOMIZE = shutil.which("kustomize")
KUBECTL = shutil.which("kubectl")


def kustomize_build(path):
    cmd = [KUSTOMIZE, "build", str(path)] if KUSTOMIZE else [KUBECTL, "kustomize", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.skipif(not (KUSTOMIZE or KUBECTL), reason="neither kustomize nor kubectl on PATH")
def test_kustomize_build(tmp_path):
    docs = kustomize_build(K8S)
    assert sorted(d["kind"] for d in docs) == ["Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service"]
    # with the Prometheus Operator component switched on
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    k = yaml.safe_load((copy / "kustomization.yaml").read_text())
    k["components"] = ["components/prometheus-operator"]
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(k))
    kinds = sorted(d["kind"] for d in kustomize_build(copy))
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "PrometheusRule",
                     "Service", "ServiceMonitor"]


def test_pod_labels_and_selectors():
    d = deployment()
    assert d["spec"]["selector"]["matchLabels"] == POD_LABELS
    pod_labels = d["spec"]["template"]["metadata"]["labels"]
    assert POD_LABELS.items() <= pod_labels.items()
    for kind in ("Service", "PodDisruptionBudget"):
        obj = k8s_object(kind)
        sel = obj["spec"]["selector"]
        sel = sel.get("matchLabels", sel) if kind != "Service" else sel
        assert sel.items() <= pod_labels.items(), f"{kind} selector does not match the pods"


def test_ports():
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": DEFAULT_PORT}
    svc = k8s_object("Service")["spec"]["ports"]
    assert len(svc) == 1 and svc[0]["port"] == DEFAULT_PORT and svc[0]["targetPort"] in ("http", DEFAULT_PORT)
    ann = deployment()["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == str(DEFAULT_PORT)
    assert ann["prometheus.io/path"] == METRICS_PATH


def test_probes_hit_health():
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == HEALTH_PATH, probe
        assert ports.get(get["port"], get["port"]) == DEFAULT_PORT, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, "model load needs time before liveness"


def test_memory_limit_fits_kv_cache():
    kv_gb = float(env("CPUSERVE_KV_CACHE_GB")["value"])
    res = container()["resources"]
    limit = parse_quantity_bytes(res["limits"]["memory"])
    request = parse_quantity_bytes(res["requests"]["memory"])
    headroom = limit - kv_gb * GIB
    assert 1 * GIB <= headroom <= 2 * GIB, f"memory limit should be KV cache + ~1.5 GiB, headroom {headroom / GIB:.2f} GiB"
    assert request <= limit
    assert res["limits"]["cpu"] == res["requests"]["cpu"], "whole, guaranteed CPUs for the model threads"


def test_threads_follow_cpu_limit():
    for name in ("OMP_NUM_THREADS", "CPUSERVE_THREADS"):
        ref = env(name)["valueFrom"]["resourceFieldRef"]
        assert ref["resource"] == "limits.cpu", name
        assert ref.get("containerName") in (None, container()["name"])
        assert str(ref.get("divisor", "1")) == "1"


def test_graceful_shutdown():
    spec = deployment()["spec"]["template"]["spec"]
    timeout = int(env("CPUSERVE_SHUTDOWN_TIMEOUT")["value"]) if any(
        e["name"] == "CPUSERVE_SHUTDOWN_TIMEOUT" for e in container().get("env", [])) else DEFAULT_SHUTDOWN_TIMEOUT
    pre_stop = container().get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    sleep = int(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0
    assert spec["terminationGracePeriodSeconds"] > timeout + sleep


def test_security_context():
    spec = deployment()["spec"]["template"]["spec"]
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
    assert pod["seccompProfile"]["type"] == "RuntimeDefault"
    sc = container()["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert spec.get("automountServiceAccountToken") is False


def test_api_key_secret_optional():
    ref = env("CPUSERVE_API_KEY")["valueFrom"]["secretKeyRef"]
    assert ref["optional"] is True, "the Deployment must start without the Secret"


def test_hpa_scales_on_waiting_requests_via_adapter():
    hpa = k8s_object("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "cpuserve"}
    assert hpa["spec"]["minReplicas"] >= 2
    pdb = k8s_object("PodDisruptionBudget")
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["minAvailable"], "a drain must be able to evict a pod"
    assert deployment()["spec"]["replicas"] >= hpa["spec"]["minReplicas"]
    metrics = hpa["spec"]["metrics"]
    assert len(metrics) == 1 and metrics[0]["type"] == "Pods"
    hpa_metric = metrics[0]["pods"]["metric"]["name"]

    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    rules = values["rules"]["custom"]
    served = {}
    for rule in rules:
        series = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)", rule["seriesQuery"]).group(1)
        assert series in load_metrics(), f"adapter rule on unknown metric {series}"
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
        as_name = re.sub(r"\$\{(\d+)\}", r"\\\1", rule["name"]["as"])
        served[re.sub(rule["name"]["matches"], as_name, series)] = series
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
    assert served.get(hpa_metric) == "cpuserve:num_requests_waiting", \
        f"HPA metric {hpa_metric} is not what the adapter serves: {served}"


def test_image_matches_kustomize_images():
    k = yaml_docs(K8S / "kustomization.yaml")[0]
    names = {i["name"] for i in k.get("images", [])}
    assert container()["image"].split(":")[0] in names


def test_dockerfile_exists_for_image():
    assert (ROOT / "Dockerfile").is_file()
