"""Continuous batching under concurrent streams, and client disconnects that free their KV blocks."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from .helpers import API_KEY, MODEL, metric, scrape, wait_for

PROMPTS = [
    "The quick brown fox", "In the beginning", "Python is a language", "My dog likes",
    "The ocean is", "Breakfast today was", "A good book", "The mountain was",
    "Tomorrow I will", "Music makes me", "The old house", "Stars at night",
]


def test_concurrent_streams_equal_each_request_alone(client: openai.OpenAI, aclient: openai.AsyncOpenAI) -> None:
    kw = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS]

    async def stream(prompt: str) -> tuple[str, float, float]:
        chunks = await aclient.completions.create(prompt=prompt, stream=True, **kw)
        text, first = "", None
        async for ch in chunks:
            first = first or time.monotonic()
            text += ch.choices[0].text
        return text, first, time.monotonic()

    async def all_at_once() -> list:
        return await asyncio.gather(*(stream(p) for p in PROMPTS))

    results = asyncio.run(all_at_once())
    assert [r[0] for r in results] == alone
    # They really ran together: every stream had its first token before any stream finished.
    assert max(r[1] for r in results) < min(r[2] for r in results)


def _running_and_kv(url: str) -> tuple[float, float]:
    s = scrape(url)
    return metric(s, "cpuserve:num_requests_running"), metric(s, "cpuserve:kv_cache_usage_ratio")


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_disconnect_aborts_and_frees_blocks(server, stream: bool) -> None:  # noqa: ANN001
    before = scrape(server.url)
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 500, "ignore_eos": True, "stream": stream}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if stream:
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()  # kept: dropping the iterator would close the connection
                next(line for line in lines if line.startswith("data: "))  # one token in: it is running
                running, kv = _running_and_kv(server.url)
                assert running == 1 and kv > 0
        # leaving the block closes the connection mid-stream
    else:
        with httpx.Client(base_url=server.url, headers=headers, timeout=httpx.Timeout(60, read=1.5)) as c:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json=body)
    closed = time.monotonic()
    wait_for(lambda: _running_and_kv(server.url) == (0, 0), timeout=5, what="the request to be aborted and its blocks freed")
    assert time.monotonic() - closed < 5
    after = scrape(server.url)
    aborted = metric(after, "cpuserve:requests_finished_total", finish_reason="abort")
    assert aborted == metric(before, "cpuserve:requests_finished_total", finish_reason="abort") + 1
    generated = metric(after, "cpuserve:generation_tokens_total")
    assert generated - metric(before, "cpuserve:generation_tokens_total") < 500
    time.sleep(0.5)
    assert metric(scrape(server.url), "cpuserve:generation_tokens_total") == generated, "generation went on"
