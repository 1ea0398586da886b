"""The real service scraped by a real Prometheus: every dashboard query and alert expression
returns data for the metric it names, and /metrics matches deploy/metrics.txt.

Starts `python -m service` on a free loopback port (small KV cache), waits for /health, starts
Debian's `prometheus` binary on loopback with a temporary config scraping the service every
second (and loading deploy/prometheus/alerts.yml), sends completions between scrapes, then
asks Prometheus' HTTP API. Skipped only while service/__main__.py does not exist.

CPUSERVE_LIVE_ROOT points it at another checkout (or a stub service) to try it;
CPUSERVE_LIVE_STARTUP_TIMEOUT (seconds, default 150) bounds the wait for /health.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness import ServerProcess, free_port, launch, launch_service

from .helpers import (
    EPP_SPEC_FIELDS, HEALTH_PATH, METRICS_PATH, PROM, ROOT, SCRAPE_LABELS, alert_rules, dashboard,
    dashboard_exprs, epp_engine_config, grafana_to_promql, load_metrics, matchers, parse_metric_spec, selectors,
    strip_threshold, tool,
)

SERVICE_ROOT = Path(os.environ.get("CPUSERVE_LIVE_ROOT") or ROOT)
STARTUP_TIMEOUT = float(os.environ.get("CPUSERVE_LIVE_STARTUP_TIMEOUT", "150"))
SCRAPE_JOB = "cpuserve"
ANNOTATION_JOB = "kubernetes-pods"

pytestmark = pytest.mark.skipif(
    not (SERVICE_ROOT / "service" / "__main__.py").exists(),
    reason="service/__main__.py does not exist yet: this test runs once the service lands",
)


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def started(srv: ServerProcess, timeout: float, path: str = HEALTH_PATH) -> ServerProcess:
    """``srv`` once ``path`` answers 200; the test fails (the server stopped) if it never does."""
    try:
        srv.wait_healthy(timeout, interval=0.3, path=path)
    except RuntimeError as exc:
        srv.stop(grace=5)
        pytest.fail(f"{exc}\n{tail(srv.log_path)}")
    return srv


# ---------------------------------------------------------------------------------------------
# Fixtures: service, Prometheus, traffic
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("service")
    srv = launch_service("service", ["--kv-cache-gb", "0.5", "--max-num-seqs", "8", "--shutdown-timeout", "5"],
                         tmp / "service.log", cwd=SERVICE_ROOT)
    started(srv, STARTUP_TIMEOUT)
    try:
        yield {"base": srv.url, "port": srv.port, "log": srv.log_path, "proc": srv.proc}
    finally:
        srv.stop(grace=20)


@pytest.fixture(scope="module")
def prometheus(service, tmp_path_factory):
    binary = tool("prometheus")
    if not binary:
        pytest.fail("no prometheus binary: `make test` installs Debian's prometheus package "
                    "(apt-get install prometheus)")
    tmp = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(PROM / "alerts.yml")],
        "scrape_configs": [{
            "job_name": SCRAPE_JOB,
            "metrics_path": METRICS_PATH,
            "scrape_interval": "1s",
            "scrape_timeout": "1s",
            "static_configs": [{"targets": [f"127.0.0.1:{service['port']}"]}],
        }, {
            # What Kubernetes annotation scraping makes of a cpuserve pod: job kubernetes-pods,
            # the pod label app.kubernetes.io/name copied as app_kubernetes_io_name (the
            # community chart's labelmap), which CpuserveTargetDown matches on.
            "job_name": ANNOTATION_JOB,
            "metrics_path": METRICS_PATH,
            "scrape_interval": "1s",
            "scrape_timeout": "1s",
            "static_configs": [{"targets": [f"127.0.0.1:{service['port']}"],
                                "labels": {"app_kubernetes_io_name": "cpuserve"}}],
        }],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    prom = launch("prometheus", [binary, f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                                 "--log.level=warn"], port, tmp / "prometheus.log", cwd=tmp)
    started(prom, 60, path="/-/ready")
    try:
        yield {"api": prom.url, "log": prom.log_path}
    finally:
        prom.stop(grace=10)


def last_scrape_after(api: str, t: float, timeout: float = 30) -> None:
    """Wait until Prometheus has scraped the service successfully after wall-clock time t."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        targets = httpx.get(api + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        ours = [x for x in targets if x["labels"].get("job") == SCRAPE_JOB]
        if ours:
            last = ours[0]
            scraped = last.get("lastScrape", "")
            if last["health"] == "up" and scraped and _rfc3339(scraped) > t:
                return
        time.sleep(0.5)
    pytest.fail(f"no successful scrape of the service after t={t:.1f}: {last}")


