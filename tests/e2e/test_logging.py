"""--log-format json and X-Request-Id, through the real server: one JSON object per log line,
the client's request id echoed and on the lines about its request, prompts never logged."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from benchmarks.harness import ServerProcess

from .conftest import start_server
from .helpers import MODEL, wait_for

CANARY = "zebra-canary-7f3e91 tells a secret"


@pytest.fixture(scope="module")
def json_server(tmp_path_factory: pytest.TempPathFactory):
    # debug: the most the server ever logs (uvicorn's access lines included)
    srv = start_server("jsonlog", tmp_path_factory.mktemp("jsonlog"), "--kv-cache-gb", "0.2", "--threads", "1",
                       "--log-format", "json", "--log-level", "debug", "--shutdown-timeout", "5")
    yield srv
    srv.stop()


def log_records(server: ServerProcess) -> list[dict]:
    lines = [line for line in server.log().splitlines() if line.strip()]
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"not a JSON log line: {line!r}")
    return records


def finished_line(server: ServerProcess, request_id: str) -> dict:
    def found() -> bool:
        return any(r.get("request_id") == request_id and " finished:" in r["message"] for r in log_records(server))

    wait_for(found, 10, f"a 'finished' log line with request_id {request_id}")
    return next(r for r in log_records(server) if r.get("request_id") == request_id and " finished:" in r["message"])


def test_client_request_id_is_echoed_and_logged(json_server: ServerProcess) -> None:
    rid = "client-trace-4711:a/b"
    body = {"model": MODEL, "prompt": CANARY, "max_tokens": 3}
    r = httpx.post(json_server.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    line = finished_line(json_server, rid)
    assert set(line) >= {"time", "level", "logger", "message", "request_id"}
    assert line["level"] == "info" and line["logger"] == "service.requests"


def test_streamed_request_logged_with_its_id(json_server: ServerProcess) -> None:
    rid = "stream-0001"
    body = {"model": MODEL, "messages": [{"role": "user", "content": CANARY}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", json_server.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": rid},
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["x-request-id"] == rid
        assert any(line.startswith("data: [DONE]") for line in r.iter_lines())
    finished_line(json_server, rid)


def test_missing_or_unusable_id_is_replaced(json_server: ServerProcess) -> None:
    for headers in ({}, {"X-Request-Id": "has spaces and \"quotes\""}, {"X-Request-Id": "x" * 200}):
        r = httpx.post(json_server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                       headers=headers, timeout=60)
        assert r.status_code == 200
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"]), r.headers["x-request-id"]
        finished_line(json_server, r.headers["x-request-id"])


def test_errors_carry_the_request_id(json_server: ServerProcess) -> None:
    rid = "bad-request-42"
    r = httpx.post(json_server.url + "/v1/completions", json={"model": MODEL, "prompt": CANARY, "max_tokens": -1},
                   headers={"X-Request-Id": rid}, timeout=60)
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.headers["x-request-id"] == rid
    r = httpx.get(json_server.url + "/no/such/route", headers={"X-Request-Id": rid}, timeout=60)
    assert r.status_code == 404 and r.headers["x-request-id"] == rid


def test_every_line_is_json_and_no_prompt_is_logged(json_server: ServerProcess) -> None:
    httpx.post(json_server.url + "/v1/completions", json={"model": MODEL, "prompt": CANARY, "max_tokens": 2},
               timeout=60)
    records = log_records(json_server)  # fails on any line that is not one JSON object
    assert any(r["logger"].startswith("uvicorn") for r in records), "uvicorn's lines go through the same format"
    assert any("ready: serving" in r["message"] for r in records)
    assert CANARY not in json_server.log() and "zebra-canary" not in json_server.log()
