"""End-to-end fixtures: the real server (``python -m service``) on a free loopback port.

One session-wide server (small KV cache, a short context, an API key and a 64 KiB body limit so the
401/413/400 paths are reachable) is driven by the official ``openai`` client and by raw httpx.
Tests that need other settings (a one-slot queue, SIGTERM) start their own with
:func:`start_server`.  A failing test gets the tail of each running server's log in its report.

CPUSERVE_E2E_STARTUP_TIMEOUT (seconds, default 300) bounds the wait for /health: the first start
on a fresh checkout may compile the native kernels.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import openai
import pytest

from .helpers import API_KEY, MAX_MODEL_LEN, MAX_REQUEST_BYTES

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT = float(os.environ.get("CPUSERVE_E2E_STARTUP_TIMEOUT", "300"))

# The service's own flags as environment variables: a developer's shell must not change the test server.
_FLAG_ENV = {
    "CPUSERVE_" + f
    for f in (
        "MODEL HOST PORT DTYPE SERVED_MODEL_NAME MAX_NUM_SEQS MAX_NUM_BATCHED_TOKENS MAX_MODEL_LEN KV_CACHE_GB "
        "KV_CACHE_DTYPE BLOCK_SIZE MAX_QUEUE MAX_REQUEST_BYTES API_KEY THREADS SHUTDOWN_TIMEOUT LOG_LEVEL LOG_FORMAT OTLP_TRACES_ENDPOINT"
    ).split()
}
_RUNNING: list["Server"] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _FLAG_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class Server:
    def __init__(self, name: str, args: list[str], log_path: Path, env: Optional[dict[str, str]] = None) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(self.port), *args]
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=service_env(**(env or {})), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        _RUNNING.append(self)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 6000) -> str:
        return self.log()[-n:]

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        status: Optional[int] = None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with {self.proc.returncode} before /health was 200")
            try:
                status = httpx.get(self.url + "/health", timeout=5).status_code
                if status == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} server: /health not 200 after {timeout:.0f}s (last status {status})")
            time.sleep(0.25)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, grace: float = 30) -> Optional[int]:
        """SIGTERM this server (only the process the fixture started), SIGKILL it after ``grace`` s."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self in _RUNNING:
            _RUNNING.remove(self)
        return self.proc.returncode


def start_server(name: str, tmp_dir: Path, *args: str, env: Optional[dict[str, str]] = None) -> Server:
    """Start ``python -m service`` with these flags (and extra environment), wait for /health."""
    server = Server(name, list(args), tmp_dir / f"{name}.log", env)
    try:
        server.wait_healthy()
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
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def aclient(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server: Server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001, ANN201
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for srv in _RUNNING:
            report.sections.append((f"server log: {srv.name} (tail)", srv.log_tail()))
