"""deploy/k8s: every manifest validates offline, and the objects agree with each other and the image."""

from __future__ import annotations

import functools
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

from .helpers import (
    ALL_COMPONENTS, COMPONENTS, COMPONENTS_DIR, CRD_DIR, DEFAULT_PORT, DEFAULT_SHUTDOWN_TIMEOUT, GIB, HEALTH_PATH,
    K8S, METRICS_PATH, PROM, ROOT, k8s_manifests, kustomize_build, k8s_object, k8s_yaml_files, load_metrics, parse_quantity_bytes,
    render, render_sets, yaml_docs,
)

# The oldest Kubernetes these manifests target, and the newest the validator knows.
K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
# Custom resources with no schema to be had offline: their required fields are checked by hand.
UNSCHEMED_GROUPS = ("monitoring.coreos.com/",)
POD_LABELS = {"app.kubernetes.io/name": "cpuserve"}
ADAPTER_VALUES = COMPONENTS_DIR / "hpa" / "prometheus-adapter" / "values.yaml"
COMPONENT = COMPONENTS_DIR / "prometheus-operator"


def manifest_ids():
    return [f"{rid}:{d['kind']}/{d['metadata']['name']}" for rid, d in k8s_manifests()]


@functools.lru_cache(maxsize=None)
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema, from the CRDs vendored in tests/deploy/crds."""
    out = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for crd in yaml_docs(path):
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for v in crd["spec"]["versions"]:
                if v.get("served", True):
                    out[(f"{group}/{v['name']}", kind)] = v["schema"]["openAPIV3Schema"]
    return out


def strict(schema: dict) -> dict:
    """The schema with unknown fields refused where the API server would prune or refuse them
    (kubectl's strict field validation): objects with properties and no preserve-unknown flag."""
    if not isinstance(schema, dict):
        return schema
    out = {k: (strict(v) if isinstance(v, dict) else [strict(x) for x in v] if isinstance(v, list) else v)
           for k, v in schema.items() if k != "properties"}
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


def validate_custom_resource(doc: dict) -> None:
    schema = crd_schemas()[(doc["apiVersion"], doc["kind"])]
    body = dict(doc)
    # metadata is validated by the API server's ObjectMeta, not the CRD schema
    meta = body.pop("metadata")
    assert meta.get("name")
    jsonschema.validate(body, strict({**schema, "properties": {
        k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}}))


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
@pytest.mark.parametrize("rid,doc", list(k8s_manifests()), ids=manifest_ids())
def test_manifest_validates(rid, doc, version):
    """Every object of the base, of the base with each component and with all of them."""
    assert doc["metadata"].get("name"), f"{rid}: metadata.name"
    if (doc["apiVersion"], doc["kind"]) in crd_schemas():
        with pytest.raises(SchemaNotFoundError):
            kubernetes_validate.validate(doc, version, strict=True)
        validate_custom_resource(doc)  # the vendored CRD's schema (GIE v1.5.0, Gateway API v1.5.1)
        return
    if doc["apiVersion"].startswith(UNSCHEMED_GROUPS):
        with pytest.raises(SchemaNotFoundError):
            kubernetes_validate.validate(doc, version, strict=True)
        pytest.skip(f"{doc['kind']} is a CRD ({doc['apiVersion']}): no schema for it offline; "
                    "test_crd_required_fields checks its required fields")
    kubernetes_validate.validate(doc, version, strict=True)


def test_crd_validation_refuses_bad_objects():
    """The CRD check is not a pass-through: a wrong type, a missing required field and an
    unknown field each fail."""
    pool = k8s_object("InferencePool")
    validate_custom_resource(pool)
    bad_port = yaml.safe_load(yaml.safe_dump(pool))
    bad_port["spec"]["targetPorts"][0]["number"] = "8000"
    no_picker = yaml.safe_load(yaml.safe_dump(pool))
    del no_picker["spec"]["endpointPickerRef"]
    unknown = yaml.safe_load(yaml.safe_dump(pool))
    unknown["spec"]["extensionRef"] = {"name": "x"}  # the v1alpha2 field name, gone in v1
    for doc in (bad_port, no_picker, unknown):
        with pytest.raises(jsonschema.ValidationError):
            validate_custom_resource(doc)


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


def test_every_object_file_is_used():
    """Each YAML file under deploy/k8s is a kustomization or is listed by one."""
    listed = set()
    for path in K8S.rglob("kustomization.yaml"):
        k = yaml_docs(path)[0]
        assert k["kind"] in ("Kustomization", "Component"), path
        for entry in k.get("resources", []) + [p["path"] for p in k.get("patches", []) if "path" in p]:
            listed.add((path.parent / entry).resolve())
        for gen in k.get("configMapGenerator", []) + k.get("secretGenerator", []):
            listed.update((path.parent / f.split("=")[-1]).resolve() for f in gen.get("files", []))
    unused = [str(p.relative_to(K8S)) for p in k8s_yaml_files()
              if p.name != "kustomization.yaml" and p.resolve() not in listed and "prometheus-adapter" not in p.parts]
    assert not unused, f"not referenced by any kustomization: {unused}"
    text = (K8S / "kustomization.yaml").read_text()
    for c in COMPONENTS:
        assert f"components/{c}" in text, f"{c} is offered (commented) in deploy/k8s/kustomization.yaml"


def kinds(components=()):
    return sorted((d["kind"], d["metadata"]["name"]) for d in render(tuple(components)))


def test_base_renders_without_cluster_extensions():
    """`kubectl apply -k deploy/k8s` works on a bare cluster: no CRD, no custom metrics API."""
    assert kinds() == [("Deployment", "cpuserve"), ("PodDisruptionBudget", "cpuserve"), ("Service", "cpuserve")]
    top = [(d["kind"], d["metadata"]["name"]) for d in kustomize_build(K8S)]
    assert sorted(top) == kinds()


@pytest.mark.parametrize("component", COMPONENTS)
def test_component_adds_what_it_says(component):
    added = sorted(set(kinds([component])) - set(kinds()))
    want = {
        "hpa": [("HorizontalPodAutoscaler", "cpuserve")],
        "prometheus-operator": [("PrometheusRule", "cpuserve"), ("ServiceMonitor", "cpuserve")],
        "api-key": [],  # the Secret's name carries a hash: checked below
        "model-pvc": [("PersistentVolumeClaim", "cpuserve-models")],
        "model-hostpath": [],
        "amx": [],
        "inference-pool": [("Deployment", "cpuserve-epp"), ("InferencePool", "cpuserve"), ("Role", "cpuserve-epp"),
                           ("RoleBinding", "cpuserve-epp"), ("Service", "cpuserve-epp"),
                           ("ServiceAccount", "cpuserve-epp")],
        "inference-gateway": [("Gateway", "cpuserve"), ("HTTPRoute", "cpuserve")],
    }[component]
    added = [a for a in added if a[0] not in ("Secret", "ConfigMap")]
    assert added == want


def test_all_components_together():
    docs = render(ALL_COMPONENTS)
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "two components make the same object"
    assert set(kinds(ALL_COMPONENTS)) >= {k for c in ALL_COMPONENTS for k in kinds([c])
                                           if k[0] not in ("Secret", "ConfigMap")}


def rendered_deployment(components=()):
    return k8s_object("Deployment", components=tuple(components))


def test_hpa_owns_the_replica_count():
    """Without the HPA the base runs 2 replicas; with it the Deployment carries no `replicas`,
    so `kubectl apply` leaves the HPA's count alone."""
    assert rendered_deployment()["spec"]["replicas"] == 2
    assert "replicas" not in rendered_deployment(["hpa"])["spec"]
    assert "replicas" not in rendered_deployment(ALL_COMPONENTS)["spec"]


def test_hpa_is_opt_in_and_warns_about_the_adapter():
    assert "HorizontalPodAutoscaler" not in [d["kind"] for d in render(())]
    text = (COMPONENTS_DIR / "hpa" / "kustomization.yaml").read_text()
    assert "replaces any custom-metrics adapter" in text
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert "replaces any custom-metrics adapter" in readme


def test_prometheus_operator_component_drops_annotation_scraping():
    ann = rendered_deployment(["prometheus-operator"])["spec"]["template"]["metadata"].get("annotations", {})
    assert not any(k.startswith("prometheus.io/") for k in ann), "scraped twice: annotations and ServiceMonitor"


def test_api_key_component_requires_a_generated_secret():
    docs = render(("api-key",))
    secret = [d for d in docs if d["kind"] == "Secret"]
    assert len(secret) == 1 and secret[0]["metadata"]["name"].startswith("cpuserve-api-key-")
    assert set(secret[0]["data"]) == {"api-key"}
    c = rendered_deployment(["api-key"])["spec"]["template"]["spec"]["containers"][0]
    ref = [e for e in c["env"] if e["name"] == "CPUSERVE_API_KEY"][0]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret[0]["metadata"]["name"], "the reference follows the hashed name"
    assert ref["optional"] is False
    assert "api-key.txt" in (COMPONENTS_DIR / "api-key" / ".gitignore").read_text()


@pytest.mark.parametrize("component", ["model-pvc", "model-hostpath"])
def test_model_volume_mounted_read_only(component):
    spec = rendered_deployment([component])["spec"]["template"]["spec"]
    c = spec["containers"][0]
    mount = [m for m in c["volumeMounts"] if m["name"] == "models"]
    assert mount == [{"name": "models", "mountPath": "/models", "readOnly": True}]
    model = [e["value"] for e in c["env"] if e["name"] == "CPUSERVE_MODEL"]
    assert model and model[0].startswith("/models/")
    vol = [v for v in spec["volumes"] if v["name"] == "models"][0]
    if component == "model-pvc":
        assert vol["persistentVolumeClaim"] == {"claimName": "cpuserve-models", "readOnly": True}
        assert k8s_object("PersistentVolumeClaim", "cpuserve-models", ("model-pvc",))
    else:
        assert vol["hostPath"]["path"].startswith("/")


def test_amx_component_requires_the_nfd_label():
    aff = rendered_deployment(["amx"])["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    terms = aff["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "feature.node.kubernetes.io/cpu-cpuid.AMXBF16",
                                            "operator": "In", "values": ["true"]}]}]


