"""Memory pressure, cancellation at every stage, and 10x overload, on a deliberately small server.

The server ("tight"): a 24-block KV cache (384 tokens; a context is 256), 4 sequences per batch,
8 waiting at most, 64 tokens per step (a long prompt takes several steps to prefill), float32
(greedy outputs do not depend on the batch), and CPUSERVE_TEST_FAULTS=1 for the marker that
slows a request's steps (to cancel it mid-prefill).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from benchmarks.harness import ServerProcess, rss_bytes
from service import faults

from .conftest import start_server
from .helpers import API_KEY, MODEL, metric, scrape, wait_for

MAX_NUM_SEQS = 4
MAX_QUEUE = 8
KV_CACHE_GB = 0.0165  # 24 blocks of 16 tokens (fp32 K/V of SmolLM2: 720 KiB per block)
# The ceiling service/README.md documents for the bundled model in float32: 2 GiB plus the KV cache
# (measured: ~1.15 GiB idle after start, ~1.6 GiB after long batches, 1.8 GiB peak while loading).
RSS_CEILING_MIB = 2048 + KV_CACHE_GB * 1024
RSS_GROWTH_MIB = 200  # over the overload run, after the tests before it warmed the allocator up


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(
        "tight",
        tmp_path_factory.mktemp("tight"),
        "--threads", "1",
        "--dtype", "float32",
        "--kv-cache-gb", str(KV_CACHE_GB),
        "--max-model-len", "256",
        "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-queue", str(MAX_QUEUE),
        "--max-num-batched-tokens", "64",
        "--shutdown-timeout", "5",
        env={faults.ENV: "1"},
    )
    yield srv
    srv.stop()


def aborted(url: str) -> float:
    return metric(scrape(url), "cpuserve:requests_finished_total", finish_reason="abort")


def idle(url: str) -> bool:
    s = scrape(url)
    return (metric(s, "cpuserve:num_requests_running"), metric(s, "cpuserve:num_requests_waiting"),
            metric(s, "cpuserve:kv_cache_blocks_used")) == (0, 0, 0)


def rss_mib(pid: int) -> float:
    rss = rss_bytes({pid}, pss=False)[0]
    assert rss, f"no VmRSS for {pid}: the server is gone"
    return rss / 2**20


def complete(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=300)


def choices_of(url: str, bodies: list[dict], headers: dict | None = None) -> list[dict]:
    """Run the bodies concurrently; every one must finish by length with all its tokens."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: complete(url, b, headers), bodies))
    out = []
    for body, r in zip(bodies, responses):
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["choices"][0]["finish_reason"] == "length", data
        assert data["usage"]["completion_tokens"] == body["max_tokens"]
        out.append(data["choices"][0])
    return out


def texts_of(url: str, bodies: list[dict], headers: dict | None = None) -> list[str]:
    return [c["text"] for c in choices_of(url, bodies, headers)]


def assert_same_greedy(a: dict, b: dict, tie: float = 0.05) -> None:
    """Two greedy choices (with ``logprobs``) give the same tokens, or part where both runs saw a
    near-tie: each one's token is the other's runner-up by less than ``tie`` nats there.  Batches
    of different shapes round differently, so a near-tie may break either way; anything else
    (a wrong KV cache after recompute, say) picks tokens far down the other run's ranking."""
    ta, tb = a["logprobs"]["tokens"], b["logprobs"]["tokens"]
    assert len(ta) == len(tb)
    for i, (x, y) in enumerate(zip(ta, tb)):
        if x == y:
            continue
        top_a, top_b = a["logprobs"]["top_logprobs"][i], b["logprobs"]["top_logprobs"][i]
        assert y in top_a and x in top_b, f"token {i}: {x!r} vs {y!r}, not near-ties ({top_a} / {top_b})"
        assert top_a[x] - top_a[y] < tie and top_b[y] - top_b[x] < tie, f"token {i}: {x!r} vs {y!r} ({top_a} / {top_b})"
        return  # the texts go their own ways from here


# --------------------------------------------------------------------------------------------------
# Memory pressure
# --------------------------------------------------------------------------------------------------


def test_small_kv_cache_preempts_and_recomputes_with_the_same_greedy_text(tight: ServerProcess, server: ServerProcess) -> None:
    """Five requests needing 41 blocks on a 24-block cache (any four of them need 28 or more), one of
    them nearly a whole context: preemption and recompute, no error, and the same greedy tokens as
    on the session server's 0.5 GiB cache (up to a near-tie, see assert_same_greedy)."""
    greedy = {"model": MODEL, "temperature": 0, "ignore_eos": True, "logprobs": 5}
    bodies = [{**greedy, "prompt": p, "max_tokens": 100} for p in
              ("The history of tea", "def parse(line):", "Dear diary, today", "Ten facts about owls:")]
    bodies.append({**greedy, "prompt": "Write a long essay about the sea.", "max_tokens": 230})
    before = scrape(tight.url)
    squeezed = choices_of(tight.url, bodies)
    after = scrape(tight.url)
    assert metric(after, "cpuserve:preemptions_total") > metric(before, "cpuserve:preemptions_total"), "no preemption"
    roomy = choices_of(server.url, bodies, {"Authorization": f"Bearer {API_KEY}"})
    for a, b in zip(squeezed, roomy):
        assert_same_greedy(a, b)
    wait_for(lambda: idle(tight.url), 10, "every block back in the pool")


