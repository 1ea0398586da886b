"""Native attention kernels (engine/csrc/attention*.{cpp,h}) against the torch reference.

Every native ISA this CPU runs is checked against ``ref`` on random mixed batches:
decodes, a fresh prompt, a prompt chunk after cached context and long contexts over
many blocks, for bf16/fp32 models, bf16/fp32/fp8/int8 caches, GQA and block sizes.  The
AMX path runs for real only on AMX hosts (Sapphire Rapids+); elsewhere ``amx_emu``
runs the same tile code on a software model of the tiles.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine import platform
from engine.attention import dispatch
from engine.attention.backends.cpu import CPUAttentionBackendImpl, _get_attn_isa
from engine.attention.kernels import ref
from engine.attention.metadata import metadata_from_lens
from engine.kv_cache.layout import allocate_kv_cache, int8_row_scales
from tests import ROOT

NATIVE = dispatch.available_isas()
COMPILED = set(dispatch._ext().attention_isas()) if NATIVE else set()
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
QUANT = {**FP8, "int8": torch.int8}

pytestmark = pytest.mark.skipif(not NATIVE, reason="native extension unavailable (no compiler/ninja, or CPUSERVE_NATIVE=0)")


# "vec512" runs with its bf16 products pinned to dpbf16, "vec512_fma" to FMAs on widened bf16: the
# kernel picks one per CPU (attention.cpp, bf16_with_fma), and both must match the reference.
def _base(isa: str) -> str:
    return "vec512" if isa == "vec512_fma" else isa


def _need(isa: str) -> None:
    isa = _base(isa)
    if isa == "amx_emu":
        if isa not in COMPILED:
            pytest.skip("amx_emu needs AVX-512 BF16")
        return
    if isa not in NATIVE:
        why = "AMX-BF16 (Sapphire Rapids or later) with Linux AMX permission" if isa == "amx" else isa.upper()
        pytest.skip(f"{isa} kernels need {why}; this CPU lacks it")


@pytest.fixture
def threads():
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


# (query_len, seq_len): decodes first, then a fresh prompt, a chunk after cached
# context, and a longer chunk over a context spanning many blocks.
MIXED = [(1, 1), (1, 17), (1, 300), (1, 1500), (20, 20), (17, 100), (70, 700)]


def random_cache(num_blocks, Hkv, B, D, cache_dtype, g):
    """Standard-normal K and V; an int8 cache gets them through the reference write (with scales)."""
    if cache_dtype != torch.int8:
        return torch.randn(num_blocks, Hkv, B, 2 * D, generator=g).to(cache_dtype)
    kv = allocate_kv_cache(num_blocks, B, Hkv, D, torch.int8)
    rows = torch.randn(2, num_blocks * B, Hkv, D, generator=g)
    ref.reshape_and_cache(rows[0], rows[1], kv, torch.arange(num_blocks * B), 1.0, 1.0)
    return kv


def whole_rows(cache: torch.Tensor) -> torch.Tensor:
    """The cache's rows with whatever follows them (an int8 cache's scales): [blocks, heads, block, row stride]."""
    nb, hkv, b, _ = cache.shape
    return torch.as_strided(cache, (nb, hkv, b, cache.stride(2)), (cache.stride(0), cache.stride(1), cache.stride(2), 1))


def clone_cache(cache: torch.Tensor) -> torch.Tensor:
    nb, hkv, b, two_d = cache.shape
    out = allocate_kv_cache(nb, b, hkv, two_d // 2, cache.dtype)
    whole_rows(out).copy_(whole_rows(cache))
    return out


def make_case(q_seq, H, Hkv, D, B, dtype, cache_dtype, seed=0, q_scale=2.0, strided_query=True):
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-s // B) for _, s in q_seq]
    num_blocks = sum(nblocks) + 3
    kv = random_cache(num_blocks, Hkv, B, D, cache_dtype, g)
    perm = torch.randperm(num_blocks, generator=g)
    bt = torch.full((len(q_seq), max(nblocks) + 2), 0, dtype=torch.int32)
    k = 0
    for i, nb in enumerate(nblocks):
        bt[i, :nb] = perm[k : k + nb]
        k += nb
    meta = metadata_from_lens([q for q, _ in q_seq], [s for _, s in q_seq], bt)
    T = meta.num_actual_tokens
    if strided_query:  # a view of a fused qkv projection, as the model passes it
        qkv = (torch.randn(T, (H + 2 * Hkv) * D, generator=g) * q_scale).to(dtype)
        query = qkv[:, : H * D].view(T, H, D)
    else:
        query = (torch.randn(T, H, D, generator=g) * q_scale).to(dtype)
    return query, kv, meta


def run_both(isa, query, kv, meta, D, kv_cache_dtype, k_scale, v_scale):
    scale = D**-0.5
    expected = torch.empty(query.shape, dtype=query.dtype)
    dispatch.paged_attention("ref", query, kv, meta, scale, kv_cache_dtype, k_scale, v_scale, expected)
    got = torch.full(query.shape, float("nan"), dtype=query.dtype)
    ext = dispatch._ext()
    ext.attention_set_bf16_dot("fma" if isa == "vec512_fma" else "dpbf16")
    try:
        if isa == "amx_emu":
            dispatch.run(isa, query, kv, meta.query_start_loc, meta.seq_lens, meta.block_table, scale, k_scale, v_scale, got)
        else:
            dispatch.paged_attention(_base(isa), query, kv, meta, scale, kv_cache_dtype, k_scale, v_scale, got)
    finally:
        ext.attention_set_bf16_dot("auto")
    return got, expected


def int8_products(isa, kv_cache_dtype):
    """Whether ``isa`` rounds queries to int8 (and, for decode rows, probabilities to u8) over this
    cache (vec512's VNNI paths, which AMX hands its decode units to), which the reference does not."""
    return kv_cache_dtype == "int8" and _base(isa) in ("vec512", "amx") and platform.has("avx512_vnni")


def assert_close(got, expected, int8_products=False):
    assert not torch.isnan(got).any(), "rows left unwritten (NaN)"
    if int8_products:
        # int8 queries and u8 probabilities (max differences seen: ~0.03 on outputs of size ~1,
        # means ~1e-3); test_int8_cache_path_arithmetic checks that arithmetic itself.
        torch.testing.assert_close(got.float(), expected.float(), atol=6e-2, rtol=5e-2)
        assert (got.float() - expected.float()).abs().mean().item() < 5e-3
    elif got.dtype == torch.bfloat16:
        # bf16 probabilities in the P V dot products: a couple of bf16 ulps on outputs of size ~1.
        torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=2e-2)
        assert (got.float() - expected.float()).abs().mean().item() < 2e-3
    else:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("isa", ["amx", "vec512", "vec512_fma", "vec256"])
