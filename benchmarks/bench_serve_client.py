"""One streaming completion request, timed chunk by chunk, and its inter-token latencies.

The client is kept light because it shares the host's cores with the server it measures (its CPU
time is taken from the server's; HISTORY.md has the httpx vs aiohttp measurement): the caller's
``aiohttp.ClientSession`` (its HTTP parser is C), a hand-rolled SSE line splitter and one
``json.loads`` per chunk; token counting and ITL are worked out after the run.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from benchmarks.bench_serve_prompts import Tokenizer


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
