"""/metrics after traffic: per-step histograms first, then request metrics, counters and gauges."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai

from .conftest import start_server
from .helpers import MODEL, metric, scrape

STEP_HISTOGRAMS = [
    "cpuserve:step_schedule_seconds",
    "cpuserve:step_prepare_inputs_seconds",
    "cpuserve:step_kv_cache_update_seconds",
    "cpuserve:step_attention_seconds",
    "cpuserve:step_model_forward_seconds",
    "cpuserve:step_sampling_seconds",
    "cpuserve:step_detokenize_seconds",
    "cpuserve:step_duration_seconds",
    "cpuserve:step_tokens",
]
REQUEST_HISTOGRAMS = [
    "cpuserve:time_to_first_token_seconds",
    "cpuserve:inter_token_latency_seconds",
    "cpuserve:time_per_output_token_seconds",
    "cpuserve:e2e_request_latency_seconds",
    "cpuserve:request_queue_time_seconds",
    "cpuserve:request_prompt_tokens",
    "cpuserve:request_generation_tokens",
]
METRICS_TXT = Path(__file__).resolve().parents[2] / "deploy" / "metrics.txt"


def test_metrics_after_traffic(server, client: openai.OpenAI) -> None:  # noqa: ANN001
    before = scrape(server.url)
    r = client.completions.create(model=MODEL, prompt="Metrics please", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    list(client.completions.create(model=MODEL, prompt="and streamed", max_tokens=5, stream=True, extra_body={"ignore_eos": True}))
    after = scrape(server.url)

    def grew(name: str, by: float = 1, **labels: str) -> None:
        assert metric(after, name, **labels) - metric(before, name, absent=0.0, **labels) >= by, name

    for name in STEP_HISTOGRAMS:
        grew(name + "_count")
        assert metric(after, name + "_bucket", le="+Inf") == metric(after, name + "_count")
    assert metric(after, "cpuserve:step_duration_seconds_sum") >= metric(after, "cpuserve:step_model_forward_seconds_sum")
    for name in REQUEST_HISTOGRAMS:
        grew(name + "_count", 2 if name != "cpuserve:inter_token_latency_seconds" else 8)
    grew("cpuserve:prompt_tokens_total", r.usage.prompt_tokens)
    grew("cpuserve:generation_tokens_total", 10)
    grew("cpuserve:requests_finished_total", 2, finish_reason="length")
    grew("cpuserve:http_requests_total", 2, route="/v1/completions", status="200")
    for name in ("cpuserve:preemptions_total", "cpuserve:prefix_cache_queries_total", "cpuserve:prefix_cache_hits_total"):
        metric(after, name)
    assert metric(after, "cpuserve:num_requests_running") == 0
    assert metric(after, "cpuserve:num_requests_waiting") == 0
    assert 0 <= metric(after, "cpuserve:kv_cache_usage_ratio") <= 1
    assert metric(after, "cpuserve:kv_cache_blocks_resident") >= 1
    assert metric(after, "cpuserve:engine_healthy") == 1


def test_prefix_cache_hits_are_counted(server, http: httpx.Client) -> None:  # noqa: ANN001
    prompt = "A shared prefix that is long enough to fill more than one block of sixteen tokens, " * 3
    http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    before = scrape(server.url)
    http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    after = scrape(server.url)
    assert metric(after, "cpuserve:prefix_cache_hits_total") - metric(before, "cpuserve:prefix_cache_hits_total") >= 16


def test_metric_names_match_deploy_contract(server) -> None:  # noqa: ANN001
    """Every metric deploy/metrics.txt lists (dashboards and alerts use them) is exported, with its labels."""
    if not METRICS_TXT.exists():
        return
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for line in METRICS_TXT.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, kind, *labels = line.split()
        series = name + "_count" if kind == "histogram" else name
        assert f"# TYPE {name} {kind}" in text, name
        assert series + "{" in text, series
        for label in (labels[0].split(",") if labels else []):
            label_name = label.split("=")[0]
            assert f'{label_name}="' in text.split(series + "{", 1)[1].split("}", 1)[0] or any(
                f'{label_name}="' in ln for ln in text.splitlines() if ln.startswith(series + "{")
            ), f"{name} lacks label {label_name}"


def test_no_prefix_reserve_keeps_reusing_the_same_blocks(tmp_path: Path) -> None:
    """``--prefix-cache-gb 0``: one request after another runs in the blocks the previous one freed,
    so the cache's resident part stays at one request's blocks, and the latest prompt still hits."""
    srv = start_server("no-reserve", tmp_path, "--kv-cache-gb", "0.1", "--prefix-cache-gb", "0", "--threads", "1",
                       "--max-model-len", "1024")
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            for i in range(6):
                prompt = f"Request number {i} asks about something else entirely: " * 4  # ~60 tokens: 4-5 blocks
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                       "ignore_eos": True})
                assert r.status_code == 200, r.text
            used = -(-(r.json()["usage"]["prompt_tokens"] + 8) // 16)
            samples = scrape(srv.url)
            assert 1 <= metric(samples, "cpuserve:kv_cache_blocks_resident") <= used + 1
            before = metric(samples, "cpuserve:prefix_cache_hits_total")
            assert http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}).status_code == 200
            assert metric(scrape(srv.url), "cpuserve:prefix_cache_hits_total") - before >= 16
    finally:
        srv.stop()
