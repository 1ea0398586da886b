"""Ports, paths and metric names agree across deploy/metrics.txt, the Dockerfile, compose, the
Kubernetes manifests, the Grafana dashboard, the alert rules and the READMEs."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from .helpers import (
    CLI_FLAGS, DASHBOARD, DEFAULT_PORT, DEFAULT_SHUTDOWN_TIMEOUT, DEPLOY, GIB, GRAFANA, HEALTH_PATH, K8S,
    METRICS_PATH, PROM, ROOT, SCRAPE_LABELS, TORCH_CPU_INDEX, alert_rules, dashboard, dashboard_exprs,
    dashboard_panels, dockerfile_instructions, k8s_object, matchers, parse_compose_bytes, promql_series,
    resolve_series, selectors, yaml_docs,
)

STEP_PHASES = ["schedule", "prepare_inputs", "kv_cache_update", "attention", "model_forward", "sampling", "detokenize"]


def all_promql() -> list[tuple[str, str]]:
    """(where, expr) for every PromQL expression the deploy files hold."""
    out = [(f"dashboard: {w}", e) for w, e in dashboard_exprs()]
    for v in dashboard()["templating"]["list"]:
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        m = re.fullmatch(r"label_values\((.+),\s*\w+\)", q or "")
        if m:
            out.append((f"dashboard variable {v['name']}", m.group(1)))
    out += [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]
    values = yaml.safe_load((K8S / "components" / "hpa" / "prometheus-adapter" / "values.yaml").read_text())
    out += [("prometheus-adapter seriesQuery", r["seriesQuery"]) for r in values["rules"]["custom"]]
    return out


# ---------------------------------------------------------------------------------------------
# deploy/metrics.txt itself
# ---------------------------------------------------------------------------------------------


def test_metrics_txt_well_formed(metrics):
    assert len(metrics) >= 20
    for name, m in metrics.items():
        assert re.fullmatch(r"cpuserve:[a-z][a-z0-9_]*", name), name
        assert m.type in ("counter", "gauge", "histogram"), name
        assert name.endswith("_total") == (m.type == "counter"), f"{name}: counters, and only they, end in _total"
        assert not name.endswith(("_bucket", "_sum", "_count", "_created")), name
        assert "model_name" not in m.labels, "model_name is implied for every metric"


def test_metrics_txt_has_the_interface(metrics):
    for phase in STEP_PHASES:
        assert metrics[f"cpuserve:step_{phase}_seconds"].type == "histogram"
    assert metrics["cpuserve:requests_finished_total"].labels["finish_reason"] == {"stop", "length", "abort", "error"}
    assert metrics["cpuserve:requests_rejected_total"].labels["reason"] == {
        "queue_full", "invalid", "unauthorized", "too_large", "shutting_down"}
    assert set(metrics["cpuserve:http_requests_total"].labels) == {"route", "status"}
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio", "engine_healthy"):
        assert metrics[f"cpuserve:{gauge}"].type == "gauge"


# ---------------------------------------------------------------------------------------------
# PromQL in the dashboard, the alerts and the adapter rules
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where,expr", all_promql(), ids=[w for w, _ in all_promql()])
def test_promql_names_known_metrics(where, expr, metrics):
    names = promql_series(expr)
    assert names or "up{" in expr, f"{where}: no cpuserve metric in {expr!r}"
    for name in names:
        resolved = resolve_series(name, metrics)
        assert resolved, f"{where}: {name} is not in deploy/metrics.txt"
        metric, suffix = resolved
        if metric.type == "histogram":
            assert suffix, f"{where}: histogram {name} needs _bucket/_sum/_count in PromQL"
        if "histogram_quantile" in expr and suffix == "_bucket":
            assert re.search(r"\bby\s*\([^)]*\ble\b", expr), f"{where}: histogram_quantile must keep le"


@pytest.mark.parametrize("where,expr", all_promql(), ids=[w for w, _ in all_promql()])
def test_promql_labels_known(where, expr, metrics):
    all_labels = set(SCRAPE_LABELS)
    for m in metrics.values():
        all_labels |= set(m.labels)
    for name, body in selectors(expr):
        resolved = resolve_series(name, metrics)
        known = dict(resolved[0].labels) if resolved else {}
        for label, op, value in matchers(body):
            if label == "__name__":
                continue
            assert label in SCRAPE_LABELS or label in known, f"{where}: {name} has no label {label}"
            closed = known.get(label)
            if closed and "$" not in value:
                if op == "=":
                    assert value in closed, f"{where}: {label}={value!r} is not one of {sorted(closed)}"
                elif op == "=~" and re.fullmatch(r"[a-z_|]+", value):
                    assert set(value.split("|")) <= closed, f"{where}: {label}=~{value!r} outside {sorted(closed)}"
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        for label in filter(None, (l.strip() for l in group.split(","))):
            assert label in all_labels, f"{where}: grouping by unknown label {label}"


def test_dashboard_covers_every_metric(metrics):
    used = {resolve_series(n, metrics)[0].name for _, e in dashboard_exprs() for n in promql_series(e)
            if resolve_series(n, metrics)}
    missing = sorted(set(metrics) - used)
    assert not missing, f"no dashboard panel shows {missing}"


def test_dashboard_panels():
    d = dashboard()
    assert d["uid"] == "cpuserve" and d["title"]
    ids = [p["id"] for p in dashboard_panels()]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = " | ".join(p.get("title", "") for p in dashboard_panels())
    for needle in ("Time to first token", "Inter-token latency", "Token throughput", "Running and waiting",
                   "KV-cache usage", "Preemptions", "phase"):
        assert needle in titles, f"no panel titled like {needle!r}"
    legends = {t.get("legendFormat") for p in dashboard_panels() for t in p.get("targets") or []}
    for label in ("schedule", "prepare inputs", "KV-cache update", "attention", "model forward", "sampling", "detokenize"):
        assert label in legends, f"no step-phase series labelled {label!r}"
    occupied = set()
    for p in dashboard_panels():
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"panel {p['title']!r} overlaps another"
        occupied |= cells
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert refs and len(refs) == len(set(refs)), p["title"]


def test_grafana_provisioning_matches_compose():
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert len(ds) == 1 and ds[0]["type"] == "prometheus"
    var = next(v for v in dashboard()["templating"]["list"] if v["name"] == "datasource")
    assert var["current"]["value"] == ds[0]["uid"], "dashboard's default data source = the provisioned one"
    compose = yaml_docs(DEPLOY / "compose.yaml")[0]["services"]
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", ds[0]["url"]).groups()
    assert host in compose and port == "9090"
    assert any(p.endswith(":9090") for p in compose["prometheus"]["ports"])

    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "cpuserve.yaml").read_text())["providers"]
    mounts = dict(v.split(":")[:2][::-1] for v in compose["grafana"]["volumes"] if v.startswith("./"))
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    path = providers[0]["options"]["path"]
    assert mounts[path] == "./" + str(DASHBOARD.parent.relative_to(DEPLOY)), "dashboards folder mounted where provisioning looks"
    home = compose["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path}/{DASHBOARD.name}"


# ---------------------------------------------------------------------------------------------
# Ports, paths, sizing across Dockerfile / compose / k8s / Prometheus
# ---------------------------------------------------------------------------------------------


def compose_service(name):
    return yaml_docs(DEPLOY / "compose.yaml")[0]["services"][name]


def test_compose_cpuserve():
    svc = compose_service("cpuserve")
    assert (DEPLOY / svc["build"]["context"] / svc["build"].get("dockerfile", "Dockerfile")).resolve() == (ROOT / "Dockerfile")
    assert svc["build"]["args"]["TORCH_INDEX_URL"].endswith(f":-{TORCH_CPU_INDEX}}}")
    assert any(re.fullmatch(rf"(.+:)?\d+:{DEFAULT_PORT}", p) for p in svc["ports"])
    hc = svc["healthcheck"]["test"]
    assert hc[0] == "CMD" and f"127.0.0.1:{DEFAULT_PORT}{HEALTH_PATH}" in hc[-1]
    docker_hc = next(a for i, a in dockerfile_instructions() if i == "HEALTHCHECK")
    assert json.loads(re.search(r"CMD (\[.*\])$", docker_hc).group(1)) == hc[1:], "same probe as the image"
    envs = svc["environment"]
    kv = float(re.sub(r"\$\{\w+:-([\d.]+)\}", r"\1", str(envs["CPUSERVE_KV_CACHE_GB"])))
    mem = parse_compose_bytes(re.sub(r"\$\{\w+:-(\w+)\}", r"\1", str(svc["mem_limit"])))
    assert 1 * GIB <= mem - kv * GIB <= 2 * GIB, "mem_limit = KV cache + ~1.5 GiB"
    grace = int(re.fullmatch(r"(\d+)s", svc["stop_grace_period"]).group(1))
    assert grace > int(envs.get("CPUSERVE_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT))
    for var in ("OMP_NUM_THREADS", "CPUSERVE_THREADS"):
        assert envs[var] == svc["cpus"], f"{var} follows the CPUs the container gets"
    for flag in svc.get("command") or []:
        assert not str(flag).startswith("--") or flag in CLI_FLAGS


def test_compose_prometheus():
    svc = compose_service("prometheus")
    mounts = dict(v.split(":")[:2][::-1] for v in svc["volumes"] if v.startswith("./"))
    assert mounts["/etc/prometheus"] == "./prometheus"
    config = next(a.split("=", 1)[1] for a in svc["command"] if a.startswith("--config.file="))
    assert config == "/etc/prometheus/prometheus.yml"
    assert (PROM / "prometheus.yml").is_file()
    scrape = yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"][0]
    host = scrape["static_configs"][0]["targets"][0].split(":")[0]
    assert host in yaml_docs(DEPLOY / "compose.yaml")[0]["services"]


def test_health_and_metrics_paths_everywhere():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f":{DEFAULT_PORT}{HEALTH_PATH}" in dockerfile
    c = k8s_object("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert {c[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {HEALTH_PATH}
    assert k8s_object("Deployment")["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] == METRICS_PATH
    assert {e.get("path") for e in k8s_object("ServiceMonitor")["spec"]["endpoints"]} == {METRICS_PATH}
    assert yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"][0]["metrics_path"] == METRICS_PATH


# ---------------------------------------------------------------------------------------------
# READMEs
# ---------------------------------------------------------------------------------------------


def readmes():
    return [p for p in (DEPLOY / "README.md", ROOT / "README.md") if p.exists()]


def test_deploy_readme_exists():
    assert (DEPLOY / "README.md").is_file()


@pytest.mark.parametrize("path", readmes(), ids=lambda p: str(p.relative_to(ROOT)))
def test_readme_metric_names_known(path, metrics):
    # metric names all have an underscore; "cpuserve:latest" is an image tag
    for name in re.findall(r"cpuserve:[a-z0-9]+_[a-z0-9_]*[a-z0-9]", path.read_text()):
        assert resolve_series(name, metrics), f"{path.name} names {name}, not in deploy/metrics.txt"


# flags of docker, kubectl, helm and pip that the README may show; any other --flag is the service's
DOCKER_KUBECTL_PIP_FLAGS = {
    "--build-arg", "--cpus", "--cpuset-cpus", "--rm", "--build", "--extra-index-url", "--no-deps", "--memory",
    "--stop-timeout", "--name", "--from-literal", "--env", "--values", "--namespace", "--detach",
    # kubectl run / helm / kubelet / numactl in the Kubernetes walk-through and NUMA notes
    "--image", "--restart", "--overrides", "--create-namespace", "--cpu-manager-policy",
    "--topology-manager-policy", "--cpunodebind", "--membind", "--threads", "--format", "--read-only", "--tmpfs",
}


def test_deploy_readme_agrees():
    text = (DEPLOY / "README.md").read_text()
    for needle in ("kubectl apply -k deploy/k8s", "docker compose -f deploy/compose.yaml up",
                   f"--build-arg TORCH_INDEX_URL={TORCH_CPU_INDEX}", f"localhost:{DEFAULT_PORT}",
                   "127.0.0.1:9090", "127.0.0.1:3000", HEALTH_PATH, METRICS_PATH,
                   "OMP_NUM_THREADS", "CPUSERVE_THREADS", "make serve", "make test", "deploy/metrics.txt"):
        assert needle in text, f"deploy/README.md should mention {needle!r}"
    for flag in set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", text)):
        if flag in DOCKER_KUBECTL_PIP_FLAGS:
            continue
        assert flag in CLI_FLAGS, f"deploy/README.md uses unknown flag {flag}"
