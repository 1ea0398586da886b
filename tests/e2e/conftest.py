"""End-to-end fixtures: the real server (``python -m service``) on a free loopback port.

One session-wide server (small KV cache, a short context, an API key and a 64 KiB body limit so the
401/413/400 paths are reachable) is driven by the official ``openai`` client and by raw httpx.
Tests that need other settings (a one-slot queue, SIGTERM) start their own with
:func:`start_server`.  A failing test gets the tail of each running server's log in its report.
Starting, probing and stopping a server is ``benchmarks/harness.py``'s, as for the benchmarks.

CPUSERVE_E2E_STARTUP_TIMEOUT (seconds, default 300) bounds the wait for /health: the first start
on a fresh checkout may compile the native kernels.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import httpx
import openai
import pytest

from benchmarks.harness import ServerProcess, launch_service, service_env

from .helpers import API_KEY, MAX_MODEL_LEN, MAX_REQUEST_BYTES

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT = float(os.environ.get("CPUSERVE_E2E_STARTUP_TIMEOUT", "300"))
_RUNNING: list[ServerProcess] = []  # servers started here and not stopped: their logs go in failure reports


def launch_server(name: str, args: list[str], log_path: Path, env: Optional[dict[str, str]] = None) -> ServerProcess:
    """Start ``python -m service`` with these flags (and extra environment) without waiting for it."""
    srv = launch_service(name, args, log_path, env=service_env(**(env or {})))
    _RUNNING.append(srv)
    return srv


def start_server(name: str, tmp_dir: Path, *args: str, env: Optional[dict[str, str]] = None) -> ServerProcess:
    """Start ``python -m service`` with these flags (and extra environment), wait for /health."""
    server = launch_server(name, list(args), tmp_dir / f"{name}.log", env)
    try:
        server.wait_healthy(STARTUP_TIMEOUT)
    except RuntimeError as exc:
        server.stop(grace=5)
        pytest.fail(f"{exc}\n--- server log ---\n{server.log_tail()}", pytrace=False)
    return server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(
        "main",
        tmp_path_factory.mktemp("e2e"),
        "--kv-cache-gb", "0.5",
        "--dtype", "float32",  # batch-invariant greedy outputs: batched == alone, token for token
        "--threads", "1",  # the test client shares the CPUs: oversubscribed OpenMP threads crawl
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", "16",
        "--api-key", API_KEY,
        "--max-request-bytes", str(MAX_REQUEST_BYTES),
        "--shutdown-timeout", "5",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def aclient(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server: ServerProcess):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001, ANN201
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        _RUNNING[:] = [srv for srv in _RUNNING if not srv.stopped]
        for srv in _RUNNING:
            report.sections.append((f"server log: {srv.name} (tail)", srv.log_tail()))
