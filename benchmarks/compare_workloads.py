"""The comparison's workloads: named shapes of traffic and the prompts each one runs.

A workload is input length / output length / concurrency; ``compare.py --workloads`` takes names
from ``DEFAULT_WORKLOADS`` or custom ``IN:OUT:C`` entries.  Every engine gets the same prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.bench_serve_prompts import Tokenizer, build_prompts

@dataclass
class Workload:
    """``concurrency`` streams of ``input_len``-token prompts asking for ``output_len`` tokens each."""

    name: str
    input_len: int
    output_len: int
    concurrency: int

    @property
    def title(self) -> str:
        return f"{self.input_len}/{self.output_len} c={self.concurrency}"


DEFAULT_WORKLOADS = {
    "c1": Workload("c1", 128, 128, 1),
    "c16": Workload("c16", 128, 128, 16),
    "c32": Workload("c32", 128, 128, 32),
    "long": Workload("long", 1024, 32, 4),
    "long2": Workload("long2", 1024, 32, 2),
}
# The per-shape table (--model): batch-1 TPOT, 16-stream throughput, and 1024-token-prompt TTFT at
# concurrency 2 (fewer streams than "long": a 1B model's prompts take 8x the bundled model's work).
SHAPE_WORKLOADS = "c1,c16,long2"


def workload_seed(seed: int, index: int, repeat: int = 0) -> int:
    """The prompt seed of the ``index``-th workload of a run (its ``repeat``-th run).  Every workload,
    and every repeat of one, gets prompts of its own: every engine here caches prefixes, and a
    workload whose prompts repeated an earlier one's would run partly out of that cache."""
    return seed + 7919 * index + 104729 * repeat


def workload_prompts(tokenizer: Tokenizer, workloads: list[Workload], num_prompts: int, seed: int,
                     repeats: int = 1) -> dict[str, list[list[str]]]:
    """Each workload's prompt sets, one per repeat (``num_prompts`` each, or ``max(8, 4 x concurrency)`` when 0)."""
    return {
        w.name: [build_prompts(tokenizer, num_prompts or max(8, 4 * w.concurrency), w.input_len,
                                  workload_seed(seed, i, r)) for r in range(repeats)]
        for i, w in enumerate(workloads)
    }


def parse_workloads(spec: str) -> list[Workload]:
    """Names from DEFAULT_WORKLOADS, or custom ``IN:OUT:C`` entries, comma-separated."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item in DEFAULT_WORKLOADS:
            out.append(DEFAULT_WORKLOADS[item])
        else:
            try:
                i, o, c = (int(x) for x in item.split(":"))
            except ValueError:
                raise SystemExit(f"bad workload {item!r}: use {','.join(DEFAULT_WORKLOADS)} or IN:OUT:CONCURRENCY")
            out.append(Workload(f"{i}x{o}c{c}", i, o, c))
    return out

