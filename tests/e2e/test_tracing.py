"""--otlp-traces-endpoint through the real server: a real OTLP/HTTP exporter sends each finished
request as an `llm_request` span with `queue`, `prefill` and `decode` children to a collector
(here a loopback HTTP server decoding the protobuf requests, as a collector would)."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import httpx
import pytest

from benchmarks.harness import ServerProcess, free_port, service_env

from .conftest import ROOT, start_server
from .helpers import MODEL, wait_for

pytest.importorskip("opentelemetry.sdk", reason="the optional tracing packages (requirements-otel.txt)")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402


class Collector:
    """Receives OTLP/HTTP protobuf trace exports on loopback and keeps their spans."""

    def __init__(self) -> None:
        self.spans: list = []
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                with outer.lock:
                    for rs in req.resource_spans:
                        for ss in rs.scope_spans:
                            outer.spans.extend((rs.resource, s) for s in ss.spans)
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:  # noqa: ANN002
                pass

        self.port = free_port()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def by_name(self, name: str) -> list:
        with self.lock:
            return [(r, s) for r, s in self.spans if s.name == name]


def attrs(span) -> dict:  # noqa: ANN001
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = (v.string_value if v.HasField("string_value") else v.int_value if v.HasField("int_value")
                       else v.double_value if v.HasField("double_value")
                       else [x.string_value for x in v.array_value.values])
    return out


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.httpd.shutdown()


@pytest.fixture(scope="module")
def traced_server(collector: Collector, tmp_path_factory: pytest.TempPathFactory):
    srv = start_server("traced", tmp_path_factory.mktemp("traced"), "--kv-cache-gb", "0.2", "--threads", "1",
                       "--otlp-traces-endpoint", f"http://127.0.0.1:{collector.port}/v1/traces",
                       env={"OTEL_BSP_SCHEDULE_DELAY": "200"})
    yield srv
    srv.stop()


def test_each_request_becomes_a_trace_of_queue_prefill_decode(traced_server: ServerProcess, collector: Collector) -> None:
    ids = {}
    for n in (3, 6):
        r = httpx.post(traced_server.url + "/v1/completions",
                       json={"model": MODEL, "prompt": "Tell me a story", "max_tokens": n, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text
        ids[r.json()["id"]] = r.json()["usage"]

    def roots() -> dict:
        return {attrs(s)["gen_ai.request.id"]: (res, s) for res, s in collector.by_name("llm_request")}

    wait_for(lambda: set(ids) <= set(roots()), 30, "an llm_request span per request at the collector")
    for rid, usage in ids.items():
        res, root = roots()[rid]
        a = attrs(root)
        assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        assert a["gen_ai.request.model"] == MODEL and a["gen_ai.response.finish_reasons"] == ["length"]
        assert "Tell me a story" not in str(a), "no prompt text in spans"
        assert {kv.key: kv.value.string_value for kv in res.attributes}["service.name"] == "cpuserve"

        def children() -> dict:
            return {s.name: s for name in ("queue", "prefill", "decode") for _, s in collector.by_name(name)
                    if s.trace_id == root.trace_id and s.parent_span_id == root.span_id}

        wait_for(lambda: len(children()) == 3, 10, f"queue/prefill/decode spans of {rid}")
        kids = children()
        assert kids["queue"].start_time_unix_nano == root.start_time_unix_nano
        assert kids["queue"].end_time_unix_nano == kids["prefill"].start_time_unix_nano
        assert kids["prefill"].end_time_unix_nano == kids["decode"].start_time_unix_nano
        assert kids["decode"].end_time_unix_nano == root.end_time_unix_nano
        assert kids["prefill"].end_time_unix_nano > kids["prefill"].start_time_unix_nano, "a prefill takes time"


def test_missing_exporter_is_one_clear_error() -> None:
    """With the flag but without the optional packages: exit 1 and what to install, at once."""
    code = ("import sys; sys.modules['opentelemetry.sdk'] = None; "
            "from service.__main__ import main; sys.exit(main(['--otlp-traces-endpoint', 'http://127.0.0.1:9/v1/traces',"
            " '--port', '0']))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=service_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "requirements-otel.txt" in out.stderr
