"""Two replicas behind a real proxy (Debian's HAProxy, least-connections): requests spread over
both, a replica drained with SIGTERM loses no request, and the other keeps serving.

What a load balancer in front of cpuserve needs, and what this shows it gets: /health turns 503
as soon as a drain starts (the health check takes the replica out), a POST that reaches a
draining replica is refused with 503 before any work (safe for the proxy to retry elsewhere:
HAProxy's `retry-on 503`), and requests already running finish.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.harness import ServerProcess, free_port, launch
from tests.e2e.conftest import start_server
from tests.e2e.helpers import MODEL, metric, scrape, wait_for

from .helpers import tool

HAPROXY_CFG = """
global
    maxconn 256
defaults
    mode http
    timeout connect 2s
    timeout client 120s
    timeout server 120s
    timeout check 3s
    retries 3
    # A replica that refuses a request while draining (503 before any work) or a closed port:
    # try the request on another replica.
    retry-on conn-failure empty-response 503
    option redispatch 1
    option http-buffer-request
frontend api
    bind 127.0.0.1:{port}
    default_backend cpuserve
backend cpuserve
    balance leastconn
    option httpchk GET /health
    http-check expect status 200
{servers}
"""


def completion(base: str, max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    return httpx.post(base + "/v1/completions", json=body, timeout=120)


def long_completion(base: str, started: threading.Event, max_tokens: int = 48) -> tuple[int, str, int]:
    """A streamed completion that sets ``started`` once its first token arrives (it is then running,
    not merely sent); returns (status, error body, completion tokens from the usage chunk)."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                return r.status_code, r.read().decode()[:200], 0
            tokens = 0
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                started.set()
                usage = json.loads(line[len("data: "):]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
            return 200, "", tokens
    finally:
        started.set()


def served(server: ServerProcess) -> float:
    return metric(scrape(server.url), "cpuserve:http_requests_total", absent=0.0, route="/v1/completions",
                  status="200")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("replicas")
    args = ("--kv-cache-gb", "0.2", "--threads", "1", "--max-num-seqs", "8", "--shutdown-timeout", "20")
    servers = [start_server("a", tmp, *args), start_server("b", tmp, *args)]
    yield servers
    for s in servers:
        s.stop(grace=30)


@pytest.fixture(scope="module")
def proxy(replicas: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory):
    haproxy = tool("haproxy") or (Path("/usr/sbin/haproxy") if Path("/usr/sbin/haproxy").exists() else None)
    if not haproxy:
        pytest.fail("no haproxy: `make test` installs Debian's haproxy package (apt-get install haproxy)")
    tmp = tmp_path_factory.mktemp("haproxy")
    port = free_port()
    servers = "\n".join(f"    server {s.name} 127.0.0.1:{s.port} check inter 300ms fall 3 rise 2"
                        for s in replicas)
    cfg = tmp / "haproxy.cfg"
    cfg.write_text(HAPROXY_CFG.format(port=port, servers=servers))
    check = subprocess.run([str(haproxy), "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    proxy = launch("haproxy", [str(haproxy), "-f", str(cfg), "-db"], port, tmp / "haproxy.log")
    try:
        proxy.wait_healthy(30)  # /health through a replica
        yield proxy.url
    finally:
        proxy.stop(grace=10)


def test_requests_spread_over_both_replicas(replicas: list[ServerProcess], proxy: str) -> None:
    before = [served(s) for s in replicas]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: completion(proxy, 8), range(8)))
    assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200]
    gained = [served(s) - b for s, b in zip(replicas, before)]
    assert sum(gained) == 8
    assert min(gained) >= 2, f"least-connections should spread 8 concurrent requests: {gained}"


def test_drain_loses_no_request_and_the_other_replica_serves(replicas: list[ServerProcess], proxy: str) -> None:
    a, b = replicas
    results: list[httpx.Response] = []
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        # Long requests in flight when `a` is told to stop: three sent to `a` itself (the proxy
        # does not count them, so its least-connections choice sends the next requests to `a`,
        # into the drain, and they must be retried on `b`), three through the proxy.
        # Each must be running (its first token streamed) before the signal: one still on its way
        # to `a` would be refused with no proxy to retry it, a race of the test, not a lost request.
        started = [threading.Event() for _ in range(6)]
        running = [pool.submit(long_completion, a.url, e) for e in started[:3]]
        running += [pool.submit(long_completion, proxy, e) for e in started[3:]]
        assert all(e.wait(60) for e in started), "the long requests never started"
        a.signal(signal.SIGTERM)
        # new requests keep arriving during the drain
        later = []
        for _ in range(8):
            later.append(pool.submit(completion, proxy, 4))
            time.sleep(0.25)
        long_results = [f.result() for f in running]
        results = [f.result() for f in later]
    bad = [(status, text) for status, text, _ in long_results if status != 200]
    bad += [(r.status_code, r.text[:200]) for r in results if r.status_code != 200]
    assert not bad, f"requests lost during the drain: {bad}"
    assert [tokens for _, _, tokens in long_results] == [48] * 6, "an in-flight request was cut short"
    assert a.proc.wait(timeout=40) == 0, a.log_tail()
    for _ in range(3):
        r = completion(proxy, 4)
        assert r.status_code == 200, r.text
    assert b.proc.poll() is None and httpx.get(b.url + "/health", timeout=5).status_code == 200