def test_paged_attention_matches_ref(isa, dtype, kv_cache_dtype, head_size, gqa, block_size):
    _need(isa)
    if not dispatch.supports(_base(isa), dtype, block_size, head_size, kv_cache_dtype):
        pytest.skip(f"{isa} does not serve {dtype} models")
    Hkv = 2
    cache_dtype = QUANT.get(kv_cache_dtype, dtype)
    k_scale, v_scale = (0.7, 1.3) if kv_cache_dtype in FP8 else (1.0, 1.0)
    query, kv, meta = make_case(MIXED, Hkv * gqa, Hkv, head_size, block_size, dtype, cache_dtype, seed=head_size + gqa)
    got, expected = run_both(isa, query, kv, meta, head_size, kv_cache_dtype, k_scale, v_scale)
    assert_close(got, expected, int8_products=int8_products(isa, kv_cache_dtype))


@pytest.mark.parametrize("head_size", [80, 96])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("isa", ["amx", "vec512", "vec512_fma", "vec256", "amx_emu"])
def test_other_head_sizes(isa, dtype, head_size):
    _need(isa)
    if isa.startswith("amx") and dtype != torch.bfloat16:
        pytest.skip("amx serves bf16 models only")
    query, kv, meta = make_case(MIXED[:6], 8, 2, head_size, 16, dtype, dtype, seed=head_size)
    got, expected = run_both(isa, query, kv, meta, head_size, "auto", 1.0, 1.0)
    assert_close(got, expected)