# --------------------------------------------------------------------------------------------------
# Cancellation at every stage
# --------------------------------------------------------------------------------------------------

BACKGROUND = [
    {"model": MODEL, "prompt": "The printing press changed Europe because", "max_tokens": 120, "temperature": 0, "ignore_eos": True},
    {"model": MODEL, "prompt": "A simple recipe for bread:", "max_tokens": 120, "temperature": 0, "ignore_eos": True},
]
# Holders keep batch slots busy; their slowed steps (0.25 s) keep them from finishing too soon.
HOLD = {"model": MODEL, "prompt": f"Count: {faults.SLOW_STEP}", "max_tokens": 60, "ignore_eos": True, "stream": True}


def _stream_reader(url: str, body: dict, events: list, close: threading.Event) -> None:
    """Stream ``body``, appending each event, until ``close`` is set (then drop the connection)."""
    with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if close.is_set():
                return


class RawStream:
    """A streaming request on a bare socket: read what came, stop reading, reset the connection."""

    def __init__(self, port: int, body: dict) -> None:
        payload = json.dumps(body).encode()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(payload) + payload
        )
        self.received = b""

    def read_available(self, wait: float = 0.3) -> bytes:
        self.sock.settimeout(wait)
        try:
            while chunk := self.sock.recv(65536):
                self.received += chunk
        except (TimeoutError, socket.timeout):
            pass
        return self.received

    def reset(self) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
        self.sock.close()


def test_cancellation_at_every_stage_frees_blocks_and_leaves_other_outputs_unchanged(tight: ServerProcess) -> None:
    """A client that goes away while queued, mid-prefill, mid-decode (streaming or not) or while its
    stream is being written: aborted, its blocks freed; two greedy requests running all along give
    the same text as without the cancellations."""
    url = tight.url
    baseline = texts_of(url, BACKGROUND)
    wait_for(lambda: idle(url), 10, "idle after the baseline")

    with ThreadPoolExecutor(len(BACKGROUND)) as pool:
        background = [pool.submit(complete, url, b) for b in BACKGROUND]
        wait_for(lambda: metric(scrape(url), "cpuserve:num_requests_running") == 2, 30, "the background requests running")
        n0 = aborted(url)

        # 1. queued: two holders fill the batch; a third stream waits; its client resets the connection.
        holders = [([], threading.Event()) for _ in range(2)]
        threads = [threading.Thread(target=_stream_reader, args=(url, HOLD, ev, cl)) for ev, cl in holders]
        for t in threads:
            t.start()
        wait_for(lambda: all(ev for ev, _ in holders), 30, "the holders streaming")
        assert metric(scrape(url), "cpuserve:num_requests_running") == MAX_NUM_SEQS
        queued = RawStream(tight.port, {**HOLD, "prompt": "Queued"})
        wait_for(lambda: metric(scrape(url), "cpuserve:num_requests_waiting") == 1, 30, "a waiting request")
        assert b"data: {" not in queued.read_available()
        queued.reset()
        wait_for(lambda: aborted(url) == n0 + 1, 15, "the queued request aborted")

        # 2. decode, streaming: the holders' clients go away between two events.
        for _, close in holders:
            close.set()
        for t in threads:
            t.join(timeout=30)
        wait_for(lambda: aborted(url) == n0 + 3, 15, "the holders aborted mid-decode")
        assert all(0 < len(ev) < HOLD["max_tokens"] for ev, _ in holders)

        # 3. prefill: a 200-token prompt, 62 tokens a step, each step slowed; gone after the first chunk.
        prompt = "word " * 200 + faults.SLOW_STEP
        prompt_len = httpx.post(url + "/tokenize", json={"prompt": prompt}).json()["count"]
        prefilled = metric(scrape(url), "cpuserve:prompt_tokens_total")
        cut = RawStream(tight.port, {**HOLD, "prompt": prompt, "max_tokens": 8})
        wait_for(lambda: metric(scrape(url), "cpuserve:prompt_tokens_total") > prefilled, 30, "prefill started")
        assert b"data: {" not in cut.read_available(0.05)
        cut.reset()
        wait_for(lambda: aborted(url) == n0 + 4, 15, "the request aborted mid-prefill")
        assert metric(scrape(url), "cpuserve:prompt_tokens_total") - prefilled < prompt_len, "its prefill was not cut short"

        # 4. decode, non-streaming: the client gives up waiting for the whole answer.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={**HOLD, "stream": False, "max_tokens": 100},
                       timeout=httpx.Timeout(30, read=1.5))
        wait_for(lambda: aborted(url) == n0 + 5, 15, "the non-streaming request aborted")

        # 5. while its stream is being written: the client stops reading, then resets the connection.
        writing = RawStream(tight.port, {**HOLD, "max_tokens": 100})
        wait_for(lambda: b"data: {" in writing.read_available(0.1), 30, "the stream writing")
        time.sleep(1.0)  # events pile up, unread, in the socket buffers
        writing.reset()
        wait_for(lambda: aborted(url) == n0 + 6, 15, "the reset stream aborted")

        outputs = [f.result(timeout=300) for f in background]
    assert [r.json()["choices"][0]["text"] for r in outputs] == baseline, "cancellations changed other outputs"
    wait_for(lambda: idle(url), 10, "every block back in the pool")
    assert aborted(url) == n0 + 6


