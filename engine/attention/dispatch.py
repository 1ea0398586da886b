"""The one place an attention kernel is chosen, and the calls that route to it.

ISAs, best first (kernels in ``engine/csrc/attention*.{cpp,h}``, the ``cpuserve_C`` extension):

* ``amx``: AMX-BF16 tiles for Q K^T and P V (prefill tiles and decode GQA groups), bf16 models
  only; needs AMX and Linux's permission for it.  Units of fewer query rows than
  ``CPUSERVE_ATTN_AMX_MIN_ROWS`` (default 4), and decode units over an int8 cache, run vec512's code.
* ``vec512``: AVX-512 F/BW/VL/DQ + BF16: bf16 dot products with ``vdpbf16ps`` or fp32 FMAs on
  widened bf16, whichever the extension times faster once per process (``CPUSERVE_ATTN_BF16_DOT``
  overrides); over an int8 cache, VNNI int8 products.
* ``vec256``: AVX2 + FMA + F16C, fp32 arithmetic (bf16, fp8 and int8 widened on load).
* ``ref``: the portable torch kernels (``kernels/ref.py``), for everything else.

Selection (``select_isa``): the best ISA at or below ``CPUSERVE_ATTN_ISA`` that the extension was
built with, this CPU runs, the configuration fits (``supports``) and that passes a start-up check
against ``ref`` (``self_check``).  The backend does this once per layer at construction; the
kernels then only run.  Without the extension everything runs on ``ref``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch

from engine import envs, platform
from engine.attention.kernels import ref
from engine.attention.metadata import CPUAttentionMetadata, metadata_from_lens
from engine.kv_cache.layout import allocate_kv_cache, kv_cache_torch_dtype

logger = logging.getLogger(__name__)

ISAS = ("amx", "vec512", "vec256", "ref")
HEAD_SIZES = frozenset({64, 80, 96, 128})
# "auto", "bfloat16", "float32": the model dtype (the C++ checks that the cache's matches).
KV_CACHE_DTYPES = frozenset({"auto", "bfloat16", "float32", "int8", "fp8_e4m3", "fp8_e5m2"})
# The kernels gather keys 32 at a time from any block size; AMX keeps whole 16-row tiles per
# block, the vector ISAs 8-key rows.
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
    """Native ISAs compiled into the extension that this CPU runs (empty without the extension)."""
    ext = _ext()
    if ext is None:
        return frozenset()
    return frozenset(ext.attention_isas())  # compiled in and run by this CPU: the extension's one check


def forced_isa_ceiling() -> str:
    """``CPUSERVE_ATTN_ISA`` (amx/vec512/vec256/ref): the highest ISA selection may pick (benchmarks, tests)."""
    forced = envs.CPUSERVE_ATTN_ISA
    if forced and forced not in ISAS:
        raise ValueError(f"CPUSERVE_ATTN_ISA={forced!r}: expected one of {', '.join(ISAS)}")
    return forced or ISAS[0]


def supports(isa: str, dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str) -> bool:
    """Whether native ``isa`` has a kernel for this model dtype, block size, head size and cache dtype."""
    if isa not in _BLOCK_MULTIPLE:
        return False
    return (
        dtype in _MODEL_DTYPES[isa]
        and head_size in HEAD_SIZES
        and block_size > 0
        and block_size % _BLOCK_MULTIPLE[isa] == 0
        and kv_cache_dtype in KV_CACHE_DTYPES
    )


def select_isa(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str) -> str:
    """The kernel for this configuration on this CPU: the best native ISA that fits and passes its self-check, else ``ref``."""
    ceiling = forced_isa_ceiling()
    if ceiling == "ref":
        return "ref"
    isas = available_isas()
    for isa in ISAS[ISAS.index(ceiling) : -1]:
        if (
            isa in isas
            and supports(isa, dtype, block_size, head_size, kv_cache_dtype)
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
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, num_blocks = 4, 2, 8
    q_lens, seq_lens = [1, 1, 7, 5], [9, 40, 7, 37]  # two decodes, a fresh prompt, a chunk after context
    cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
    try:
        kv = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype)
        kv_rows = torch.randn(2, num_blocks * block_size, num_kv_heads, head_size, generator=gen) * 0.5
        ref.reshape_and_cache(kv_rows[0], kv_rows[1], kv, torch.arange(num_blocks * block_size), 1.0, 1.0)
        table = torch.randperm(num_blocks, generator=gen).to(torch.int32).repeat(len(seq_lens), 1)
        meta = metadata_from_lens(q_lens, seq_lens, table)
        query = torch.randn(meta.num_actual_tokens, num_heads, head_size, generator=gen).to(dtype)
        scale = head_size**-0.5
        expected, got = torch.empty_like(query), torch.empty_like(query)
        paged_attention("ref", query, kv, meta, scale, kv_cache_dtype, 1.0, 1.0, expected)
        paged_attention(isa, query, kv, meta, scale, kv_cache_dtype, 1.0, 1.0, got)
        ok = torch.allclose(got.float(), expected.float(), atol=3e-2, rtol=3e-2)
        err = "" if ok else f"max difference {float((got.float() - expected.float()).abs().max()):.3g}"
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use this path
        ok, err = False, f"{type(exc).__name__}: {exc}"
    if not ok:
        logger.warning("attention kernel %s failed its start-up check against ref (%s); using a lower ISA", isa, err)
    return ok


def int8_decode_path(isa: str) -> bool:
    """Whether ``isa`` decodes over an int8 cache reading its rows in place: vec512 multiplies them as
    int8 (VNNI; AMX hands it its decode units), vec256 widens them to fp32 in registers.  Other
    paths dequantise rows into tiles first, which costs more than the halved bytes save."""
    if isa in ("vec512", "amx"):
        return platform.has("avx512_vnni")
    return isa == "vec256"


def int8_decodes_in_place(dtype: torch.dtype, block_size: int, head_size: int) -> bool:
    """Whether the kernel chosen for an int8 cache of this shape reads its rows in place
    (what ``kv_cache.layout.resolve_kv_cache_dtype`` needs to resolve ``auto``)."""
    return int8_decode_path(select_isa(dtype, block_size, head_size, "int8"))


def bf16_dot(isa: str, dtype: torch.dtype) -> Optional[str]:
    """How vec512 multiplies a bf16 model's bf16 values ("dpbf16" or "fma": the extension times both
    instructions once, on this call if not before); None where that does not apply."""
    if isa != "vec512" or dtype != torch.bfloat16 or _ext() is None:
        return None
    return _ext().attention_bf16_dot()


def describe(isa: str, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> str:
    """``isa`` as the logs show it, with how it multiplies where that varies by CPU and cache:
    ``vec512 (bf16 products: fma; int8 KV decode: VNNI)``."""
    notes = []
    dot = bf16_dot(isa, dtype)
    if dot:
        notes.append(f"bf16 products: {dot}")
    if kv_cache_dtype == "int8" and int8_decode_path(isa):
        notes.append("int8 KV decode: " + ("fp32 FMA" if isa == "vec256" else "VNNI"))
    return f"{isa} ({'; '.join(notes)})" if notes else isa


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
    """Write ``key``/``value`` ([num_tokens, num_kv_heads, head_size]) into their slots of ``kv_cache``;
    padding slots (< 0) are skipped.  ``kv_cache_dtype`` is the native path's check (the cache tensor's
    dtype decides the storage)."""
    if isa == "ref":
        ref.reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    else:
        _ext().reshape_and_cache(key, value, kv_cache, slot_mapping, float(k_scale), float(v_scale))


def paged_attention(
    isa: str,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: CPUAttentionMetadata,
    scale: float,
    kv_cache_dtype: str,
    k_scale: float,
    v_scale: float,
    output: torch.Tensor,
) -> None:
    """Attend ``query`` ([num_tokens, num_heads, head_size]) over each request's paged context into
    ``output`` (same shape): causal unless ``meta.causal`` is False, query rows at the end of their
    context.  Non-causal batches run on ``ref``.

    The native kernel's plan for the batch (metadata validated and cut into work units) is built by
    the first layer's call and kept in ``meta.plans`` for the others, by ISA: every layer of a model
    has the same heads and cache shape, which the kernel checks against the plan on each call.
    """
    if isa == "ref" or not meta.causal:
        qsl, sl = meta.query_start_locs(), meta.seq_lens_host()
        ref.paged_attention(query, kv_cache, qsl, sl, meta.block_table, scale, k_scale, v_scale, output, meta.causal)
        return
    ext = _ext()
    plan = meta.plans.get(isa)
    if plan is None:
        plan = meta.plans[isa] = ext.attention_plan(
            isa, query.shape[1], query.shape[0], kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table
        )
    ext.paged_attention_planned(
        plan,
        query,
        kv_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_table,
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
    """A native kernel called directly, without metadata or selection (tests, benchmarks);
    ``isa`` may also be ``amx_emu`` (the AMX code on emulated tiles) or a name the extension rejects."""
    out = torch.empty_like(query) if output is None else output
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
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
