"""The command line: --help, environment variables, and bad settings failing in one clear line."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.harness import service_env

from .conftest import ROOT

FLAGS = [
    "--model", "--host", "--port", "--dtype", "--served-model-name", "--max-num-seqs", "--max-num-batched-tokens",
    "--max-model-len", "--kv-cache-gb", "--prefix-cache-gb", "--kv-cache-dtype", "--block-size", "--max-queue", "--max-request-bytes",
    "--api-key", "--threads", "--shutdown-timeout", "--log-level",
]


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service", *args], cwd=ROOT, env=service_env(**env),
        capture_output=True, text=True, timeout=120,
    )


def test_help_describes_every_flag_and_its_variable() -> None:
    r = run("--help")
    assert r.returncode == 0
    for flag in FLAGS:
        assert flag in r.stdout
        assert "CPUSERVE_" + flag[2:].upper().replace("-", "_") in r.stdout


def test_bad_model_path_is_one_clear_line() -> None:
    r = run("--model", "/nonexistent/model.gguf", "--port", "0")
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == ["error: model path does not exist: /nonexistent/model.gguf"]
    assert "Traceback" not in r.stdout + r.stderr


def test_bad_settings_fail_before_loading() -> None:
    r = run("--block-size", "12")
    assert r.returncode != 0 and "block_size" in r.stderr and "Traceback" not in r.stderr
    r = run("--prefix-cache-gb", "-1")
    assert r.returncode != 0 and "prefix_cache_gb must not be negative" in r.stderr and "Traceback" not in r.stderr
    r = run(CPUSERVE_PORT="not-a-port")
    assert r.returncode != 0 and "CPUSERVE_PORT" in r.stderr and "Traceback" not in r.stderr
    r = run("--kv-cache-dtype", "bfloat16", "--dtype", "float32")
    assert r.returncode != 0 and "kv_cache_dtype bfloat16 needs dtype bfloat16" in r.stderr and "Traceback" not in r.stderr
    r = run(CPUSERVE_MODEL="/nonexistent/from-env")
    assert r.returncode != 0 and "/nonexistent/from-env" in r.stderr
