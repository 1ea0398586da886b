"""deploy/prometheus: promtool accepts the config and the rules, and the rule unit tests pass."""

from __future__ import annotations

import subprocess

import yaml

from .helpers import DEFAULT_PORT, METRICS_PATH, PROM, alert_rules, k8s_object, tool

PROMTOOL = tool("promtool")  # not skipped when missing: `make test` installs Debian's prometheus package


def promtool(*args, cwd=PROM):
    assert PROMTOOL, "promtool not found: `make test` installs Debian's prometheus package (apt-get install prometheus)"
    out = subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_promtool_check_config():
    out = promtool("check", "config", "prometheus.yml")
    assert "SUCCESS" in out


def test_promtool_check_rules():
    out = promtool("check", "rules", "alerts.yml")
    assert f"SUCCESS: {len(alert_rules())} rules found" in out


def test_promtool_rule_unit_tests():
    """alerts_test.yml: a healthy replica fires nothing; a sick one fires every alert."""
    out = promtool("test", "rules", "alerts_test.yml")
    assert "SUCCESS" in out
    tested = yaml.safe_load((PROM / "alerts_test.yml").read_text())
    names = {t["alertname"] for case in tested["tests"] for t in case.get("alert_rule_test", [])
             if t.get("exp_alerts")}
    assert names == {r["alert"] for r in alert_rules()}, "every alert has a firing unit test"


def test_promtool_check_prometheusrule(tmp_path):
    groups = k8s_object("PrometheusRule")["spec"]
    path = tmp_path / "prometheusrule-groups.yml"
    path.write_text(yaml.safe_dump(groups))
    promtool("check", "rules", str(path))


def test_scrape_config_targets_the_service():
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["alerts.yml"]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    job = jobs["cpuserve"]
    assert job.get("metrics_path", "/metrics") == METRICS_PATH
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"cpuserve:{DEFAULT_PORT}"], "compose service name and port"


def test_alert_rules_are_complete():
    for r in alert_rules():
        assert r["alert"].startswith("Cpuserve")
        assert r["labels"]["severity"] in ("critical", "warning", "info")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        assert r.get("for"), f"{r['alert']}: a `for` keeps one bad scrape from paging"
    exprs = " ".join(r["expr"] for r in alert_rules())
    # the alerts the brief asks for: TTFT p99, KV cache near full, error rate, preemptions, engine down
    for needle in ("histogram_quantile(0.99", "cpuserve:time_to_first_token_seconds_bucket",
                   "cpuserve:kv_cache_usage_ratio", 'finish_reason="error"', "cpuserve:preemptions_total",
                   "cpuserve:engine_healthy", 'up{job="cpuserve"}',
                   # annotation scraping (job kubernetes-pods) keeps the pod label, not the job name
                   'up{app_kubernetes_io_name="cpuserve"}'):
        assert needle in exprs, f"no alert uses {needle}"
