"""Attention kernel micro-benchmark: the torch ``ref`` kernel against each native ISA.

Shapes are the default model's attention (9 query heads, 3 kv heads, head_size 64,
bf16, block size 16) unless overridden.  Cases:

* decode: batch 1 and 32, context 256 and 2048 (one query token per request)
* prefill: one fresh prompt of 128 and of 1024 tokens
* kv write: ``reshape_and_cache`` of a decode batch and of a 1024-token prompt

Usage: ``python -m benchmarks.attention_kernels [--isas vec512,vec256] [--threads N] [--min-time 0.3]``.
Prints one line per (case, ISA): time per call and speedup over ``ref``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch

from engine.attention import dispatch
from engine.attention.kernels import ref
from engine.attention.metadata import CPUAttentionMetadata, metadata_from_lens
from engine.kv_cache.layout import allocate_kv_cache, kv_cache_torch_dtype


def _time(fn: Callable[[], None], min_time: float, max_iters: int = 2000) -> float:
    """Seconds per call: the best of 7 batches (timeit's rule: slower batches measure other
    processes and OpenMP threads that were descheduled, not the kernel)."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    per_batch = max(1, min(max_iters, int(min_time / 7 / one)))
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        best = min(best, (time.perf_counter() - t0) / per_batch)
    return best


def build_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    cache_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, CPUAttentionMetadata]:
    """A random batch over a cache in ``cache_dtype`` (default: the model dtype), written as the
    engine writes it (fp8: scale 0.5)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    cache_dtype = cache_dtype or dtype
    kv_cache = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype)
    rows = torch.randn(2, num_blocks * block_size, num_kv_heads, head_size, generator=g).to(dtype)
    fp8_scale = 0.5 if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else 1.0
    ref.reshape_and_cache(rows[0], rows[1], kv_cache, torch.arange(num_blocks * block_size), fp8_scale, fp8_scale)
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    k = 0
    for i, nb in enumerate(blocks_per_req):
        block_table[i, :nb] = perm[k : k + nb]
        k += nb
    meta = metadata_from_lens(q_lens, seq_lens, block_table)
    query = torch.randn(meta.num_actual_tokens, num_heads, head_size, generator=g).to(dtype)
    return query, kv_cache, meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isas", default="", help="comma-separated native ISAs (default: every one available)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds spent timing each case and ISA")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=sorted(dispatch.KV_CACHE_DTYPES))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cache_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, dtype)
    available = dispatch.available_isas()
    wanted = [s for s in args.isas.split(",") if s] or [i for i in dispatch.ISAS[:-1] if i in available]
    isas = [
        i
        for i in wanted
        if i in available and dispatch.supports(i, dtype, args.block_size, args.head_size, args.kv_cache_dtype)
    ]
    skipped = sorted(set(wanted) - set(isas))
    print(
        f"attention kernels: heads {args.heads}/{args.kv_heads} D={args.head_size} {args.dtype} "
        f"kv={args.kv_cache_dtype} block={args.block_size} threads={torch.get_num_threads()} "
        f"native={','.join(isas) or 'none'}" + (f" (unavailable: {','.join(skipped)})" if skipped else "")
    )
    H, Hkv, D, B = args.heads, args.kv_heads, args.head_size, args.block_size
    scale = D**-0.5
    k_scale = v_scale = 0.5 if args.kv_cache_dtype.startswith("fp8") else 1.0

    cases = [
        ("decode b=1 ctx=256", [1], [256]),
        ("decode b=1 ctx=2048", [1], [2048]),
        ("decode b=32 ctx=256", [1] * 32, [256] * 32),
        ("decode b=32 ctx=2048", [1] * 32, [2048] * 32),
        ("prefill 128", [128], [128]),
        ("prefill 1024", [1024], [1024]),
    ]
    print(f"{'case':<24}{'isa':<8}{'time/call':>12}{'vs ref':>9}{'max|diff|':>11}")
    for name, q_lens, seq_lens in cases:
        query, kv_cache, meta = build_batch(q_lens, seq_lens, H, Hkv, D, B, dtype, cache_dtype=cache_dtype)
        out_ref = torch.empty_like(query)

        def run_ref() -> None:
            dispatch.paged_attention("ref", query, kv_cache, meta, scale, args.kv_cache_dtype, k_scale, v_scale, out_ref)

        t_ref = _time(run_ref, args.min_time)
        print(f"{name:<24}{'ref':<8}{t_ref * 1e6:>10.1f}us{1.0:>8.2f}x{'':>11}")
        for isa in isas:
            out = torch.empty_like(query)

            def run_native(isa: str = isa, out: torch.Tensor = out) -> None:
                dispatch.paged_attention(isa, query, kv_cache, meta, scale, args.kv_cache_dtype, k_scale, v_scale, out)

            t = _time(run_native, args.min_time)
            diff = (out.float() - out_ref.float()).abs().max().item()
            print(f"{name:<24}{isa:<8}{t * 1e6:>10.1f}us{t_ref / t:>8.2f}x{diff:>11.2e}")

    for name, T in (("kv write 32 tokens", 32), ("kv write 1024 tokens", 1024)):
        g = torch.Generator().manual_seed(1)
        nb = -(-T // B) + 1
        kv_cache = allocate_kv_cache(nb, B, Hkv, D, cache_dtype)
        key = torch.randn(T, Hkv, D, generator=g).to(dtype)
        value = torch.randn(T, Hkv, D, generator=g).to(dtype)
        slots = torch.randperm(nb * B, generator=g)[:T].to(torch.int64)

        def write_ref() -> None:
            dispatch.reshape_and_cache("ref", key, value, kv_cache, slots, args.kv_cache_dtype, k_scale, v_scale)

        t_ref = _time(write_ref, args.min_time)
        print(f"{name:<24}{'ref':<8}{t_ref * 1e6:>10.1f}us{1.0:>8.2f}x{'':>11}")
        for isa in isas[:1]:  # one C++ implementation serves every ISA

            def write_native(isa: str = isa) -> None:
                dispatch.reshape_and_cache(isa, key, value, kv_cache, slots, args.kv_cache_dtype, k_scale, v_scale)

            t = _time(write_native, args.min_time)
            print(f"{name:<24}{'native':<8}{t * 1e6:>10.1f}us{t_ref / t:>8.2f}x{'':>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