@pytest.mark.parametrize("head_size", [64, 80, 128])
@pytest.mark.parametrize("gqa", [2, 4, 7, 8, 16])
@pytest.mark.parametrize("isa", ["amx", "vec512", "vec512_fma", "vec256"])
def test_gqa_group_sizes(isa, gqa, head_size):
    """Decode groups of 2-16 query rows per kv head (vec512 and vec256 read the cache directly up to
    8 rows, then through tiles) and a 2-token chunk (rows from two positions)."""
    _need(isa)
    q_seq = MIXED[:6] + [(2, 50)]
    query, kv, meta = make_case(q_seq, 2 * gqa, 2, head_size, 16, torch.bfloat16, torch.bfloat16, seed=gqa)
    got, expected = run_both(isa, query, kv, meta, head_size, "auto", 1.0, 1.0)
    assert_close(got, expected)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("gqa", [1, 3, 8, 20])
def test_amx_tile_code_emulated(gqa, kv_cache_dtype):
    """The AMX tile kernels' bookkeeping (shapes, strides, VNNI layouts, partial row tiles)
    on emulated tiles: decode groups of 1-20 rows, prompt units of up to 180 rows (9 tokens x 20
    query heads per kv head; the AMX path takes units of up to 192 rows)."""
    _need("amx_emu")
    cache_dtype = QUANT.get(kv_cache_dtype, torch.bfloat16)
    k_scale, v_scale = (0.7, 1.3) if kv_cache_dtype in FP8 else (1.0, 1.0)
    query, kv, meta = make_case(MIXED[:6], 2 * gqa, 2, 64, 16, torch.bfloat16, cache_dtype, seed=gqa)
    got, expected = run_both("amx_emu", query, kv, meta, 64, kv_cache_dtype, k_scale, v_scale)
    assert_close(got, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_threads", [1, 2, 5])
@pytest.mark.parametrize("isa", ["amx", "vec512", "vec512_fma", "vec256"])
def test_thread_counts_and_context_splits(isa, num_threads, dtype, threads):
    """Few long requests are split across threads (flash decoding) and merged; the
    result must not depend on the thread count."""
    _need(isa)
    if not dispatch.supports(_base(isa), dtype, 16, 64, "auto"):
        pytest.skip(f"{isa} does not serve {dtype} models")
    threads(num_threads)
    for q_seq in ([(1, 2000)], [(1, 129), (1, 1000)], [(3, 900)], [(1, 7), (40, 40)]):
        query, kv, meta = make_case(q_seq, 9, 3, 64, 16, dtype, dtype, seed=len(q_seq))
        got, expected = run_both(isa, query, kv, meta, 64, "auto", 1.0, 1.0)
        assert_close(got, expected)


@pytest.mark.parametrize("num_threads", [1, 2, 5])
@pytest.mark.parametrize("isa", ["vec512", "vec256"])
def test_int8_cache_context_splits(isa, num_threads, threads):
    """The int8 decode paths' partial results (flash decoding splits) merge like the others'."""
    _need(isa)
    threads(num_threads)
    for q_seq in ([(1, 2000)], [(1, 129), (1, 1000)], [(2, 900)]):
        query, kv, meta = make_case(q_seq, 9, 3, 64, 16, torch.bfloat16, torch.int8, seed=len(q_seq))
        got, expected = run_both(isa, query, kv, meta, 64, "int8", 1.0, 1.0)
        assert_close(got, expected, int8_products=int8_products(isa, "int8"))


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("isa", ["vec512", "vec256"])
def test_many_decodes_claimed_per_request(isa, num_threads, threads):
    """A 40-stream decode batch (and a few prompt chunks) is enough units that threads claim a
    request's kv heads together: every unit still runs once, on every row (outputs start as NaN)."""
    _need(isa)
    threads(num_threads)
    q_seq = [(1, 20 + 37 * i % 400) for i in range(40)] + [(30, 30), (9, 200)]
    query, kv, meta = make_case(q_seq, 9, 3, 64, 16, torch.bfloat16, torch.int8, seed=40)
    got, expected = run_both(isa, query, kv, meta, 64, "int8", 1.0, 1.0)
    assert_close(got, expected, int8_products=int8_products(isa, "int8"))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("block_size", [8, 48, 64])
@pytest.mark.parametrize("isa", ["amx", "vec512", "vec512_fma", "vec256"])
def test_other_block_sizes(isa, block_size, kv_cache_dtype):
    """Key tiles of 32 straddle or split blocks of any size (an int8 cache's decode path reads a
    tile's rows and scales 16 rows of a block at a time)."""
    _need(isa)
    if not dispatch.supports(_base(isa), torch.bfloat16, block_size, 64, kv_cache_dtype):
        pytest.skip(f"{isa} does not take block size {block_size}")
    cache_dtype = QUANT.get(kv_cache_dtype, torch.bfloat16)
    query, kv, meta = make_case(MIXED, 6, 2, 64, block_size, torch.bfloat16, cache_dtype, seed=block_size)
    got, expected = run_both(isa, query, kv, meta, 64, kv_cache_dtype, 1.0, 1.0)
    assert_close(got, expected, int8_products=int8_products(isa, kv_cache_dtype))


@pytest.mark.parametrize("isa", ["amx", "vec512", "vec512_fma", "vec256"])
def test_extreme_scores_stay_finite(isa):
    """Large logits exercise the online-softmax rescaling (running max moving far)."""
    _need(isa)
    query, kv, meta = make_case(MIXED, 6, 2, 64, 16, torch.bfloat16, torch.bfloat16, seed=5, q_scale=30.0)
    got, expected = run_both(isa, query, kv, meta, 64, "auto", 1.0, 1.0)
    assert_close(got, expected)


def int8_products_emulated(query, kv, meta, scale, bf16_pv=False):
    """What vec512's int8-cache paths compute, written out in torch.  Every query row is rounded to
    int8 against its largest value and scored with exact integer dot products against the int8 keys,
    times the two scales.  Work units take up to 64 rows (tokens x the kv head's query heads); in
    units of at most 8 rows (the decode path) each row then runs an online softmax over tiles of 32
    keys and, per tile, rounds the probabilities times the keys' V scales to u8 against the tile's
    largest before multiplying the int8 values; larger (prompt) units keep fp32 probabilities
    against the dequantised values, or with ``bf16_pv`` (a bf16 model where the kernel takes dpbf16)
    round each tile's probabilities and the dequantised values to bf16 (the row sums stay fp32).
    Rows see the keys up to their own position."""
    H, D = query.shape[1], query.shape[2]
    Hkv, B = kv.shape[1], kv.shape[2]
    G = H // Hkv
    row_scales = int8_row_scales(kv)
    out = torch.empty(query.shape, dtype=torch.float32)
    for i, L in enumerate(meta.seq_lens_list):
        t0, t1 = meta.query_start_loc_list[i], meta.query_start_loc_list[i + 1]
        pos = torch.arange(L)
        blocks = meta.block_table[i, pos // B].long()
        rows, sc = kv[blocks, :, pos % B].float(), row_scales[blocks, :, pos % B]  # [L, Hkv, 2D], [L, Hkv, 2]
        mtok = max(1, 64 // G)
        for t in range(t0, t1):
            visible = L - (t1 - t) + 1  # keys [0, visible) for this row
            first = t0 + (t - t0) // mtok * mtok  # the first token of this row's work unit
            decode_unit = min(mtok, t1 - first) * G <= 8
            for h in range(H):
                k, v, ks, vs = rows[:visible, h // G, :D], rows[:visible, h // G, D:], sc[:visible, h // G, 0], sc[:visible, h // G, 1]
                q = query[t, h].float()
                m = q.abs().max()
                qi = torch.round(q * (torch.full_like(m, 127.0) / m)) if m > 0 else torch.zeros_like(q)
                scores = (k @ qi) * (m / 127.0) * ks
                if not decode_unit and not bf16_pv:
                    out[t, h] = torch.softmax(scores * scale, 0) @ (v * vs[:, None])
                    continue
                m_run, l, o = torch.tensor(float("-inf")), torch.tensor(0.0), torch.zeros(D)
                for k0 in range(0, visible, 32):
                    st = scores[k0 : k0 + 32] * scale
                    m_new = torch.maximum(m_run, st.max())
                    alpha = torch.exp(m_run - m_new) if torch.isfinite(m_run) else torch.tensor(1.0)
                    p = torch.exp(st - m_new)
                    l = l * alpha + p.sum()
                    if not decode_unit:  # bf16_pv
                        vt = (v[k0 : k0 + 32] * vs[k0 : k0 + 32, None]).bfloat16().float()
                        o = o * alpha + p.bfloat16().float() @ vt
                        m_run = m_new
                        continue
                    pv = p * vs[k0 : k0 + 32]
                    top = pv.max()
                    pq = torch.round(pv * (torch.full_like(top, 255.0) / top))
                    o = o * alpha + (pq @ v[k0 : k0 + 32]) * (top / 255.0)
                    m_run = m_new
                out[t, h] = o / l
    return out


@pytest.mark.parametrize("bf16_dot", ["dpbf16", "fma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("head_size", [64, 80, 128])
def test_int8_cache_path_arithmetic(head_size, gqa, dtype, bf16_dot):
    """vec512's int8-cache paths (decode rows, and prompt chunks of up to 64 query rows per unit:
    21 tokens x 3 heads, 8 x 8; longer chunks span several units) against their arithmetic written
    out in torch (int8_products_emulated): the loose comparison with ref above would let a wrong
    offset or scale through.  Both prompt P . V paths: dpbf16 (a bf16 model's, where the CPU runs
    it as fast as an FMA) and fp32 FMAs."""
    _need("vec512")
    if not platform.has("avx512_vnni"):
        pytest.skip("the int8 paths need AVX512-VNNI")
    if dtype == torch.float32 and bf16_dot == "dpbf16":
        pytest.skip("an fp32 model's prompt P . V is fp32 whatever the bf16 products")
    q_seq = [(1, n) for n in (1, 17, 31, 32, 33, 300, 1500)] + [(5, 5), (21, 21), (30, 97), (70, 300)]
    query, kv, meta = make_case(q_seq, 2 * gqa, 2, head_size, 16, dtype, torch.int8, seed=head_size * gqa)
    got = torch.full(query.shape, float("nan"), dtype=dtype)
    ext = dispatch._ext()
    ext.attention_set_bf16_dot(bf16_dot)
    try:
        dispatch.paged_attention("vec512", query, kv, meta, head_size**-0.5, "int8", 1.0, 1.0, got)
    finally:
        ext.attention_set_bf16_dot("auto")
    bf16_pv = dtype == torch.bfloat16 and bf16_dot == "dpbf16"
    expected = int8_products_emulated(query, kv, meta, head_size**-0.5, bf16_pv=bf16_pv)
    # Left: fp32 summation order and exp's polynomial (~1e-7 seen), which now and then tips a u8
    # probability rounding the other way (~2e-5 seen), and a bf16 model's output rounding.  A bf16
    # probability that tips is off by 2^-9 of itself, times a value of up to ~4 (~5e-4 seen).
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=2e-3 if bf16_pv else 1e-4)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_reshape_and_cache_matches_ref(dtype, kv_cache_dtype):
    """Bit-exact with the reference (fp8 rounding and saturation, int8 rows and their scales
    included); padding slots (-1) write nothing."""
    isa = sorted(NATIVE)[0]
    T, Hkv, D, B, nb = 40, 3, 64, 16, 8
    g = torch.Generator().manual_seed(3)
    cache_dtype = QUANT.get(kv_cache_dtype, dtype)
    k_scale, v_scale = (0.37, 2.5) if kv_cache_dtype in FP8 else (1.0, 1.0)
    # Values from 1e-6 (fp8 denormals, underflow) to 1e3 (fp8 saturation / overflow).
    mag = torch.pow(10.0, torch.empty(T, 2 * Hkv, 2 * D).uniform_(-6, 3, generator=g))
    kv_new = (torch.randn(T, 2 * Hkv, 2 * D, generator=g) * mag).to(dtype)
    key = kv_new[:, :Hkv, :D]  # strided views, like slices of a fused projection
    value = kv_new[:, Hkv:, D:]
    slots = torch.randperm(nb * B, generator=g)[:T]
    slots[::7] = -1
    def filled() -> torch.Tensor:  # the same random bytes every call, int8 scales included
        cache = allocate_kv_cache(nb, B, Hkv, D, cache_dtype)
        whole = cache.untyped_storage()
        whole.copy_(torch.randint(-128, 128, (whole.nbytes(),), generator=torch.Generator().manual_seed(5), dtype=torch.int8).untyped_storage())
        return cache

    def rows(c: torch.Tensor) -> torch.Tensor:  # [nb * B, Hkv * whole row] bytes, scales included
        return whole_rows(c).view(torch.uint8).permute(0, 2, 1, 3).reshape(nb * B, -1)

    init, expected, got = filled(), filled(), filled()
    dispatch.reshape_and_cache("ref", key, value, expected, slots, kv_cache_dtype, k_scale, v_scale)
    dispatch.reshape_and_cache(isa, key, value, got, slots, kv_cache_dtype, k_scale, v_scale)
    assert torch.equal(rows(got), rows(expected))
    untouched = torch.ones(nb * B, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(rows(got)[untouched], rows(init)[untouched])
    assert not torch.equal(rows(got)[~untouched], rows(init)[~untouched])


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_write_rounding_and_scales(src_dtype):
    """int8 rows: round(x * 127 / max|x|) half to even, the scale max|x| / 127 after the row;
    a zero row stores zeros with scale 0.  Native and reference agree to the bit."""
    isa = sorted(NATIVE)[0]
    D = 64
    ties = torch.zeros(D)
    ties[0], ties[1:6] = 127.0, torch.tensor([0.5, 1.5, 2.5, -2.5, -3.5])  # scale 1: exact halves
    g = torch.Generator().manual_seed(2)
    x = torch.stack([ties, torch.zeros(D), torch.randn(D, generator=g) * 1e4, torch.randn(D, generator=g) * 1e-3])
    x = x.to(src_dtype).view(-1, 1, D)
    caches = [allocate_kv_cache(x.shape[0], 1, 1, D, torch.int8) for _ in range(2)]
    for which, cache in zip(("ref", isa), caches):
        dispatch.reshape_and_cache(which, x, -x, cache, torch.arange(x.shape[0]), "int8", 1.0, 1.0)
    got, expected = caches[1], caches[0]
    assert torch.equal(got, expected) and torch.equal(int8_row_scales(got), int8_row_scales(expected))
    assert got[0, 0, 0, :6].tolist() == [127, 0, 2, 2, -2, -4]  # half to even
    assert got[0, 0, 0, D : D + 6].tolist() == [-127, 0, -2, -2, 2, 4]
    assert int8_row_scales(got)[0, 0, 0].tolist() == [1.0, 1.0]
    assert got[1].abs().sum() == 0 and int8_row_scales(got)[1].abs().sum() == 0
    for row in (2, 3):  # dequantised within half a step of the row's largest value
        scale = int8_row_scales(got)[row, 0, 0, 0]
        assert (got[row, 0, 0, :D].float() * scale - x[row, 0].float()).abs().max() <= scale / 2 * 1.0001


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_write_bit_exact_on_random_bit_patterns(kv_cache_dtype, src_dtype):
    """Every float class (random bit patterns: denormals, NaN, inf, huge) converts exactly as torch's .to()."""
    isa = sorted(NATIVE)[0]
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 17,), generator=g, dtype=torch.int64).to(torch.int32)
    ramp = torch.linspace(-600, 600, 1 << 14)  # dense over both formats' finite ranges
    tiny = torch.linspace(-(2.0**-5), 2.0**-5, 1 << 14)  # the denormal ranges
    x = torch.cat([bits.view(torch.float32), ramp, tiny]).to(src_dtype).view(-1, 1, 64)
    cache = torch.zeros(x.shape[0], 1, 1, 128, dtype=FP8[kv_cache_dtype])
    expected = cache.clone()
    slots = torch.arange(x.shape[0])
    dispatch.reshape_and_cache("ref", x, x, expected, slots, kv_cache_dtype, 0.37, 1.0)
    dispatch.reshape_and_cache(isa, x, x, cache, slots, kv_cache_dtype, 0.37, 1.0)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e5m2"])
def test_backend_update_then_forward(kv_cache_dtype):
    """The backend as the layer drives it: write this step's K/V, then attend; native vs ref."""
    H, Hkv, D, B = 9, 3, 64, 16
    impl = CPUAttentionBackendImpl(H, D, D**-0.5, Hkv, kv_cache_dtype, B, torch.bfloat16)
    assert impl.isa != "ref"
    layer = torch.nn.Module()
    layer.k_scale, layer.v_scale = (0.5, 0.25) if kv_cache_dtype in FP8 else (1.0, 1.0)
    q_seq = [(1, 33), (1, 200), (24, 24), (16, 80)]
    cache_dtype = QUANT.get(kv_cache_dtype, torch.bfloat16)
    query, kv0, meta = make_case(q_seq, H, Hkv, D, B, torch.bfloat16, cache_dtype, seed=9)
    # slot of each new token: the last query_len positions of its context
    slots = []
    for i, (q, s) in enumerate(q_seq):
        for pos in range(s - q, s):
            slots.append(int(meta.block_table[i, pos // B]) * B + pos % B)
    meta.slot_mapping = torch.tensor(slots, dtype=torch.int64)
    g = torch.Generator().manual_seed(11)
    key = torch.randn(query.shape[0], Hkv, D, generator=g).to(torch.bfloat16)
    value = torch.randn(query.shape[0], Hkv, D, generator=g).to(torch.bfloat16)
    outs, native_isa = [], impl.isa
    for isa in (native_isa, "ref"):
        impl.isa = isa
        kv = clone_cache(kv0)
        impl.do_kv_cache_update(layer, key, value, kv, meta.slot_mapping)
        out = torch.empty_like(query)
        impl.forward(layer, query, key, value, kv, meta, out)
        outs.append((kv, out))
    assert torch.equal(outs[0][0].view(torch.uint8), outs[1][0].view(torch.uint8))
    if kv_cache_dtype == "int8":
        assert torch.equal(int8_row_scales(outs[0][0]), int8_row_scales(outs[1][0]))
    assert_close(outs[0][1], outs[1][1], int8_products=int8_products(native_isa, kv_cache_dtype))


def _best(*candidates):
    return next((i for i in candidates if i in NATIVE), "ref")


def test_isa_selection(monkeypatch):
    monkeypatch.delenv("CPUSERVE_ATTN_ISA", raising=False)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert _get_attn_isa(bf16, 16, 64) == _best("amx", "vec512", "vec256")
    assert _get_attn_isa(bf16, 32, 128, "fp8_e4m3") == _best("amx", "vec512", "vec256")
    assert _get_attn_isa(fp32, 16, 64) == _best("vec512", "vec256")  # amx is bf16-only
    assert _get_attn_isa(bf16, 8, 64) == _best("vec512", "vec256")  # amx needs 16-row blocks
    assert _get_attn_isa(bf16, 16, 80) == _best("amx", "vec512", "vec256")
    for head_size in (72, 192, 256):  # head sizes no native kernel serves
        assert _get_attn_isa(bf16, 16, head_size) == "ref"
    assert _get_attn_isa(bf16, 12, 64) == "ref"  # block size not a multiple of 8
    assert _get_attn_isa(torch.float16, 16, 64) == "ref"


def test_forced_isa_env(monkeypatch):
    monkeypatch.setenv("CPUSERVE_ATTN_ISA", "ref")
    assert _get_attn_isa(torch.bfloat16, 16, 64) == "ref"
    monkeypatch.setenv("CPUSERVE_ATTN_ISA", "vec256")
    assert _get_attn_isa(torch.bfloat16, 16, 64) == _best("vec256")
    monkeypatch.setenv("CPUSERVE_ATTN_ISA", "vec512")
    assert _get_attn_isa(torch.bfloat16, 16, 64) == _best("vec512", "vec256")
    monkeypatch.setenv("CPUSERVE_ATTN_ISA", "amx")  # a ceiling, not a demand
    assert _get_attn_isa(torch.bfloat16, 16, 64) == _best("amx", "vec512", "vec256")
    assert _get_attn_isa(torch.bfloat16, 16, 72) == "ref"
    monkeypatch.setenv("CPUSERVE_ATTN_ISA", "avx9000")
    with pytest.raises(ValueError, match="CPUSERVE_ATTN_ISA"):
        _get_attn_isa(torch.bfloat16, 16, 64)


def test_no_extension_means_ref(monkeypatch):
    monkeypatch.delenv("CPUSERVE_ATTN_ISA", raising=False)
    monkeypatch.setattr(dispatch, "available_isas", lambda: frozenset())
    assert _get_attn_isa(torch.bfloat16, 16, 64) == "ref"


def test_available_isas_match_cpu():
    flags = platform.cpuinfo_flags()
    assert ("vec256" in NATIVE) == ({"avx2", "fma", "f16c"} <= flags)
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= flags:
        assert "vec512" in NATIVE
    assert ("amx" in NATIVE) == bool("vec512" in NATIVE and dispatch._ext().cpu_has_amx())


@pytest.mark.parametrize("mode", ["dpbf16", "fma"])
def test_bf16_dot_override(mode):
    """CPUSERVE_ATTN_BF16_DOT pins vec512's bf16 path (read once per process, so in a fresh one);
    without it the kernel reports which one its timing picked."""
    _need("vec512")
    code = "from engine.attention import dispatch; print(dispatch._ext().attention_bf16_dot())"
    env = {**os.environ, "CPUSERVE_ATTN_BF16_DOT": mode}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == mode
    assert dispatch._ext().attention_bf16_dot() in ("dpbf16", "fma")
    with pytest.raises(RuntimeError, match="must be auto, dpbf16 or fma"):
        dispatch._ext().attention_set_bf16_dot("amx")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_describe_names_the_path(dtype, kv_cache_dtype):
    """The start-up log's attention path: the ISA, plus vec512's bf16 choice for bf16 models and
    whether decode multiplies an int8 cache as int8."""
    impl = CPUAttentionBackendImpl(9, 64, 0.125, 3, kv_cache_dtype, 16, dtype)
    text = impl.describe()
    notes = []
    if impl.isa == "vec512" and dtype == torch.bfloat16:
        notes.append(f"bf16 products: {dispatch._ext().attention_bf16_dot()}")
    if kv_cache_dtype == "int8" and dispatch.int8_decode_path(impl.isa):
        notes.append("int8 KV decode: " + ("fp32 FMA" if impl.isa == "vec256" else "VNNI"))
    assert text == (f"{impl.isa} ({'; '.join(notes)})" if notes else impl.isa)
    if kv_cache_dtype == "int8" and impl.isa == "vec512" and platform.has("avx512_vnni"):
        assert text.endswith("int8 KV decode: VNNI)")


def test_bad_arguments_raise():
    isa = sorted(NATIVE)[0]
    query, kv, meta = make_case([(1, 40)], 4, 2, 64, 16, torch.bfloat16, torch.bfloat16)
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="unknown attention isa"):
        dispatch.run("sse9", query, kv, meta.query_start_loc, meta.seq_lens, meta.block_table, 0.1, output=out)
    bad_bt = meta.block_table.clone()
    bad_bt[0, 1] = kv.shape[0]  # block id past the cache
    with pytest.raises(RuntimeError, match="block id out of range"):
        dispatch.run(isa, query, kv, meta.query_start_loc, meta.seq_lens, bad_bt, 0.1, output=out)
    with pytest.raises(RuntimeError, match="does not match model dtype"):
        dispatch.run(isa, query, kv.float(), meta.query_start_loc, meta.seq_lens, meta.block_table, 0.1, output=out)
    with pytest.raises(RuntimeError, match="int8 kv cache rows need their scales"):  # no room after the rows
        dispatch.run(isa, query, kv.to(torch.int8), meta.query_start_loc, meta.seq_lens, meta.block_table, 0.1, output=out)


def test_one_plan_serves_every_layer_of_a_step():
    """The first layer's call plans the batch and the other layers reuse the plan (same batch, their
    own query and cache): each gets what the kernel planned for that call alone gives, and a call
    whose shapes the plan was not built for is refused."""
    isa = next(i for i in ("amx", "vec512", "vec256") if i in NATIVE)
    q1, kv1, meta = make_case(MIXED, 8, 2, 64, 16, torch.bfloat16, torch.bfloat16, seed=1)
    q2, kv2, _ = make_case(MIXED, 8, 2, 64, 16, torch.bfloat16, torch.bfloat16, seed=2)
    for query, kv in ((q1, kv1), (q2, kv2)):
        got = torch.empty_like(query)
        dispatch.paged_attention(isa, query, kv, meta, 0.125, "auto", 1.0, 1.0, got)
        alone = dispatch.run(isa, query, kv, meta.query_start_loc, meta.seq_lens, meta.block_table, 0.125)
        assert torch.equal(got, alone)
    assert len(meta.plans) == 1
    with pytest.raises(RuntimeError, match="query shape does not match the attention plan"):
        dispatch.paged_attention(isa, q1[:-1], kv1, meta, 0.125, "auto", 1.0, 1.0, torch.empty_like(q1[:-1]))
    plan = next(iter(meta.plans.values()))
    with pytest.raises(RuntimeError, match="built from other metadata tensors"):
        dispatch._ext().paged_attention_planned(
            plan, q1, kv1, meta.query_start_loc.clone(), meta.seq_lens, meta.block_table, 0.125, 1.0, 1.0, torch.empty_like(q1)
        )