# --------------------------------------------------------------------------------------------------
# Overload
# --------------------------------------------------------------------------------------------------


async def _http_post(port: int, body: dict) -> tuple[int, dict[str, str], bytes]:
    """One POST on its own connection (Connection: close): a client light enough that 120 of them in
    one process measure the server, not httpx's pool (which adds seconds at this concurrency)."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(payload) + payload
        )
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, rest


def test_ten_times_overload_answers_every_request_and_stays_bounded(tight: ServerProcess) -> None:
    """120 clients (10x the 4 running + 8 waiting it admits), retrying 0.2 s after a 429, for 12 s:
    far more than ten times what it serves.  Each answer is 32 tokens so that what it serves stays
    well under a tenth of what the clients offer even on a fast host (8-token answers left the
    margin at ~10x on CI and made the check flaky).  Each request gets its full answer or an immediate 429
    with Retry-After; nothing hangs, nothing crashes, admitted latency stays bounded, memory holds."""
    url, port = tight.url, tight.port
    clients, duration = 10 * (MAX_NUM_SEQS + MAX_QUEUE), 12.0
    answer_tokens = 32
    wait_for(lambda: idle(url), 10, "idle before the overload")
    rss_before = rss_mib(tight.proc.pid)
    rejected_before = metric(scrape(url), "cpuserve:requests_rejected_total", reason="queue_full")
    results: list[tuple[int, float, str]] = []  # (status, seconds, problem or "")

    async def one(i: int) -> int:
        stream = i % 3 == 0
        body = {"model": MODEL, "prompt": f"Client {i} says", "max_tokens": answer_tokens, "ignore_eos": True, "stream": stream}
        t0 = time.monotonic()
        status, headers, raw = await _http_post(port, body)
        problem = ""
        if status == 200 and stream:
            if b"data: [DONE]" not in raw or raw.count(b'"finish_reason":"length"') != 1:
                problem = f"incomplete stream: {raw[-300:]!r}"
        elif status == 200:
            if json.loads(raw)["usage"]["completion_tokens"] != answer_tokens:
                problem = f"incomplete answer: {raw[:300]!r}"
        elif status == 429:
            if json.loads(raw)["error"]["code"] != "queue_full" or not headers.get("retry-after", "").isdigit():
                problem = f"429 without Retry-After or OpenAI's body: {headers} {raw[:300]!r}"
        else:
            problem = f"unexpected {status}: {raw[:300]!r}"
        results.append((status, time.monotonic() - t0, problem))
        return status

    async def drive() -> None:
        deadline = time.monotonic() + duration

        async def client(i: int) -> None:
            while time.monotonic() < deadline:
                if await one(i) == 429:
                    await asyncio.sleep(0.2)

        await asyncio.gather(*(client(i) for i in range(clients)))

    asyncio.run(drive())
    problems = [p for _, _, p in results if p]
    assert not problems, problems[:5]
    ok = sorted(t for s, t, _ in results if s == 200)
    rejected = sorted(t for s, t, _ in results if s == 429)
    print(f"overload: {len(results)} sent in {duration:g}s, {len(ok)} served (max {ok[-1]:.2f}s), "
          f"{len(rejected)} got 429 (median {rejected[len(rejected) // 2]:.3f}s, max {rejected[-1]:.3f}s), "
          f"RSS {rss_before:.0f} -> {rss_mib(tight.proc.pid):.0f} MiB")
    assert len(results) >= 10 * len(ok), f"not an overload: {len(results)} sent, {len(ok)} served"
    # admitted: at most 12 ahead of it, 32 tokens each -- a few batches' worth; 429s: at once
    assert ok[-1] < 30, f"an admitted request took {ok[-1]:.1f}s"
    assert rejected[len(rejected) // 2] < 0.5 and rejected[-1] < 5, f"429s not immediate: {rejected[-5:]}"
    assert metric(scrape(url), "cpuserve:requests_rejected_total", reason="queue_full") - rejected_before == len(rejected)
    wait_for(lambda: idle(url), 15, "idle after the overload")
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    rss_after = rss_mib(tight.proc.pid)
    assert rss_after < RSS_CEILING_MIB, f"resident memory {rss_after:.0f} MiB over the documented ceiling"
    assert rss_after - rss_before < RSS_GROWTH_MIB, f"resident memory grew {rss_after - rss_before:.0f} MiB"
