#!/usr/bin/env python
"""Soak test: mixed traffic against a cpuserve server for a set time, then account for every request.

Loopback only, and bounded: ``--duration`` seconds of traffic (at most a day), at most
``--max-requests`` requests, at most ``--concurrency`` in flight (each one given up after
``--request-timeout`` s).  Without ``--base-url`` it starts its own server (``python -m service`` on a
free loopback port, a small KV cache and queue so memory pressure, preemption and 429s happen),
stops it with SIGTERM at the end and checks that it exits 0.

Traffic, each client looping: streaming and plain completions and chat completions (greedy and
sampled, ``n`` = 1 or 2, stop strings, logprobs), cancellations (streams closed after a few events or
before the first, plain requests given up after a random delay), and bad requests (malformed JSON, a
wrong type, token ids outside the vocabulary, a lone surrogate, a prompt over the context, ``n`` too
large, an unknown model, a wrong content type, a missing API key, a body over the size limit).  A
client turned away with 429 waits 0.1-1 s before its next request.

Every request ends in exactly one outcome:

- completed: 200 and a complete answer (every choice has a finish reason; a stream ends in ``[DONE]``)
- rejected:  429 (with ``Retry-After``) or 503: the server turned it away at once, as designed
- cancelled: the client went away on purpose (the server must abort it and free its blocks)
- refused:   a bad request answered with the expected 4xx in OpenAI's error shape
- errored:   a 5xx, an error event in a stream, or a bad request answered wrongly
- lost:      no answer within ``--request-timeout``, or a connection that broke mid-answer

Printed at the end (and written as JSON with ``--json-out``): those counts, KV-cache blocks still in
use once the server is idle, the server's resident memory at start, peak and end, and TTFT
percentiles of streamed requests.  Exit status 1 if anything was lost or errored, blocks were left
in use, ``/health`` failed during the run, or the server it started did not exit 0.

    python benchmarks/soak.py --duration 600                     # own server, 10 minutes
    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --api-key KEY --server-pid PID
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import secrets
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Sequence

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from benchmarks.soak_traffic import OUTCOMES, Stats, Traffic  # noqa: E402

MAX_DURATION_S = 24 * 3600
MAX_CONCURRENCY = 512
# The server this script starts: small enough that preemption and 429s happen at the default concurrency.
DEFAULT_SERVER_ARGS = (
    "--threads 1 --max-model-len 512 --kv-cache-gb 0.02 --max-num-seqs 8 --max-queue 16 "
    "--max-num-batched-tokens 256 --shutdown-timeout 10"
)


# --------------------------------------------------------------------------------------------------
# The server: started here, or given
# --------------------------------------------------------------------------------------------------


def check_loopback(url: str) -> None:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"error: --base-url must be a loopback address (127.0.0.1, ::1, localhost), not {host!r}")


def server_args(api_key: str, extra_args: Sequence[str]) -> list[str]:
    """The flags of the server this script starts.  "--api-key=KEY": token_urlsafe keys start with
    "-" one time in 64, which argparse would read as an option and refuse ("expected one argument")."""
    return [f"--api-key={api_key}", *extra_args]


def server_rss(pid: Optional[int]) -> Optional[int]:
    """The server's resident memory in bytes; None for a server this script did not start, or gone."""
    return None if pid is None else harness.rss_bytes({pid}, pss=False)[0] or None


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """``/metrics`` -> {sample name with labels but model_name: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = await client.get("/metrics")
    resp.raise_for_status()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def wait_idle(client: httpx.AsyncClient, timeout: float) -> dict[str, float]:
    """Metrics once nothing runs or waits (aborts land between engine steps), or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        m = await scrape(client)
        idle = m.get("cpuserve:num_requests_running", 1) == 0 and m.get("cpuserve:num_requests_waiting", 1) == 0
        if (idle and m.get("cpuserve:kv_cache_blocks_used", 0) == 0) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.25)


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


