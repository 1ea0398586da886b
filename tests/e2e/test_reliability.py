"""Hostile input, schemathesis, and engine faults, on a server of its own with test-only faults on.

The server runs with ``CPUSERVE_TEST_FAULTS=1`` (service/faults.py): a prompt holding a marker
makes its engine steps raise, or kills the engine loop.  A short context (64 tokens) keeps every
generation short.  The tests run in file order: the last one kills the engine, and with it the
server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.harness import ServerProcess
from service import faults

from .conftest import ROOT, start_server
from .helpers import MODEL, metric, scrape, sse_events, wait_for

MAX_MODEL_LEN = 64
VOCAB = 49152  # SmolLM2's
JSON = {"Content-Type": "application/json"}
GOOD = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(
        "reliability",
        tmp_path_factory.mktemp("reliability"),
        "--threads", "1",
        "--dtype", "float32",
        "--kv-cache-gb", "0.1",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", "32",
        "--shutdown-timeout", "5",
        env={faults.ENV: "1"},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(fuzz: ServerProcess):
    with httpx.Client(base_url=fuzz.url, timeout=120) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and body["error"]["type"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def assert_healthy(url: str) -> None:
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    r = httpx.post(url + "/v1/completions", json=GOOD, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text


def nested(depth: int, open_: bytes, close: bytes) -> bytes:
    return b'{"model": "%s", "prompt": "a", "stop": ' % MODEL.encode() + open_ * depth + b"1" + close * depth + b"}"


def raw(body: dict) -> bytes:
    return json.dumps(body).encode()


M = MODEL.encode()
# (id, path, body bytes, headers, status, param)
HOSTILE = [
    ("lone high surrogate in a prompt", "/v1/completions", b'{"model": "%s", "prompt": "ab\\ud800cd"}' % M, JSON, 400, None),
    ("lone low surrogate in a chat message", "/v1/chat/completions",
     b'{"model": "%s", "messages": [{"role": "user", "content": "x\\udfff"}]}' % M, JSON, 400, None),
    ("reversed surrogate pair", "/v1/completions", b'{"model": "%s", "prompt": "\\ude00\\ud83d"}' % M, JSON, 400, None),
    ("lone surrogate in a stop string", "/v1/completions", b'{"model": "%s", "prompt": "a", "stop": ["\\ud800"]}' % M, JSON, 400, None),
    ("lone surrogate to /tokenize", "/tokenize", b'{"prompt": "\\udbff"}', JSON, 400, None),
    ("invalid UTF-8", "/v1/completions", b'{"model": "%s", "prompt": "\xff\xfe\xc0"}' % M, JSON, 400, None),
    ("10 MB body", "/v1/completions", raw({**GOOD, "prompt": "x" * 10_000_000}), JSON, 413, None),
    ("100,000 token ids", "/v1/completions", raw({**GOOD, "prompt": [100] * 100_000}), JSON, 400, "prompt"),
    ("token id = vocab size", "/v1/completions", raw({**GOOD, "prompt": [1, VOCAB]}), JSON, 400, "prompt"),
    ("negative token id", "/v1/completions", raw({**GOOD, "prompt": [-1]}), JSON, 400, "prompt"),
    ("token id 2**64", "/v1/completions", raw({**GOOD, "prompt": [[5], [2**64]]}), JSON, 400, "prompt"),
    ("token id outside the vocabulary to /detokenize", "/detokenize", raw({"tokens": [3, 10**20]}), JSON, 400, "tokens"),
    ("logit_bias key not a number", "/v1/completions", raw({**GOOD, "logit_bias": {"banana": 1}}), JSON, 400, "logit_bias"),
    ("logit_bias key a float", "/v1/completions", raw({**GOOD, "logit_bias": {"1.5": 1}}), JSON, 400, "logit_bias"),
    ("logit_bias key empty", "/v1/completions", raw({**GOOD, "logit_bias": {"": 1}}), JSON, 400, "logit_bias"),
    ("logit_bias key negative", "/v1/completions", raw({**GOOD, "logit_bias": {"-3": 1}}), JSON, 400, "logit_bias"),
    ("logit_bias key huge", "/v1/completions", raw({**GOOD, "logit_bias": {str(10**30): 1}}), JSON, 400, "logit_bias"),
    ("n = 10,000", "/v1/completions", raw({**GOOD, "n": 10_000}), JSON, 400, "n"),
    ("n = 10,000 in chat", "/v1/chat/completions",
     raw({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 10_000}), JSON, 400, "n"),
    ("max_tokens = 10**9", "/v1/completions", raw({**GOOD, "max_tokens": 10**9}), JSON, 400, "max_tokens"),
    ("max_tokens = 10**9 in chat", "/v1/chat/completions",
     raw({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}), JSON, 400, "max_tokens"),
    ("300 stop strings", "/v1/completions", raw({**GOOD, "stop": [f"stop{i}" for i in range(300)]}), JSON, 400, "stop"),
    ("seed beyond 64 bits", "/v1/completions", raw({**GOOD, "seed": 10**30}), JSON, 400, "seed"),
    ("NaN temperature", "/v1/completions", b'{"model": "%s", "prompt": "a", "temperature": NaN}' % M, JSON, 400, "temperature"),
    ("infinite logit bias", "/v1/completions", b'{"model": "%s", "prompt": "a", "logit_bias": {"5": Infinity}}' % M, JSON, 400, "logit_bias"),
    ("arrays nested 100,000 deep", "/v1/completions", nested(100_000, b"[", b"]"), JSON, 400, None),
    ("objects nested 50,000 deep", "/v1/completions", nested(50_000, b'{"a": ', b"}"), JSON, 400, None),
    ("content type text/plain", "/v1/completions", raw(GOOD), {"Content-Type": "text/plain"}, 415, None),
    ("content type form", "/v1/completions", b"model=x&prompt=y", {"Content-Type": "application/x-www-form-urlencoded"}, 415, None),
    ("content type multipart", "/v1/chat/completions", b"--b\r\n\r\nx\r\n--b--", {"Content-Type": "multipart/form-data; boundary=b"}, 415, None),
    ("content type XML to /tokenize", "/tokenize", b"<prompt>x</prompt>", {"Content-Type": "application/xml"}, 415, None),
]


@pytest.mark.parametrize("path,body,headers,status,param", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_input_gets_a_clear_4xx(fuzz: ServerProcess, http: httpx.Client, path, body, headers, status, param) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    assert_error(http.post(path, content=body, headers=headers), status, param)
    assert time.monotonic() - t0 < 30, "refusing it took too long"
    assert httpx.get(fuzz.url + "/health", timeout=30).status_code == 200


def test_control_characters_are_text_not_errors(fuzz: ServerProcess, http: httpx.Client) -> None:
    """C0/C1 controls, NUL, DEL, bidi overrides, a BOM and emoji are valid text: 200, echoed intact."""
    prompt = "".join(chr(c) for c in range(32)) + "\x7f\x85\u200b\u202e\ufeff\U0001f600 end"
    r = http.post("/v1/completions", json={**GOOD, "prompt": prompt, "echo": True, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith(prompt)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "\x00\x1b[31m\u202e\ufeff"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    tok = http.post("/tokenize", json={"prompt": prompt})  # the tokenizer may drop a few C0 controls
    assert tok.status_code == 200 and tok.json()["count"] > 0
    assert http.post("/detokenize", json={"tokens": tok.json()["tokens"]}).status_code == 200


def test_extreme_but_valid_values_are_served(fuzz: ServerProcess, http: httpx.Client) -> None:
    """Values an int64 tensor cannot hold are clamped where that means the same (top_k), never a 500."""
    for extra in ({"top_k": 10**30, "temperature": 1.0}, {"priority": -(10**30)}, {"seed": -(2**63), "temperature": 1.0},
                  {"stop": [f"s{i}" for i in range(64)]}, {"logit_bias": {str(VOCAB - 1): -100}}):
        r = http.post("/v1/completions", json={**GOOD, **extra})
        assert r.status_code == 200, (extra, r.text)
    assert_healthy(fuzz.url)


def test_schemathesis_finds_no_5xx_and_no_schema_violation(fuzz: ServerProcess, tmp_path: Path) -> None:
    """Schemathesis on the server's own OpenAPI schema: no 5xx, responses match the schema.

    Not run: ``positive_data_acceptance``: the schema states types, not the value ranges and
    cross-field rules the engine enforces (context length, vocabulary, ``min_tokens <= max_tokens``),
    so schema-valid requests can rightly get a 400.
    """
    st = Path(sys.executable).with_name("st")
    cmd = [
        str(st), "run", fuzz.url + "/openapi.json",
        *[arg for p in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize") for arg in ("--include-path", p)],
        "--checks", "all", "--exclude-checks", "positive_data_acceptance",
        "--max-examples", os.environ.get("CPUSERVE_SCHEMATHESIS_EXAMPLES", "25"),
        "--generation-deterministic", "--workers", "1", "--request-timeout", "60",
        "--phases", "coverage,fuzzing", "--no-color", "--warnings", "off",
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.e2e.schemathesis_hooks", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-8000:]
    assert "generated" in out and " passed" in out, out[-3000:]
    assert httpx.get(fuzz.url + "/health", timeout=30).status_code == 200
    wait_for(lambda: metric(scrape(fuzz.url), "cpuserve:kv_cache_blocks_used") == 0, 30, "every KV block back in the pool")


def test_a_failing_step_is_a_500_and_the_engine_keeps_serving(fuzz: ServerProcess, http: httpx.Client) -> None:
    before = scrape(fuzz.url)
    bad = {**GOOD, "prompt": f"Say hi {faults.FAIL_STEP}"}
    err = assert_error(http.post("/v1/completions", json=bad), 500)
    assert err["type"] == "server_error" and "InjectedStepError" in err["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": faults.FAIL_STEP}], "max_tokens": 4}
    assert_error(http.post("/v1/chat/completions", json=chat), 500)
    with http.stream("POST", "/v1/completions", json={**bad, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error", events
    after = scrape(fuzz.url)
    failed = metric(after, "cpuserve:requests_finished_total", finish_reason="error")
    assert failed - metric(before, "cpuserve:requests_finished_total", finish_reason="error") == 3
    assert metric(after, "cpuserve:engine_healthy") == 1
    assert metric(after, "cpuserve:kv_cache_blocks_used") == 0
    assert_healthy(fuzz.url)
    assert "Traceback" in fuzz.log() and "engine step failed" in fuzz.log()  # logged for the operator


def test_engine_loop_death_ends_streams_turns_health_503_and_exits_nonzero(fuzz: ServerProcess) -> None:
    """The last test here: the server is gone afterwards."""
    slow = {"model": MODEL, "prompt": f"Tell a story {faults.SLOW_STEP}", "max_tokens": 40, "ignore_eos": True}
    streamed: list = []

    def stream() -> None:
        with httpx.Client(base_url=fuzz.url, timeout=60) as c, c.stream("POST", "/v1/completions", json={**slow, "stream": True}) as r:
            streamed.extend(sse_events(r.iter_lines()))

    plain: list[httpx.Response] = []
    reader = threading.Thread(target=stream)
    waiter = threading.Thread(target=lambda: plain.append(httpx.post(fuzz.url + "/v1/completions", json=slow, timeout=60)))
    reader.start()
    waiter.start()
    wait_for(lambda: metric(scrape(fuzz.url), "cpuserve:num_requests_running") == 2, 30, "two running requests")
    t0 = time.monotonic()
    kill = httpx.post(fuzz.url + "/v1/completions", json={**GOOD, "prompt": faults.KILL_ENGINE}, timeout=60)
    assert kill.status_code in (500, 503), kill.text
    reader.join(timeout=30)
    waiter.join(timeout=30)
    assert not reader.is_alive() and not waiter.is_alive(), "a request hung after the engine died"
    assert time.monotonic() - t0 < 10
    # the stream: some tokens, then an error event, then [DONE]
    assert streamed[-1] == "[DONE]" and streamed[-2]["error"]["code"] == "engine_dead", streamed[-3:]
    assert_error(plain[0], 503)
    # /health says so until the process goes (it waits a moment for probes to see it)
    saw_503 = False
    while fuzz.proc.poll() is None and time.monotonic() - t0 < 30:
        try:
            status = httpx.get(fuzz.url + "/health", timeout=5).status_code
            assert status == 503
            saw_503 = True
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    assert saw_503
    fuzz.proc.wait(timeout=30)
    assert fuzz.proc.returncode == 3, fuzz.log_tail()
    log = fuzz.log()
    assert "engine loop died" in log and "exit status 3" in log
