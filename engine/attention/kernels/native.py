"""Native attention kernels: the ``cpuserve_C`` extension's paged attention and KV-cache writes.

ISAs (``engine/csrc/attention.cpp``):

* ``vec256``: AVX2 + FMA + F16C, fp32 arithmetic (bf16 and fp8 widened on load).
* ``vec512``: AVX-512 F/BW/VL/DQ + AVX512_BF16: bf16 dot products with ``vdpbf16ps``
  (fp32 accumulation) for bf16 models, fp32 FMAs for fp32 models.  Where ``vdpbf16ps``
  is slow (Intel cores without AMX in use: one per ~2 cycles against two FMAs a cycle),
  bf16 models take fp32 FMAs on bf16 widened in registers instead; the kernel times
  both instructions once per process (``CPUSERVE_ATTN_BF16_DOT=dpbf16|fma`` overrides).
* ``amx``: AMX-BF16 tiles for Q K^T and P V (prefill tiles and decode GQA groups),
  bf16 models only; needs Sapphire Rapids or later and Linux's AMX permission.
  Work units of fewer than 4 query rows (``CPUSERVE_ATTN_AMX_MIN_ROWS``; decode of a
  3-head GQA group, say), and decode units (<= 8 rows) over an int8 cache, take the vec512 path.

All of them read fp8 (e4m3fn / e5m2) and int8 caches, dequantising on load, except the decode
paths over an int8 cache (units of <= 8 query rows): vec512's multiplies int8 queries and u8
probabilities with the int8 keys and values in VNNI dot products (``attention_vec512.h``),
vec256's widens the int8 rows to fp32 in registers as its bf16 path does bf16 ones.  The extension is
built once (``python -m engine.native``); without it every call runs the ``ref`` kernels.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from engine.attention.backends.cpu import CPUAttentionMetadata

HEAD_SIZES = frozenset({64, 80, 96, 128})
# "auto", "bfloat16", "float32": the model dtype (the C++ checks that the cache's matches).
KV_CACHE_DTYPES = frozenset({"auto", "bfloat16", "float32", "int8", "fp8_e4m3", "fp8_e5m2"})
# Block sizes: the kernels gather keys 32 at a time from any block size; AMX keeps
# whole 16-row tiles per block, the vector ISAs 8-key rows.
_BLOCK_MULTIPLE = {"amx": 16, "vec512": 8, "vec256": 8}
_MODEL_DTYPES = {"amx": (torch.bfloat16,), "vec512": (torch.bfloat16, torch.float32), "vec256": (torch.bfloat16, torch.float32)}


_UNSET: Any = object()
_ext_module: Any = _UNSET


def _ext() -> Any:
    """The extension when it has the attention kernels (built on first use), else None; kept in a
    module global since every layer of every step calls it."""
    global _ext_module
    if _ext_module is _UNSET:
        from engine import native

        _ext_module = native.module_with("paged_attention")
    return _ext_module


@functools.lru_cache(maxsize=1)
def available_isas() -> frozenset[str]:
    """Attention ISAs compiled into the extension that this CPU runs (empty without the extension)."""
    ext = _ext()
    if ext is None:
        return frozenset()
    from engine.attention.kernels.ops import cpu_flags

    flags = cpu_flags()
    compiled = set(ext.attention_isas())  # checked by the extension with cpuid (and AMX permission)
    isas = set()
    if {"avx2", "fma", "f16c"} <= flags and "vec256" in compiled:
        isas.add("vec256")
    if "vec256" in isas and {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= flags and "vec512" in compiled:
        isas.add("vec512")
    if "vec512" in isas and "amx" in compiled and ext.cpu_has_amx():
        isas.add("amx")
    return frozenset(isas)


def bf16_dot(isa: str, dtype: torch.dtype) -> Optional[str]:
    """How vec512 multiplies a bf16 model's bf16 values ("dpbf16" or "fma": the extension times both
    instructions once, on this call if not before); None where that does not apply."""
    if isa != "vec512" or dtype != torch.bfloat16 or _ext() is None:
        return None
    return _ext().attention_bf16_dot()


def supports(isa: str, dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str) -> bool:
    if isa not in _BLOCK_MULTIPLE:
        return False
    return (
        dtype in _MODEL_DTYPES[isa]
        and head_size in HEAD_SIZES
        and block_size > 0
        and block_size % _BLOCK_MULTIPLE[isa] == 0
        and kv_cache_dtype in KV_CACHE_DTYPES
    )


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
    """Same contract as ``ref.reshape_and_cache``: padding slots (< 0) are skipped."""
    _ext().reshape_and_cache(key, value, kv_cache, slot_mapping, float(k_scale), float(v_scale))


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
    """Same contract as ``ref.paged_attention`` (causal, query rows at the end of their context)."""
    if not meta.causal:
        from engine.attention.kernels import ref

        qsl = meta.query_start_loc_list if meta.query_start_loc_list is not None else meta.query_start_loc.tolist()
        sl = meta.seq_lens_list if meta.seq_lens_list is not None else meta.seq_lens.tolist()
        ref.paged_attention(query, kv_cache, qsl, sl, meta.block_table, scale, k_scale, v_scale, output, False)
        return
    _ext().paged_attention(
        isa,
        query,
        kv_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_table,
        meta.num_decodes,
        meta.max_query_len,
        meta.max_seq_len,
        float(scale),
        float(k_scale),
        float(v_scale),
        output,
    )


def run(
    isa: str,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    output: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Direct call without metadata (tests, benchmarks); ``isa`` may also be ``amx_emu``."""
    out = torch.empty_like(query) if output is None else output
    qsl = query_start_loc.tolist()
    q_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
    _ext().paged_attention(
        isa,
        query,
        kv_cache,
        query_start_loc,
        seq_lens,
        block_table,
        sum(1 for n in q_lens if n == 1),
        max(q_lens, default=0),
        int(seq_lens.max()) if seq_lens.numel() else 0,
        float(scale),
        float(k_scale),
        float(v_scale),
        out,
    )
    return out