async def soak(args: argparse.Namespace, base_url: str, api_key: Optional[str], pid: Optional[int],
               log: Any) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(args.request_timeout)) as client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        model = (await client.get("/v1/models", headers=headers)).json()["data"][0]
        traffic = Traffic(client, model["id"], api_key, model["max_model_len"], args.request_timeout)
        before = await scrape(client)
        rss_start = server_rss(pid)
        stats = Stats()
        health_failures: list[str] = []
        rss_peak = [rss_start or 0]
        t_start = time.monotonic()
        deadline = t_start + args.duration

        async def worker(i: int) -> None:
            rng = random.Random(args.seed * 100_003 + i)
            while time.monotonic() < deadline and stats.sent < args.max_requests:
                stats.sent += 1
                stats.in_flight += 1
                try:
                    rec = await traffic.run(traffic.pick(rng), rng)
                    stats.add(rec)
                finally:
                    stats.in_flight -= 1
                if rec.outcome == "rejected":  # a polite client: back off for part of Retry-After (1 s)
                    await asyncio.sleep(rng.uniform(0.1, 1.0))

        async def monitor() -> None:
            last_report = time.monotonic()
            while True:
                await asyncio.sleep(2)
                try:
                    r = await client.get("/health", timeout=10)
                    if r.status_code != 200:
                        health_failures.append(f"{time.monotonic() - t_start:.0f}s: {r.status_code}")
                except httpx.HTTPError as exc:
                    health_failures.append(f"{time.monotonic() - t_start:.0f}s: {type(exc).__name__}")
                rss = server_rss(pid)
                if rss:
                    rss_peak[0] = max(rss_peak[0], rss)
                if time.monotonic() - last_report >= args.progress_every:
                    last_report = time.monotonic()
                    c = stats.counts()
                    print(f"[{time.monotonic() - t_start:6.0f}s] sent {stats.sent} "
                          + " ".join(f"{k} {c.get(k, 0)}" for k in OUTCOMES)
                          + (f" rss {rss / 2**20:.0f} MiB" if rss else ""), file=log, flush=True)

        mon = asyncio.create_task(monitor())
        try:
            await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
        finally:
            mon.cancel()
        traffic_s = time.monotonic() - t_start
        after = await wait_idle(client, timeout=60)
        rss_end = server_rss(pid)

    counts = stats.counts()
    ttfts = [r.ttft_s for r in stats.records if r.ttft_s is not None]
    completed_lat = [r.latency_s for r in stats.records if r.outcome == "completed"]
    rejected_lat = [r.latency_s for r in stats.records if r.outcome == "rejected"]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    problems = [f"{r.kind}: {r.outcome} {r.status or ''} {r.detail}" for r in stats.records
                if r.outcome in ("errored", "lost")]
    return {
        "duration_s": round(traffic_s, 1),
        "concurrency": args.concurrency,
        "seed": args.seed,
        "sent": stats.sent,
        **{k: counts.get(k, 0) for k in OUTCOMES},
        "accounted": sum(counts.values()),
        "kv_blocks_in_use_end": int(after.get("cpuserve:kv_cache_blocks_used", -1)),
        "running_end": int(after.get("cpuserve:num_requests_running", -1)),
        "waiting_end": int(after.get("cpuserve:num_requests_waiting", -1)),
        "rss_start_mib": round(rss_start / 2**20, 1) if rss_start else None,
        "rss_peak_mib": round(rss_peak[0] / 2**20, 1) if rss_peak[0] else None,
        "rss_end_mib": round(rss_end / 2**20, 1) if rss_end else None,
        "ttft_p50_s": _round(harness.percentile(ttfts, 50)),
        "ttft_p99_s": _round(harness.percentile(ttfts, 99)),
        "completed_latency_p99_s": _round(harness.percentile(completed_lat, 99)),
        "completed_latency_max_s": _round(max(completed_lat, default=None)),
        "rejected_latency_max_s": _round(max(rejected_lat, default=None)),
        "health_failures": health_failures,
        "by_kind": {k: dict(Counter(r.outcome for r in stats.records if r.kind == k))
                    for k in sorted({r.kind for r in stats.records})},
        "server": {
            "finished": {reason: delta(f"cpuserve:requests_finished_total{{finish_reason={reason}}}")
                         for reason in ("stop", "length", "abort", "error")},
            "rejected": {reason: delta(f"cpuserve:requests_rejected_total{{reason={reason}}}")
                         for reason in ("queue_full", "invalid", "unauthorized", "too_large")},
            "preemptions": delta("cpuserve:preemptions_total"),
            "generation_tokens": delta("cpuserve:generation_tokens_total"),
        },
        "problems": problems[:50],
    }


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 3)


