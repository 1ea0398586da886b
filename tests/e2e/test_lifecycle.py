"""A server of its own with a one-slot batch and a one-request queue: 429 when full, then SIGTERM's drain;
and one stopped while its model still loads.

The tests run in file order: the drain test shuts the small server down.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from benchmarks.harness import ServerProcess

from .conftest import launch_server, start_server
from .helpers import MODEL, metric, scrape, wait_for

SHUTDOWN_TIMEOUT = 8
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(
        "small",
        tmp_path_factory.mktemp("small"),
        "--kv-cache-gb", "0.1",
        "--threads", "1",
        "--max-model-len", "4096",
        "--max-num-seqs", "1",
        "--max-queue", "1",
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
    )
    yield srv
    srv.stop()


def first_event(lines) -> dict:  # noqa: ANN001
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("stream ended without an event")


def test_queue_full_is_429_with_retry_after(small: ServerProcess) -> None:
    with httpx.Client(base_url=small.url, timeout=60) as a, httpx.Client(base_url=small.url, timeout=60) as b:
        with a.stream("POST", "/v1/completions", json=LONG) as running:
            lines = running.iter_lines()  # kept: dropping the iterator would close the connection
            first_event(lines)  # running: it holds the only batch slot
            with b.stream("POST", "/v1/completions", json=LONG) as waiting:
                assert waiting.status_code == 200  # queued: it fills the one-request queue
                wait_for(lambda: metric(scrape(small.url), "cpuserve:num_requests_waiting") == 1, 5, "a waiting request")
                r = httpx.post(small.url + "/v1/completions", json={**LONG, "stream": False, "max_tokens": 1})
                assert r.status_code == 429, r.text
                assert int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"]["type"] and r.json()["error"]["code"] == "queue_full"
    # both streams closed: the queue drains and the server serves again
    wait_for(lambda: metric(scrape(small.url), "cpuserve:num_requests_running") == 0, 10, "the aborts")
    r = httpx.post(small.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert metric(scrape(small.url), "cpuserve:requests_rejected_total", reason="queue_full") == 1


def test_sigterm_drains_in_flight_requests_then_exits_0(small: ServerProcess) -> None:
    """SIGTERM: new work is refused, the running stream finishes, the one still queued at the
    shutdown timeout ends with a clean error event, and the process exits 0."""
    short = {**LONG, "max_tokens": 24, "stream_options": {"include_usage": True}}
    long = {**LONG, "max_tokens": 4000}  # far more than SHUTDOWN_TIMEOUT seconds of decoding
    cut: list[str] = []
    with httpx.Client(base_url=small.url, timeout=60) as a, httpx.Client(base_url=small.url, timeout=60) as b:
        with a.stream("POST", "/v1/completions", json=short) as r:
            lines = r.iter_lines()
            first_event(lines)  # running, in the only batch slot
            with b.stream("POST", "/v1/completions", json=long) as queued:
                assert queued.status_code == 200
                reader = threading.Thread(target=lambda: cut.extend(queued.iter_lines()))
                reader.start()
                small.signal(signal.SIGTERM)
                t0 = time.monotonic()
                # New work is turned away: a request that slips in before the port closes gets 503;
                # after, the connection is refused; one accepted just before the port closed but
                # not yet read when uvicorn closes its idle connections is closed unanswered (or
                # reset).  Either way the client is told, and no work is taken on.
                try:
                    refused = httpx.post(small.url + "/v1/completions", json={**short, "stream": False}, timeout=10)
                    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
                except (httpx.NetworkError, httpx.RemoteProtocolError):
                    pass
                events = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
                reader.join(timeout=60)
    # the running stream ran to its end
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 24
    # the long one was cut at the shutdown timeout, cleanly
    data = [line[6:] for line in cut if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "shutting_down"
    small.proc.wait(timeout=30)
    assert small.proc.returncode == 0, small.log_tail()
    assert time.monotonic() - t0 < SHUTDOWN_TIMEOUT + 15
    log = small.log()
    assert "Traceback" not in log
    assert "draining" in log and "ending 1 unfinished request" in log


def test_sigterm_while_the_model_loads_exits_0(tmp_path) -> None:  # noqa: ANN001
    """A SIGTERM while the model is still loading (a pod stopped during start-up) is an orderly
    stop: exit status 0, not an abort from finalizing the interpreter under the loader thread."""
    srv = launch_server("early", ["--threads", "1", "--kv-cache-gb", "0.1"], tmp_path / "early.log")
    try:
        wait_for(lambda: _health(srv) == 503, 120, "the port to answer while the model loads", interval=0.02)
        srv.signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0, srv.log_tail()
    finally:
        srv.stop(grace=5)
    log = srv.log()
    assert "terminate called" not in log and "Traceback" not in log
    assert "stopped while the model was loading" in log


def _health(srv: ServerProcess) -> int:
    try:
        return httpx.get(srv.url + "/health", timeout=2).status_code
    except httpx.TransportError:
        return 0
