"""The engine alone across thread counts: batch-1 decode and N-stream throughput, as ratios to the
fewest threads.

Each thread count gets a fresh engine (``EngineConfig.num_threads``; start-up tuning included) and
the same workloads: one request at a time (the median decode step over ``--requests-1`` requests),
then ``--streams`` requests in flight out of ``--requests`` (closed loop, output tokens/s over the
whole run, prompts' prefill included).  Random prompt ids, exactly ``--output-len`` greedy tokens
(``ignore_eos``).  No HTTP: this is the model's own scaling, what the server's steps can reach.

    python -m benchmarks.scaling                              # 1, 2, 4, ... up to the CPUs
    python -m benchmarks.scaling --threads 2,8,16 --model /tmp/smollm2-random.gguf

On a machine that cannot take the default model, ``benchmarks/random_gguf.py`` writes a
random-weight copy of it that runs at the same speed.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

from benchmarks.vs_transformers import random_prompts
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams


def default_threads() -> list[int]:
    cpus = len(os.sched_getaffinity(0))
    counts = [1]
    while counts[-1] * 2 < cpus:
        counts.append(counts[-1] * 2)
    return counts + [cpus] if cpus > 1 else counts


def run(engine: LLMEngine, streams: int, prompts: list[list[int]], output_len: int) -> tuple[float, list[float]]:
    """(output tokens/s over the run, seconds of every decode-only step), ``streams`` requests in flight."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    sent = done = tokens = 0
    decode_steps: list[float] = []
    t0 = time.perf_counter()
    while done < len(prompts):
        while sent < len(prompts) and sent - done < streams:
            engine.add_request(f"r{sent}", prompts[sent], params)
            sent += 1
        _, stats, finished = engine.step()
        done += len(finished)
        if stats is not None:
            tokens += stats.num_generated_tokens
            if not stats.num_prefill_tokens:
                decode_steps.append(stats.total_s)
    return tokens / (time.perf_counter() - t0), decode_steps


def measure(threads: int, args: argparse.Namespace) -> dict[str, float]:
    engine = LLMEngine(EngineConfig(model=args.model, num_threads=threads))
    vocab = engine.model_config.vocab_size

    def prompts(n: int, seed: int) -> list[list[int]]:  # every run its own, so no prefix-cache hits
        return random_prompts(n, args.input_len, vocab, 3 * threads + seed)

    run(engine, 8, prompts(8, 0), 4)  # warm-up: kernels, allocator
    _, steps = run(engine, 1, prompts(args.requests_1, 1), args.output_len)
    rate, _ = run(engine, args.streams, prompts(args.requests, 2), args.output_len)
    del engine
    gc.collect()
    return {"step_ms": 1e3 * statistics.median(steps), "rate": rate}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="GGUF file, Hugging Face directory, or 'default'")
    ap.add_argument("--threads", default="", help="comma-separated thread counts (default: 1, 2, 4, ... up to the CPUs)")
    ap.add_argument("--streams", type=int, default=32, help="requests in flight for the throughput run")
    ap.add_argument("--requests", type=int, default=128, help="requests in the throughput run")
    ap.add_argument("--requests-1", type=int, default=2, help="requests in the batch-1 run")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args(argv)
    counts = [int(t) for t in args.threads.split(",")] if args.threads else default_threads()

    results = {}
    for t in counts:
        results[t] = measure(t, args)
        print(f"  {t} threads: batch-1 step {results[t]['step_ms']:.2f} ms, {args.streams} streams "
              f"{results[t]['rate']:.0f} tok/s", flush=True)
    base = results[counts[0]]
    vs = f"vs {counts[0]} thread{'s' if counts[0] > 1 else ''}"
    print(f"\n{args.input_len} in / {args.output_len} out, greedy, engine alone ({args.model})\n")
    print(f"| threads | batch-1 step (ms) | {vs} | {args.streams} streams (tok/s) | {vs} |")
    print("| --- | --- | --- | --- | --- |")
    for t, r in results.items():
        print(f"| {t} | {r['step_ms']:.2f} | {base['step_ms'] / r['step_ms']:.2f}x | {r['rate']:.0f} | "
              f"{r['rate'] / base['rate']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
