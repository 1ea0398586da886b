"""Run-time kernel dispatch: which ISA serves a configuration, and the calls that route to it.

The native kernels live in a C++ extension (``engine/attention/kernels/native.py``
builds it at first use).  When it is missing, fails to build, or does not cover a
configuration, everything runs on the portable ``ref`` kernels.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import torch

from engine.attention.kernels import native, ref

if TYPE_CHECKING:
    from engine.attention.backends.cpu import CPUAttentionMetadata

ISAS = ("amx", "vec512", "vec256", "ref")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """CPU feature flags of this host, from /proc/cpuinfo (empty when unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_isas() -> frozenset[str]:
    """ISAs the native extension was built with and this CPU can run; empty when there is none."""
    return native.available_isas()


def describe(isa: str, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> str:
    """``isa`` as the logs show it, with how it multiplies where that varies by CPU and cache:
    ``vec512 (bf16 products: fma; int8 KV decode: VNNI)``."""
    notes = []
    dot = native.bf16_dot(isa, dtype)
    if dot:
        notes.append(f"bf16 products: {dot}")
    if kv_cache_dtype == "int8" and int8_decode_path(isa):
        notes.append("int8 KV decode: " + ("fp32 FMA" if isa == "vec256" else "VNNI"))
    return f"{isa} ({'; '.join(notes)})" if notes else isa


def forced_isa_ceiling() -> str:
    """``CPUSERVE_ATTN_ISA`` (amx/vec512/vec256/ref): the highest ISA selection may pick (benchmarks, tests)."""
    forced = os.environ.get("CPUSERVE_ATTN_ISA", "").strip().lower()
    if forced and forced not in ISAS:
        raise ValueError(f"CPUSERVE_ATTN_ISA={forced!r}: expected one of {', '.join(ISAS)}")
    return forced or ISAS[0]


def int8_decode_path(isa: str) -> bool:
    """Whether ``isa`` decodes over an int8 cache reading its rows in place: vec512 multiplies them as
    int8 (VNNI; AMX hands it its decode units), vec256 widens them to fp32 in registers.  Other
    paths dequantise rows into tiles first, which costs more than the halved bytes save."""
    if isa in ("vec512", "amx"):
        return "avx512_vnni" in cpu_flags()
    return isa == "vec256"


def select_isa(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str) -> str:
    ceiling = forced_isa_ceiling()
    if ceiling == "ref":
        return "ref"
    isas = native_isas()
    if not isas:
        return "ref"
    from engine.attention.kernels import native

    for isa in ISAS[ISAS.index(ceiling) : -1]:
        if (
            isa in isas
            and native.supports(isa, dtype, block_size, head_size, kv_cache_dtype)
            and self_check(isa, dtype, block_size, head_size, kv_cache_dtype)
        ):
            return isa
    return "ref"


@functools.lru_cache(maxsize=None)
def self_check(isa: str, dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str) -> bool:
    """Run the kernel once on a small mixed batch and compare with ``ref`` before trusting it.

    A host-specific path (AMX above all, which only some production CPUs have) that
    misbehaves is then skipped with a warning instead of serving wrong tokens.  A few
    milliseconds, once per configuration and process.
    """
    import logging

    from engine.attention.backends.cpu import CPUAttentionMetadata, allocate_kv_cache, kv_cache_torch_dtype

    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, num_blocks = 4, 2, 8
    q_lens, seq_lens = [1, 1, 7, 5], [9, 40, 7, 37]  # two decodes, a fresh prompt, a chunk after context
    cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
    try:
        kv = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype)
        kv_rows = torch.randn(2, num_blocks * block_size, num_kv_heads, head_size, generator=gen) * 0.5
        ref.reshape_and_cache(kv_rows[0], kv_rows[1], kv, torch.arange(num_blocks * block_size), 1.0, 1.0)
        table = torch.randperm(num_blocks, generator=gen).to(torch.int32).repeat(len(seq_lens), 1)
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        query = torch.randn(qsl[-1], num_heads, head_size, generator=gen).to(dtype)
        meta = CPUAttentionMetadata(
            num_actual_tokens=qsl[-1], num_decodes=2, num_decode_tokens=2,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=table, slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64), max_query_len=max(q_lens),
            max_seq_len=max(seq_lens), query_start_loc_list=qsl, seq_lens_list=seq_lens,
        )
        scale = head_size**-0.5
        expected, got = torch.empty_like(query), torch.empty_like(query)
        paged_attention("ref", query, kv, meta, scale, kv_cache_dtype, 1.0, 1.0, expected)
        paged_attention(isa, query, kv, meta, scale, kv_cache_dtype, 1.0, 1.0, got)
        ok = torch.allclose(got.float(), expected.float(), atol=3e-2, rtol=3e-2)
        err = "" if ok else f"max difference {float((got.float() - expected.float()).abs().max()):.3g}"
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use this path
        ok, err = False, f"{type(exc).__name__}: {exc}"
    if not ok:
        logging.getLogger(__name__).warning(
            "attention kernel %s failed its start-up check against ref (%s); using a lower ISA", isa, err
        )
    return ok


def reshape_and_cache(
    isa: str,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: float,
    v_scale: float,
) -> None:
    if isa == "ref":
        ref.reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    else:
        native.reshape_and_cache(isa, key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def paged_attention(
    isa: str,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: "CPUAttentionMetadata",
    scale: float,
    kv_cache_dtype: str,
    k_scale: float,
    v_scale: float,
    output: torch.Tensor,
) -> None:
    if isa == "ref":
        qsl = meta.query_start_loc_list if meta.query_start_loc_list is not None else meta.query_start_loc.tolist()
        sl = meta.seq_lens_list if meta.seq_lens_list is not None else meta.seq_lens.tolist()
        ref.paged_attention(query, kv_cache, qsl, sl, meta.block_table, scale, k_scale, v_scale, output, meta.causal)
    else:
        native.paged_attention(isa, query, kv_cache, meta, scale, kv_cache_dtype, k_scale, v_scale, output)
