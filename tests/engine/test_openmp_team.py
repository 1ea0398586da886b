"""The native kernels keep their OpenMP threads from call to call (engine/csrc/work_spans.h: Team size).

A decode step's kernels want different thread counts (a small matmul two threads, a large one all
of them; a few rows of a norm fewer threads than many).  libgomp ends the pool threads that a
smaller team leaves out and starts new ones for the next bigger team, so kernels that asked for
their own team size made and ended threads at every call: batch-1 decode on a 16-core Xeon took
145 ms a step on 8 threads against 7.6 ms on 2.  Each case below alternates a call that wants two
threads with one that wants all four, after a warm-up, and checks that no thread came or went.
"""

from __future__ import annotations

import os
from typing import Callable

import pytest
import torch

from engine import sampler
from engine.layers import fused
from engine.quant import blocks as qblocks, weights as qweights

pytestmark = pytest.mark.skipif(not qweights.native_available(), reason="native extension unavailable")

THREADS = 4


def thread_ids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def packed(n: int, k: int) -> qweights.PackedWeight:
    g = torch.Generator().manual_seed(n)
    raw = torch.randint(0, 256, (n, k // 32, qblocks.BLOCK_BYTES["Q4_1"]), dtype=torch.uint8, generator=g)
    raw[..., 0:4] = torch.tensor([0.01, -0.08], dtype=torch.float16).view(torch.uint8)  # d, m
    return qweights.PackedWeight(qblocks.pack_blocks(raw.reshape(n, -1), "Q4_1", (n, k)), "Q4_1", (n, k))


def matmuls() -> list[Callable[[], object]]:
    """One decode row through the default model's o projection (two threads' work) and gate_up (all)."""
    o, gate_up = packed(576, 576), packed(3072, 576)
    x = torch.randn(1, 576, dtype=torch.bfloat16)
    return [lambda: o(x), lambda: gate_up(x)]


def norms() -> list[Callable[[], object]]:
    """RMSNorm over 2 rows (two threads) and 8 rows (four) of the same size."""
    a, b = torch.randn(2, 16384, dtype=torch.bfloat16), torch.randn(8, 4096, dtype=torch.bfloat16)
    wa, wb = torch.ones(16384, dtype=torch.bfloat16), torch.ones(4096, dtype=torch.bfloat16)
    return [lambda: fused.rms_norm(a, wa, 1e-6), lambda: fused.rms_norm(b, wb, 1e-6)]


def greedy() -> list[Callable[[], object]]:
    """Argmax over 8 rows (four each for two threads) and 16 rows (four threads)."""
    few, many = torch.randn(8, 49152), torch.randn(16, 49152)
    return [lambda: sampler.greedy_tokens(few), lambda: sampler.greedy_tokens(many)]


def sampled() -> list[Callable[[], object]]:
    """Top-p sampling of 2 rows and of 4."""
    op = sampler._native_op("sample_rows")
    assert op is not None

    def call(rows: int) -> Callable[[], object]:
        logits = torch.randn(rows, 49152)
        t, k = torch.ones(rows), torch.full((rows,), -1, dtype=torch.long)
        p, min_p, u = torch.full((rows,), 0.9), torch.zeros(rows), torch.full((rows,), 0.5)
        return lambda: op(logits, t, k, p, min_p, u)

    return [call(2), call(4)]


@pytest.mark.parametrize("case", [matmuls, norms, greedy, sampled], ids=lambda c: c.__name__)
def test_kernels_keep_their_threads(case: Callable[[], list[Callable[[], object]]]) -> None:
    saved = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        calls = case()
        for call in calls:  # warm-up: the team exists from here on
            call()
        before = thread_ids()
        seen = set(before)
        for _ in range(10):
            for call in calls:
                call()
                seen |= thread_ids()
    finally:
        torch.set_num_threads(saved)
    assert seen == before, f"{len(seen - before)} threads started during the calls"
