"""One comparison run: each engine's server started, measured under every workload, and stopped.

For each engine ``EngineRun`` records start-up (launch to ``GET /health`` == 200), idle RSS and PSS
of the server's processes, peak RSS under load, and per workload the ``bench_serve`` metrics of every
run with the CPU other processes used meanwhile; ``summarize`` reduces repeated runs to medians.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from typing import Any, Optional

from benchmarks import bench_serve as bs
from benchmarks import harness
from benchmarks.bench_serve_prompts import Tokenizer
from benchmarks.compare_engines import STARTERS, STARTUP_TIMEOUT, wait_available
from benchmarks.compare_report import METRICS
from benchmarks.compare_workloads import Workload, workload_seed
from benchmarks.harness import ServerProcess


class EngineRun:
    """One engine's server through a comparison: start it, run workloads against it, stop it.

    ``res`` collects what the table and the JSON report: start-up, idle and peak RSS, and for each
    workload the metrics of every run (``repeats``) with their medians (see ``summarize``).
    """

    def __init__(self, engine: str, a: argparse.Namespace, index: int = 0) -> None:
        self.engine, self.a = engine, a
        self.port = a.port + index if a.port else 0  # --port P: P, P + 1, ... (with --interleave all are up at once)
        self.res: dict[str, Any] = {"engine": engine, "workloads": {}}
        self.runs: dict[str, list[dict]] = {}  # each workload's runs; res["workloads"] holds their summary
        self.srv: Optional[ServerProcess] = None
        self.sampler: Optional[harness.RssSampler] = None
        self.frozen = False

    def freeze(self, frozen: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) the whole server while others are measured: an idle
        server is not quiet (timers and pollers wake up), and on a 2-core host every wake-up
        preempts a thread of the engine under test."""
        if self.srv is not None and frozen != self.frozen:
            self.srv.signal_tree(signal.SIGSTOP if frozen else signal.SIGCONT)
            self.frozen = frozen

    @property
    def ok(self) -> bool:
        return self.srv is not None and "error" not in self.res

    def _fail(self, e: BaseException) -> None:
        self.res["error"] = f"{type(e).__name__}: {e}"
        print(f"[{self.engine}] error: {self.res['error']}", file=sys.stderr)

    def start(self) -> bool:
        """Launch, wait for /health, record start-up time and idle RSS; False (and ``res["error"]``) on failure."""
        engine, a, res = self.engine, self.a, self.res
        why = wait_available(engine, a)
        if why:
            res["error"] = why
            print(f"[{engine}] skipped: {why}", file=sys.stderr)
            return False
        port = self.port or harness.free_port()
        if harness.http_status(f"http://{harness.LOOPBACK}:{port}{harness.HEALTH_PATH}", 1.0):
            res["error"] = f"port {port} is already serving something"
            return False
        try:
            print(f"[{engine}] starting on port {port} ...", file=sys.stderr)
            self.srv = srv = STARTERS[engine](a, port)  # the vLLM starter converts the model first: not start-up time
            res["cmd"] = srv.cmd
            res["log"] = str(srv.log_path)
            res["startup_s"] = srv.wait_healthy(a.startup_timeout or STARTUP_TIMEOUT[engine])
            time.sleep(a.idle_wait)
            pids = srv.tree()
            rss, pss = harness.rss_bytes(pids)
            res["idle_rss_mb"] = rss / 2**20
            res["idle_pss_mb"] = pss / 2**20
            res["idle_processes"] = len(pids)
            print(f"[{engine}] healthy after {res['startup_s']:.2f} s; idle RSS {res['idle_rss_mb']:.0f} MB "
                  f"over {len(pids)} process(es)", file=sys.stderr)
            self.sampler = harness.RssSampler(srv.tree)
            self.sampler.start()
            return True
        except Exception as e:  # noqa: BLE001 - report and go on to the next engine
            self._fail(e)
            self.stop()
            return False

    def measure(self, index: int, w: Workload, repeat: int, prompts: list[str], tokenizer: Tokenizer) -> None:
        """One run of workload ``w`` (the ``index``-th of the comparison) on its ``repeat``-th prompt set."""
        if not self.ok:
            return
        a, srv = self.a, self.srv
        cfg = bs.BenchConfig(base_url=srv.url, model=a.served_name, num_prompts=len(prompts),
                             input_len=w.input_len, output_len=w.output_len, max_concurrency=w.concurrency,
                             seed=workload_seed(a.seed, index, repeat),
                             warmup=a.warmup if a.warmup >= 0 else min(w.concurrency, 4),
                             timeout=a.timeout, label=f"{self.engine} {w.title}",
                             extra_body=json.loads(a.extra_body) if a.extra_body else {})
        try:
            if not srv.alive():
                raise RuntimeError(f"{self.engine} died; log: {srv.log_path}\n{harness.tail(srv.log_path)}")
            noise = harness.NoiseMeter(srv)
            m = bs.run_benchmark_sync(cfg, tokenizer=tokenizer, prompts=prompts)
            m["other_cpu_cores"] = noise.cores()
        except Exception as e:  # noqa: BLE001 - report and go on to the next engine
            self._fail(e)
            return
        runs = self.runs.setdefault(w.name, [])
        runs.append(m)
        self.res["workloads"][w.name] = summarize(runs)
        if a.verbose:
            print(bs.format_report(m), file=sys.stderr)
        print(f"[{self.engine}] {w.title}{f' (run {repeat + 1})' if a.repeats > 1 else ''}: "
              f"{m['completed']}/{m['num_prompts']} ok, "
              f"{m['output_throughput']:.1f} tok/s, TPOT p50 {m['median_tpot_ms']:.1f} ms, "
              f"TTFT p50 {m['median_ttft_ms']:.0f} ms, other processes {m['other_cpu_cores']:.2f} cores"
              + (f", errors: {m['errors'][:2]}" if m["failed"] else ""),
              file=sys.stderr)

    def stop(self) -> None:
        self.freeze(False)  # a stopped process would not act on SIGTERM
        if self.sampler is not None:
            self.sampler.stop()
            self.res["peak_rss_mb"] = self.sampler.peak / 2**20
            self.sampler = None
        if self.srv is not None:
            self.srv.stop()
            self.srv = None