def test_inference_pool_selects_the_pods_and_names_its_picker():
    pool = k8s_object("InferencePool", components=("inference-pool",))
    dep = rendered_deployment(["inference-pool"])
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [DEFAULT_PORT]
    epp_svc = k8s_object("Service", pool["spec"]["endpointPickerRef"]["name"], ("inference-pool",))
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] in [p["port"] for p in epp_svc["spec"]["ports"]]
    epp = k8s_object("Deployment", "cpuserve-epp", ("inference-pool",))
    assert epp_svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    # The picker's pods must not fall into the pool, the Service or the PDB of the model servers.
    assert not pool["spec"]["selector"]["matchLabels"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    image = epp["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0", "pinned to the release targeted"


def test_picker_config_matches_pod_labels_and_mount():
    from .helpers import EPP_CONFIG, epp_engine_config, epp_plugin

    label_key, engine = epp_engine_config()
    pod_labels = rendered_deployment(["inference-pool"])["spec"]["template"]["metadata"]["labels"]
    assert pod_labels.get(label_key) == engine["name"], "the picker picks the engine config by this pod label"
    assert epp_plugin("metrics-data-source")["parameters"]["path"] == METRICS_PATH
    for field in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        name = engine[field].split("{")[0]
        assert name in load_metrics(), f"{field}: {name} is not in deploy/metrics.txt"
    info = load_metrics()[engine["cacheInfoSpec"]]
    assert {engine["cacheBlockSizeLabelName"], engine["cacheNumBlocksLabelName"]} <= set(info.labels)
    # the rendered ConfigMap carries the file, and the picker reads it where it is mounted
    epp = k8s_object("Deployment", "cpuserve-epp", ("inference-pool",))["spec"]["template"]["spec"]
    cm_name = [v for v in epp["volumes"] if v["name"] == "config"][0]["configMap"]["name"]
    cm = k8s_object("ConfigMap", cm_name, ("inference-pool",))
    assert yaml.safe_load(cm["data"]["config.yaml"]) == yaml_docs(EPP_CONFIG)[0]
    args = epp["containers"][0]["args"]
    mount = [m for m in epp["containers"][0]["volumeMounts"] if m["name"] == "config"][0]["mountPath"]
    assert args[args.index("--config-file") + 1] == f"{mount}/config.yaml"
    assert args[args.index("--pool-name") + 1] == k8s_object("InferencePool", components=("inference-pool",))[
        "metadata"]["name"]


def test_httproute_sends_to_the_pool_through_the_gateway():
    route = k8s_object("HTTPRoute", components=("inference-gateway",))
    gw = k8s_object("Gateway", components=("inference-gateway",))
    assert [p["name"] for p in route["spec"]["parentRefs"]] == [gw["metadata"]["name"]]
    backends = [b for r in route["spec"]["rules"] for b in r["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "cpuserve"}]


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
    assert sc["readOnlyRootFilesystem"] is True, "the kernels load without writes (engine/native.py)"
    assert any(m["mountPath"] == "/tmp" for m in container()["volumeMounts"]), "a writable /tmp"
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