def _rfc3339(ts: str) -> float:
    from datetime import datetime

    ts = ts.replace("Z", "+00:00")
    # Go prints up to 9 fractional digits; Python takes 6
    if "." in ts:
        head, frac = ts.split(".", 1)
        digits = "".join(ch for ch in frac if ch.isdigit())
        rest = frac[len(digits):]
        ts = f"{head}.{digits[:6].ljust(6, '0')}{rest}"
    return datetime.fromisoformat(ts).timestamp()


@pytest.fixture(scope="module")
def traffic(service, prometheus):
    """Completions (plain, streamed, chat, concurrent, one invalid) between scrapes."""
    base, api = service["base"], prometheus["api"]
    last_scrape_after(api, time.time())  # a scrape before any request: counters start from it
    client = httpx.Client(base_url=base, timeout=120)
    models = client.get("/v1/models")
    assert models.status_code == 200, models.text
    model = models.json()["data"][0]["id"]
    results = {"model": model, "completions": [], "chat": [], "stream_chunks": 0, "invalid_status": None}

    def complete(prompt, max_tokens=8):
        r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                 "temperature": 0})
        results["completions"].append(r)

    complete("The capital of France is")
    complete("Once upon a time", max_tokens=16)
    r = client.post("/v1/chat/completions", json={"model": model, "max_tokens": 8, "temperature": 0,
                                                  "messages": [{"role": "user", "content": "Say hello."}]})
    results["chat"].append(r)
    with client.stream("POST", "/v1/completions", json={"model": model, "prompt": "Counting: 1, 2, 3,",
                                                        "max_tokens": 12, "stream": True}) as s:
        assert s.status_code == 200, s.read()
        for line in s.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                results["stream_chunks"] += 1
    threads = [threading.Thread(target=complete, args=(f"Fact number {i} about the sea:", 16)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    bad = client.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": -1})
    results["invalid_status"] = bad.status_code
    client.close()
    # two more scrapes after the last request, so every rate() window sees the increase
    t_done = time.time()
    last_scrape_after(api, t_done)
    last_scrape_after(api, time.time())
    return results


def query(api: str, expr: str) -> list:
    r = httpx.get(api + "/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body.get("status") == "success", f"{expr!r}: {body}"
    return body["data"]["result"]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_completions_answer(traffic):
    for r in traffic["completions"] + traffic["chat"]:
        assert r.status_code == 200, r.text
        assert r.json()["choices"], r.text
    assert traffic["stream_chunks"] >= 1
    assert 400 <= traffic["invalid_status"] < 500, "max_tokens=-1 is a client error"


def test_metrics_endpoint_matches_metrics_txt(service, traffic):
    text = httpx.get(service["base"] + METRICS_PATH, timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    problems = []
    for name, m in load_metrics().items():
        family = name[: -len("_total")] if m.type == "counter" else name
        f = families.get(family)
        if f is None:
            problems.append(f"{name} ({m.type}) missing from /metrics")
            continue
        if f.type != m.type:
            problems.append(f"{name}: /metrics says {f.type}, metrics.txt says {m.type}")
        samples = [s for s in f.samples if not s.name.endswith("_created")]
        if not samples:
            problems.append(f"{name}: no samples (initialise its label children at start-up)")
        for s in samples:
            labels = set(s.labels) - {"le"}
            if "model_name" not in labels:
                problems.append(f"{s.name}: no model_name label")
            want = {"model_name", *m.labels}
            if labels != want:
                problems.append(f"{s.name}: labels {sorted(labels)}, metrics.txt says {sorted(want)}")
            for label, closed in m.labels.items():
                if closed and s.labels.get(label) not in closed:
                    problems.append(f"{s.name}: {label}={s.labels.get(label)!r} not in {sorted(closed)}")
    known = set(load_metrics()) | {n[: -len("_total")] for n in load_metrics() if n.endswith("_total")}
    undocumented = sorted(n for n in families if n.startswith("cpuserve:") and n not in known
                          and not (n.endswith("_created") and n[: -len("_created")] in known))
    if undocumented:
        problems.append(f"exported but not in deploy/metrics.txt: {undocumented}")
    assert not problems, "\n".join(sorted(set(problems)))


def expressions():
    out = [(f"dashboard: {where}", grafana_to_promql(e)) for where, e in dashboard_exprs()]
    out += [(f"alert {r['alert']}", strip_threshold(r["expr"])) for r in alert_rules()]
    for v in dashboard()["templating"]["list"]:
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if isinstance(q, str) and q.startswith("label_values("):
            out.append((f"dashboard variable {v['name']}", grafana_to_promql(q[len("label_values("):].rsplit(",", 1)[0])))
    return out


@pytest.mark.parametrize("where,expr", expressions(), ids=[w for w, _ in expressions()])
def test_expression_returns_data(prometheus, traffic, where, expr):
    """The expression evaluates; every metric it names has data; it returns series, unless only a
    label value it filters on (finish_reason="error", status=~"5..") has not occurred."""
    api = prometheus["api"]
    result = query(api, expr)
    problems, explained = [], False
    for name, body in selectors(expr):
        if not query(api, f'count({{__name__="{name}"}})'):
            problems.append(f"{name} has no data in Prometheus")
            continue
        if body and not query(api, f"count({name}{body})"):
            value_matchers = [m for m in matchers(body) if m[0] not in SCRAPE_LABELS]
            if value_matchers:
                explained = True  # e.g. no request has failed yet
            else:
                problems.append(f"{name}{body} has no data")
    assert not problems, f"{where}: {expr}\n" + "\n".join(problems)
    assert result or explained, f"{where}: {expr} returned no series"


def test_alert_rules_evaluate(prometheus, traffic):
    api = prometheus["api"]
    deadline = time.monotonic() + 20
    while True:
        groups = httpx.get(api + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("health") != "unknown" for r in rules) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
    bad = {r["name"]: (r.get("health"), r.get("lastError")) for r in rules if r.get("health") != "ok"}
    assert not bad, f"rules not evaluating cleanly: {bad}"
    firing = {r["name"] for r in rules if r.get("state") == "firing"}
    assert not firing & {"CpuserveTargetDown", "CpuserveEngineUnhealthy"}, firing


def test_engine_healthy_and_target_up(prometheus, traffic):
    api = prometheus["api"]
    assert [float(s["value"][1]) for s in query(api, f'up{{job="{SCRAPE_JOB}"}}')] == [1.0]
    pod = query(api, f'up{{job="{ANNOTATION_JOB}", app_kubernetes_io_name="cpuserve"}}')
    assert [float(s["value"][1]) for s in pod] == [1.0]
    healthy = query(api, "cpuserve:engine_healthy")
    assert healthy and all(float(s["value"][1]) == 1.0 for s in healthy), healthy
    assert all(s["metric"].get("model_name") for s in healthy), healthy


def test_endpoint_picker_reads_every_series(service, traffic):
    """Each series the InferencePool's endpoint picker is configured to read exists on a live
    /metrics, with the labels the config names and values the picker can use."""
    _, engine = epp_engine_config()
    text = httpx.get(service["base"] + METRICS_PATH, timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    read = {}
    for field in EPP_SPEC_FIELDS:
        if not engine.get(field):
            continue  # an empty spec switches that scrape off in the picker
        name, want = parse_metric_spec(engine[field])
        assert name in families, f"{field}: {name} is not on /metrics"
        f = families[name]
        assert f.type == "gauge", f"{field}: the picker reads a gauge's value; {name} is a {f.type}"
        samples = [s for s in f.samples if want.items() <= s.labels.items()]
        assert samples, f"{field}: no {name} sample with labels {want}"
        read[field] = samples[-1]
    assert 0 <= read["kvUsageSpec"].value <= 1, "kv usage: a fraction"
    assert read["queuedRequestsSpec"].value >= 0 and read["runningRequestsSpec"].value >= 0
    info = read["cacheInfoSpec"]
    block_size = int(info.labels[engine["cacheBlockSizeLabelName"]])
    num_blocks = int(info.labels[engine["cacheNumBlocksLabelName"]])
    assert block_size == 16, "the service's default --block-size"
    assert num_blocks * block_size >= 2048, "0.5 GiB of KV cache holds more than one short context"


def test_service_stops_on_sigterm(service, prometheus, traffic):
    """Last: SIGTERM drains and exits within --shutdown-timeout (5 s) plus a margin."""
    proc = service["proc"]
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"service still running 30 s after SIGTERM:\n{tail(service['log'])}")
    assert rc in (0, -signal.SIGTERM, 128 + signal.SIGTERM), f"exit code {rc}:\n{tail(service['log'])}"