def summarize(runs: list[dict]) -> dict:
    """A workload's metrics over its runs: each table metric's median over the runs that completed
    requests (a single run stands for itself), counts summed, the other fields the last run's, every
    run kept under ``repeats``."""
    done = [m for m in runs if m["completed"]]
    out: dict[str, Any] = dict(runs[-1])
    for key in [k for k, _, _ in METRICS] + ["other_cpu_cores"]:
        vals = [m[key] for m in done if m.get(key) is not None]
        if vals:
            out[key] = statistics.median(vals)
    for key in ("completed", "failed", "num_prompts", "total_output_tokens"):
        out[key] = sum(m.get(key, 0) for m in runs)
    out["repeats"] = runs
    return out


def run_all(engines: list[str], a: argparse.Namespace, workloads: list[Workload],
            prompts: dict[str, list[list[str]]], tokenizer: Tokenizer) -> dict[str, dict]:
    """Every engine through every workload, ``a.repeats`` times each.  By default one engine at a
    time (started, measured, stopped); with ``a.interleave`` every server is started first and the
    engines take turns, run by run, so that each engine's runs meet the same spells of host noise
    (only one is ever running: the others wait frozen, see ``EngineRun.freeze``)."""
    runs = [EngineRun(e, a, i) for i, e in enumerate(engines)]

    def measure_all(group: list[EngineRun]) -> None:
        for i, w in enumerate(workloads):
            for rep in range(a.repeats):
                for r in group:
                    r.freeze(False)
                    r.measure(i, w, rep, prompts[w.name][rep], tokenizer)
                    r.freeze(len(group) > 1)

    try:
        if a.interleave:
            started = []
            for r in runs:  # each starts (and is timed) while the ones before it are frozen
                if r.start():
                    r.freeze(True)
                    started.append(r)
            measure_all(started)
        else:
            for r in runs:
                if r.start():
                    try:
                        measure_all([r])
                    finally:
                        r.stop()
    finally:
        for r in runs:
            r.stop()
    return {r.engine: r.res for r in runs}