def report(r: dict[str, Any]) -> str:
    def mib(x: Optional[float]) -> str:
        return "n/a" if x is None else f"{x:.0f} MiB"

    def sec(x: Optional[float]) -> str:
        return "n/a" if x is None else f"{x:.3f} s"

    lines = [
        f"soak: {r['duration_s']:.0f} s of traffic, concurrency {r['concurrency']}, seed {r['seed']}",
        f"  requests sent        {r['sent']}",
        f"  completed            {r['completed']}",
        f"  rejected (429/503)   {r['rejected']}",
        f"  cancelled by client  {r['cancelled']}",
        f"  refused (bad input)  {r['refused']}",
        f"  errored              {r['errored']}",
        f"  lost                 {r['lost']}   (must be 0)",
        f"  accounted for        {r['accounted']} of {r['sent']}",
        f"  KV blocks in use end {r['kv_blocks_in_use_end']}   (must be 0)",
        f"  resident memory      start {mib(r['rss_start_mib'])}, peak {mib(r['rss_peak_mib'])}, end {mib(r['rss_end_mib'])}",
        f"  TTFT (streams)       p50 {sec(r['ttft_p50_s'])}, p99 {sec(r['ttft_p99_s'])}",
        f"  completed latency    p99 {sec(r['completed_latency_p99_s'])}, max {sec(r['completed_latency_max_s'])}",
        f"  429/503 latency max  {sec(r['rejected_latency_max_s'])}",
        f"  /health failures     {len(r['health_failures'])}",
        f"  server: finished {r['server']['finished']}, preemptions {r['server']['preemptions']:.0f}, "
        f"rejected {r['server']['rejected']}",
    ]
    if "server_exit_status" in r:
        lines.append(f"  server exit status   {r['server_exit_status']} after SIGTERM (must be 0)")
        lines.append(f"  server log errors    {r['server_log_errors']} (ERROR / CRITICAL lines, tracebacks)")
    for p in r["problems"][:10]:
        lines.append(f"  problem: {p}")
    return "\n".join(lines)


def failures(r: dict[str, Any]) -> list[str]:
    out = []
    if r["lost"]:
        out.append(f"{r['lost']} request(s) lost")
    if r["errored"]:
        out.append(f"{r['errored']} request(s) errored")
    if r["accounted"] != r["sent"]:
        out.append(f"{r['sent'] - r['accounted']} request(s) unaccounted for")
    if r["kv_blocks_in_use_end"] != 0:
        out.append(f"{r['kv_blocks_in_use_end']} KV block(s) still in use")
    if r["health_failures"]:
        out.append(f"/health failed {len(r['health_failures'])} time(s)")
    if r.get("server_exit_status", 0) != 0:
        out.append(f"the server exited with {r['server_exit_status']} after SIGTERM")
    if r.get("server_log_errors", 0):
        out.append(f"{r['server_log_errors']} error line(s) in the server log")
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running server (loopback only); default: start one")
    p.add_argument("--api-key", help="the running server's API key (with --base-url)")
    p.add_argument("--server-pid", type=int, help="the running server's pid, for its resident memory (with --base-url)")
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                   help="flags for the server this script starts (default: %(default)s)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=32, help="clients, each one request at a time (default: %(default)s)")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="stop sending after this many (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="a request with no complete answer after this many seconds is lost (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--progress-every", type=float, default=30.0, help="seconds between progress lines on stderr")
    p.add_argument("--json-out", help="write the figures here as JSON")
    p.add_argument("--server-log", help="where the started server logs (default: a temporary file)")
    a = p.parse_args(argv)
    if not 0 < a.duration <= MAX_DURATION_S:
        p.error(f"--duration must be in (0, {MAX_DURATION_S}]")
    if not 1 <= a.concurrency <= MAX_CONCURRENCY:
        p.error(f"--concurrency must be in [1, {MAX_CONCURRENCY}]")
    if a.max_requests < 1 or a.request_timeout <= 0:
        p.error("--max-requests and --request-timeout must be positive")
    if a.base_url:
        check_loopback(a.base_url)
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    server: Optional[harness.ServerProcess] = None
    result: dict[str, Any]
    try:
        if args.base_url:
            base_url, api_key, pid = args.base_url.rstrip("/"), args.api_key, args.server_pid
        else:
            api_key = secrets.token_urlsafe(16)
            log_path = Path(args.server_log) if args.server_log else Path(tempfile.mkstemp(prefix="soak-server-", suffix=".log")[1])
            print(f"starting the server (log: {log_path}) ...", file=sys.stderr, flush=True)
            server = harness.launch_service("soak", server_args(api_key, args.server_args.split()), log_path)
            server.wait_healthy(args.startup_timeout, interval=0.5)
            base_url, pid = server.url, server.pid
        print(f"soaking {base_url} for {args.duration:g}s at concurrency {args.concurrency} ...", file=sys.stderr, flush=True)
        result = asyncio.run(soak(args, base_url, api_key, pid, sys.stderr))
        if server is not None:
            result["server_exit_status"] = server.stop(grace=60)
            log_text = server.log()
            result["server_log_errors"] = sum(1 for line in log_text.splitlines()
                                              if " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback"))
            server = None
    finally:
        if server is not None:
            server.stop(grace=15)
    print(report(result))
    bad = failures(result)
    result["ok"] = not bad
    result["failures"] = bad
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    if bad:
        print("FAILED: " + "; ".join(bad))
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
