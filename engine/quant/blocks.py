"""GGUF quant blocks <-> the packed kernel layout of ``engine/csrc/qlinear.h``, for every block type
with a kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS).

The layout: groups of 16 output rows, each a sequential run of "group-blocks" whose quants are
interleaved in 4-byte words so that one vector instruction advances 16 rows at once; the last
group is padded with zero rows.

Both directions go through one neutral form, "units": each weight's unsigned integer quant
(uint8 [N, K]; Q8_0's q + 128; IQ4_NL/IQ4_XS the nibble that indexes their value table; IQ3_XXS/IQ3_S
a nibble q for the grid value level l and sign: 8 + l, or 7 - l when negative) and the per-block fields as the file holds them (fp16 scales as
raw bytes, the K types' 6-bit scales and mins one byte each; Q2_K's scale-and-min bytes as the file has them).  :func:`decode` / :func:`encode`
convert GGUF bytes to and from units (a bijection: ``encode(decode(raw)) == raw``), and
:func:`pack_units` / :func:`unpack_units` units to and from the packed layout.  Nothing is
rounded: the packed weights dequantize to exactly the file's values.  (Q3_K's 3-bit quants take a
nibble each, so its packed blocks are 1.33x the file's bytes, IQ3_S's 3.4-bit grid codes 1.25x and
IQ3_XXS's 3.06-bit ones 1.41x;
every other type's are within 3%, Q2_K's 2-bit quants in a plane of their own, as the file's size.)
"""

from __future__ import annotations

import functools

import torch

from engine.loader.dequantize import dequantize_rows

GROUP_ROWS = 16
BLOCK = 32
SUPER = 256  # weights per K-type super-block

# GGML type ids, as the native op takes them.
QTYPE_IDS = {
    "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20,
    "IQ3_XXS": 18, "IQ3_S": 21, "IQ4_XS": 23,
}
# (weights, bytes) of one GGUF block.
GGUF_BLOCKS = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34), "IQ4_NL": (32, 18),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_XS": (256, 136),
    "IQ3_XXS": (256, 98), "IQ3_S": (256, 110),
}
# Types of 256-weight super-blocks with per-32 (Q2_K, Q3_K, Q6_K: per-16) scales: their packed groups
# keep a header per super-block, and their activations share one scale per super-block.
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ3_XXS", "IQ3_S", "IQ4_XS")
# K types whose header is d and one int8 scale per sub-block (Q6_K, Q3_K: 16 a super-block; the rest 8).
_SCALE_HEADER_TYPES = ("Q6_K", "Q3_K", "IQ3_XXS", "IQ3_S", "IQ4_XS")
BLOCK_BYTES = {q: b for q, (w, b) in GGUF_BLOCKS.items() if w == BLOCK}  # GGUF bytes per 32 weights (32-weight types)
# Byte offsets of each GGUF block's fp16 fields (d, and m / dmin): with any bytes elsewhere a block
# is valid, which is how tests and benchmarks make random ones.
FP16_AT = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "Q3_K": (108,), "Q2_K": (80, 82), "IQ3_S": (0,), "IQ3_XXS": (0,),
}
# Per type: (quant bytes per row and 32-block: nibbles or Q8_0's bytes, high-bit plane bytes; Q2_K:
# its whole 2-bit quants in the plane).
_QUANT_BYTES = {"Q8_0": (32, 0), "Q5_0": (16, 4), "Q5_1": (16, 4), "Q5_K": (16, 4), "Q6_K": (16, 8), "Q2_K": (0, 8)}
_HEADER_BYTES = {"Q2_K": 64 + 256, "Q3_K": 32 + 256, "Q4_K": 64 + 256, "Q5_K": 64 + 256, "Q6_K": 32 + 256, "IQ4_XS": 32 + 128,
                 "IQ3_S": 32 + 128, "IQ3_XXS": 32 + 128}  # per 16 rows and super-block


def quant_bytes(qtype: str) -> tuple[int, int]:
    """(nibble or byte quants, high-bit plane) bytes of one row's 32-block in the packed layout."""
    return _QUANT_BYTES.get(qtype, (16, 0))


def group_block_bytes(qtype: str) -> int:
    """Average packed bytes per 16 rows x 32 weights (qlinear.h's group_block_bytes)."""
    q, p = quant_bytes(qtype)
    if qtype in K_TYPES:
        return (_HEADER_BYTES[qtype] + 8 * (q + p) * GROUP_ROWS) // 8
    fields = 4 if qtype in ("Q4_1", "Q5_1") else 2
    return (q + p + fields) * GROUP_ROWS


def block_weights(qtype: str) -> int:
    """in_features must be a multiple of this (a GGUF block)."""
    return GGUF_BLOCKS[qtype][0]


GROUP_BLOCK_BYTES = {q: group_block_bytes(q) for q in QTYPE_IDS}


# ---------------------------------------------------------------- GGUF bytes <-> units


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32]: low nibbles are elements 0-15, high ones 16-31."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _join_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_nibbles` on the low 4 bits of q [..., 32]."""
    return (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)


_BITS32 = torch.arange(32, dtype=torch.int64)
_BITS8 = torch.arange(8, dtype=torch.int64)
_BIT_MASKS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


@functools.lru_cache(maxsize=None)
def _grid_levels(qtype: str) -> torch.Tensor:
    """An IQ3 type's grid, int64 [rows, 4]: each row's 4 magnitudes as their level l (0-7), the index
    of the magnitude in the type's 8 values (gguf-py's tables)."""
    import gguf.quants

    cls = getattr(gguf.quants, qtype)
    cls.init_grid()
    grid = torch.from_numpy(cls.grid.reshape(-1, 4).copy())
    return (grid[..., None] == torch.tensor(cls.grid_map, dtype=grid.dtype)).to(torch.int64).argmax(-1)


@functools.lru_cache(maxsize=None)
def _grid_codes(qtype: str) -> torch.Tensor:
    """Inverse of :func:`_grid_levels`: int64 [4096], the grid row of levels (l0, l1, l2, l3) at
    l0 + 8 l1 + 64 l2 + 512 l3, -1 where the grid has no such row."""
    levels = _grid_levels(qtype)
    rows = torch.full((4096,), -1, dtype=torch.int64)
    rows[(levels * torch.tensor([1, 8, 64, 512])).sum(-1)] = torch.arange(levels.shape[0])
    return rows


def _grid_nibbles(qtype: str, rows: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """The nibbles of grid rows int64 [..., g] (4 weights each) with their 4g sign bits (bool, any
    shape after the leading dims): 8 + l, or 7 - l = (8 + l) ^ 15 where negative; uint8 [..., 4g]
    (uint8 table lookups: the 1B IQ3_M file's 78 tensors took 26 s to pack through int64 ones)."""
    lead = rows.shape[:-1]
    q = torch.nn.functional.embedding(rows, (_grid_levels(qtype) + 8).to(torch.uint8)).reshape(*lead, -1)
    return q ^ (negative.reshape(*lead, -1).to(torch.uint8) * 15)


def _grid_rows(qtype: str, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_grid_nibbles`: nibbles [..., g, 4] -> (grid rows int64 [..., g], negative bool [..., g, 4])."""
    q = q.to(torch.int64)
    negative = q < 8
    rows = _grid_codes(qtype)[(torch.where(negative, 7 - q, q - 8) * torch.tensor([1, 8, 64, 512])).sum(-1)]
    if (rows < 0).any():
        raise ValueError(f"{qtype} quants off its grid")
    return rows, negative


@functools.lru_cache(maxsize=None)
def _ksigns() -> torch.Tensor:
    """ggml's ksigns, uint8 [128]: the sign byte named by its low 7 bits (the 8th, bit 7, their parity)."""
    from gguf.quants import IQ2_XXS

    return torch.frombuffer(bytearray(IQ2_XXS.ksigns), dtype=torch.uint8)


_CRUMB_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K's and Q3_K's 2-bit fields: bytes [n, ns, 64] -> [n, ns, 256], element 128h + 32s + l
    being bits 2s..2s+1 of byte 32h + l."""
    n, ns, _ = qs.shape
    return ((qs.reshape(n, ns, 2, 1, 32) >> _CRUMB_SHIFTS) & 3).reshape(n, ns, 256)


def _join_crumbs(q: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_crumbs` on the low 2 bits of q [n, ns, 256]."""
    n, ns, _ = q.shape
    return ((q & 3).reshape(n, ns, 2, 4, 32) << _CRUMB_SHIFTS).sum(3, dtype=torch.uint8).reshape(n, ns, 64)


def _bits_of_u32(b: torch.Tensor) -> torch.Tensor:
    """[..., 4] little-endian bytes -> [..., 32] bits."""
    word = b.to(torch.int64)
    word = word[..., 0] | (word[..., 1] << 8) | (word[..., 2] << 16) | (word[..., 3] << 24)
    return ((word[..., None] >> _BITS32) & 1).to(torch.uint8)


def _u32_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_bits_of_u32`."""
    word = (bits.to(torch.int64) << _BITS32).sum(-1)
    return torch.stack([(word >> (8 * i)) & 255 for i in range(4)], dim=-1).to(torch.uint8)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12 scale bytes [..., 12] -> 8 six-bit scales and 8 mins (gguf's get_scale_min)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mn


def _pack_scale_min_k4(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_scale_min_k4`."""
    return torch.cat(
        [sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6), (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)],
        dim=-1,
    )


def decode(raw: torch.Tensor, qtype: str, k: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GGUF blocks uint8 [N, K / block weights * block bytes] -> (unsigned quants uint8 [N, K], fields).

    Fields, uint8: non-K types "d" (and "m") [N, K/32, 2] fp16 bytes; Q4_K/Q5_K "d", "dmin"
    [N, K/256, 2], "sc", "mn" [N, K/256, 8]; Q6_K and Q3_K "d" [N, K/256, 2], "sc" [N, K/256, 16] (int8
    bits; Q3_K's the 6-bit scale - 32, as it multiplies); Q2_K "d", "dmin" [N, K/256, 2], "sm"
    [N, K/256, 16] (the file's bytes: per 16 weights a 4-bit scale, low nibble, and min, high);
    IQ4_XS "d" [N, K/256, 2], "sc" [N, K/256, 8] (int8 bits of the 6-bit scale - 32, as it multiplies);
    IQ3_S and IQ3_XXS the same ("sc" the 4-bit scale s as 1 + 2s; IQ3_XXS's values are a quarter of that).
    """
    n = raw.shape[0]
    bw, bb = GGUF_BLOCKS[qtype]
    b = raw.reshape(n, k // bw, bb)
    if qtype == "Q8_0":
        return (b[..., 2:] ^ 0x80).reshape(n, k), {"d": b[..., 0:2]}
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"):
        sb = 4 if qtype.endswith("_1") else 2
        fields = {"d": b[..., 0:2]} | ({"m": b[..., 2:4]} if sb == 4 else {})
        if not qtype.startswith("Q5"):
            return _nibbles(b[..., sb:]).reshape(n, k), fields
        q = _nibbles(b[..., sb + 4 :]) | (_bits_of_u32(b[..., sb : sb + 4]) << 4)
        return q.reshape(n, k), fields
    ns = k // SUPER
    if qtype == "Q2_K":  # scales (16), qs (the quants: _crumbs), d, dmin
        return _crumbs(b[..., 16:80]).reshape(n, k), {"d": b[..., 80:82], "dmin": b[..., 82:84], "sm": b[..., 0:16]}
    if qtype == "Q3_K":  # hmask, qs, scales (12), d; element 128h + 32s + l: bits 2s..2s+1 of
        # qs[32h + l], high bit (set: no -4 offset) bit 4h + s of hmask[l]; 16 six-bit scales: low
        # nibbles of bytes 0-7 then their high nibbles, high 2 bits in bytes 8-11 (scale 4s + j: bits 2s of byte 8 + j)
        hm, qs, sb, d = b[..., 0:32], b[..., 32:96], b[..., 96:108], b[..., 108:110]
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
        hi = (hm.reshape(n, ns, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)) & 1  # [4h + s, l]
        q = _crumbs(qs) | (hi.reshape(n, ns, 256) << 2)
        low = _nibbles(sb[..., 0:8])
        high = ((sb[..., 8:12].reshape(n, ns, 1, 4) >> shifts.reshape(1, 1, 4, 1)) & 3).reshape(n, ns, 16)
        return q.reshape(n, k), {"d": d, "sc": ((low | (high << 4)).to(torch.int32) - 32).to(torch.uint8)}
    if qtype == "IQ3_S":  # d, qs (64), qh (8), signs (32), scales (4): per group g of 4 weights grid row
        # qs[g] | bit g % 8 of qh[g // 8] << 8, its 4 magnitudes 2l + 1; a sign bit a weight; 4-bit scales
        d, qs, qh, signs, sc = b[..., 0:2], b[..., 2:66], b[..., 66:74], b[..., 74:106], b[..., 106:110]
        row = qs.to(torch.int64) | ((qh[..., None] & _BIT_MASKS).ne(0).reshape(n, ns, 64).to(torch.int64) << 8)
        q = _grid_nibbles("IQ3_S", row, (signs[..., None] & _BIT_MASKS).ne(0))
        s4 = torch.stack([sc & 15, sc >> 4], dim=-1).reshape(n, ns, 8)
        return q.reshape(n, k), {"d": d, "sc": 1 + 2 * s4}
    if qtype == "IQ3_XXS":  # d, qs (64 grid rows of 4 weights), per 32 weights a u32: 4 x 7 bits naming
        # the sign bytes of its 8-weight runs (ggml's ksigns: the 8th sign the parity), the scale in bits 28-31
        d, qs = b[..., 0:2], b[..., 2:66]
        w = b[..., 66:98].reshape(n, ns, 8, 4).to(torch.int64)
        w = w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)  # [n, ns, 8]
        sign_bytes = _ksigns()[(w[..., None] >> torch.tensor([0, 7, 14, 21])) & 127]  # [n, ns, 8, 4]
        q = _grid_nibbles("IQ3_XXS", qs.to(torch.int64), (sign_bytes[..., None] & _BIT_MASKS).ne(0))
        return q.reshape(n, k), {"d": d, "sc": (1 + 2 * (w >> 28)).to(torch.uint8)}
    if qtype == "IQ4_XS":  # d, scales_h (u16: bits 2s..2s+1 the high bits of scale s), scales_l (nibbles), qs
        d, sh, sl = b[..., 0:2], b[..., 2:4].to(torch.int32), b[..., 4:8]
        high = ((sh[..., 0:1] | (sh[..., 1:2] << 8)) >> (2 * torch.arange(8, dtype=torch.int32))) & 3
        ls = _nibbles(sl)[..., [0, 4, 1, 5, 2, 6, 3, 7]].to(torch.int32) | (high << 4)
        q = _nibbles(b[..., 8:].reshape(n, ns, 8, 16))
        return q.reshape(n, k), {"d": d, "sc": (ls - 32).to(torch.uint8)}
    if qtype == "Q6_K":
        ql, qh, sc, d = b[..., :128], b[..., 128:192], b[..., 192:208], b[..., 208:210]
        # element 128h + 32j + l: low nibble of ql[64h + 32(j % 2) + l] (>> 4 for j >= 2), high
        # bits 2j..2j+1 of qh[32h + l]
        lo = torch.stack([ql.reshape(n, ns, 2, 64) & 15, ql.reshape(n, ns, 2, 64) >> 4], dim=2)  # [n, ns, sh, h, 64]
        lo = lo.permute(0, 1, 3, 2, 4).reshape(n, ns, 2, 128)
        hb = qh.reshape(n, ns, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1)
        q = lo | ((hb & 3).reshape(n, ns, 2, 128) << 4)
        return q.reshape(n, k), {"d": d, "sc": sc}
    d, dmin, scales = b[..., 0:2], b[..., 2:4], b[..., 4:16]
    sc, mn = _scale_min_k4(scales)
    qs = b[..., -128:].reshape(n, ns, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 1, 2, 1)
    q = (qs & 15).reshape(n, ns, 256)
    if qtype == "Q5_K":  # bit s of qh[l]: element 32s + l
        qh = b[..., 16:48].reshape(n, ns, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)
        q = q | ((qh & 1).reshape(n, ns, 256) << 4)
    return q.reshape(n, k), {"d": d, "dmin": dmin, "sc": sc, "mn": mn}


def encode(q: torch.Tensor, fields: dict[str, torch.Tensor], qtype: str) -> torch.Tensor:
    """Inverse of :func:`decode`: GGUF blocks uint8 [N, bytes per row]."""
    n, k = q.shape
    bw, bb = GGUF_BLOCKS[qtype]
    if qtype == "Q8_0":
        return torch.cat([fields["d"], (q ^ 0x80).reshape(n, k // 32, 32)], dim=-1).reshape(n, -1)
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"):
        qb = q.reshape(n, k // 32, 32)
        parts = [fields["d"]] + ([fields["m"]] if "m" in fields else [])
        if qtype.startswith("Q5"):
            parts.append(_u32_of_bits((qb >> 4) & 1))
        parts.append(_join_nibbles(qb))
        return torch.cat(parts, dim=-1).reshape(n, -1)
    ns = k // SUPER
    qs = q.reshape(n, ns, 256)
    if qtype == "Q2_K":
        return torch.cat([fields["sm"], _join_crumbs(qs), fields["d"], fields["dmin"]], dim=-1).reshape(n, -1)
    if qtype == "Q3_K":
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
        hi = ((qs >> 2) & 1).reshape(n, ns, 8, 32).to(torch.int32)
        hm = (hi << torch.arange(8, dtype=torch.int32).reshape(1, 1, 8, 1)).sum(2)
        ls = (fields["sc"].to(torch.int32) + 32) & 63
        low = (ls[..., 0:8] & 15) | ((ls[..., 8:16] & 15) << 4)
        high = ((ls >> 4).reshape(n, ns, 4, 4) << shifts.reshape(1, 1, 4, 1)).sum(2)
        parts = [hm, _join_crumbs(qs), low, high, fields["d"]]
        return torch.cat([x.to(torch.uint8) for x in parts], dim=-1).reshape(n, -1)
    if qtype in ("IQ3_S", "IQ3_XXS"):
        row, negative = _grid_rows(qtype, qs.reshape(n, ns, 64, 4))
        sign_bytes = (negative.reshape(n, ns, 32, 8).to(torch.int64) << _BITS8).sum(-1)
        s4 = (fields["sc"].to(torch.int64) - 1) // 2
        if qtype == "IQ3_S":
            qh = ((row >> 8).reshape(n, ns, 8, 8) << _BITS8).sum(-1)
            parts = [fields["d"], row & 255, qh, sign_bytes, s4[..., 0::2] | (s4[..., 1::2] << 4)]
        else:
            runs = sign_bytes.reshape(n, ns, 8, 4) & 127
            if not torch.equal(_ksigns()[runs], sign_bytes.reshape(n, ns, 8, 4).to(torch.uint8)):
                raise ValueError("IQ3_XXS signs with odd parity in a run of 8")
            w = (runs << torch.tensor([0, 7, 14, 21])).sum(-1) | (s4 << 28)
            parts = [fields["d"], row, torch.stack([(w >> (8 * i)) & 255 for i in range(4)], dim=-1).reshape(n, ns, 32)]
        return torch.cat([x.to(torch.uint8) for x in parts], dim=-1).reshape(n, -1)
    if qtype == "IQ4_XS":
        ls = (fields["sc"].to(torch.int32) + 32) & 63
        sl = (ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)
        sh = ((ls >> 4) << (2 * torch.arange(8, dtype=torch.int32))).sum(-1, keepdim=True)
        parts = [fields["d"], sh & 255, sh >> 8, sl, _join_nibbles(qs.reshape(n, ns, 8, 32)).reshape(n, ns, 128)]
        return torch.cat([x.to(torch.uint8) for x in parts], dim=-1).reshape(n, -1)
    if qtype == "Q6_K":
        lo = (qs & 15).reshape(n, ns, 2, 2, 64)  # [h, sh, 64]
        ql = (lo[:, :, :, 0] | (lo[:, :, :, 1] << 4)).reshape(n, ns, 128)
        hb = ((qs >> 4) & 3).reshape(n, ns, 2, 4, 32)
        qh = (hb[:, :, :, 0] | (hb[:, :, :, 1] << 2) | (hb[:, :, :, 2] << 4) | (hb[:, :, :, 3] << 6)).reshape(n, ns, 64)
        return torch.cat([ql, qh, fields["sc"], fields["d"]], dim=-1).reshape(n, -1)
    lo = (qs & 15).reshape(n, ns, 4, 2, 32)
    parts = [fields["d"], fields["dmin"], _pack_scale_min_k4(fields["sc"], fields["mn"])]
    if qtype == "Q5_K":
        hb = ((qs >> 4) & 1).reshape(n, ns, 8, 32).to(torch.int32) << torch.arange(8, dtype=torch.int32).reshape(1, 1, 8, 1)
        parts.append(hb.sum(2).to(torch.uint8))
    parts.append((lo[:, :, :, 0] | (lo[:, :, :, 1] << 4)).reshape(n, ns, 128))
    out = torch.cat(parts, dim=-1)
    assert out.shape[-1] == bb
    return out.reshape(n, -1)


# ---------------------------------------------------------------- units <-> packed layout


def interleave_rows(qs: torch.Tensor) -> torch.Tensor:
    """Quants uint8 [groups, 16, nb, qb] -> [groups, nb, qb * 16]: per group-block, chunk c holds
    bytes [4c, 4c + 4) of each of the 16 rows in turn (the kernels' 4-byte-word interleave)."""
    groups, _, nb, qb = qs.shape
    return qs.reshape(groups, GROUP_ROWS, nb, qb // 4, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, qb * GROUP_ROWS)


def deinterleave_rows(qs: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`interleave_rows`: [groups, nb, qb * 16] -> [groups, 16, nb, qb]."""
    groups, nb, width = qs.shape
    qb = width // GROUP_ROWS
    return qs.reshape(groups, nb, qb // 4, GROUP_ROWS, 4).permute(0, 3, 1, 2, 4).reshape(groups, GROUP_ROWS, nb, qb)


def _row_fields(f: torch.Tensor, groups: int) -> torch.Tensor:
    """A per-row field [groups * 16, blocks, w] -> [groups, blocks, 16 * w] (the 16 rows side by side)."""
    _, blocks, w = f.shape
    return f.reshape(groups, GROUP_ROWS, blocks, w).permute(0, 2, 1, 3).reshape(groups, blocks, GROUP_ROWS * w)


def _unrow_fields(f: torch.Tensor, w: int) -> torch.Tensor:
    """Inverse of :func:`_row_fields`: [groups, blocks, 16 * w] -> [groups * 16, blocks, w]."""
    groups, blocks, _ = f.shape
    return f.reshape(groups, blocks, GROUP_ROWS, w).permute(0, 2, 1, 3).reshape(groups * GROUP_ROWS, blocks, w)


def _plane_shift(qtype: str) -> int:
    """The bit of a quant where its plane bits go: the high bits of the 5- and 6-bit types sit above
    a nibble; Q2_K's plane holds its whole quants."""
    return 0 if qtype == "Q2_K" else 4


def _plane(q: torch.Tensor, qtype: str) -> torch.Tensor:
    """The plane bytes of each row's 32-blocks, q [rows, nb, 32] -> [rows, nb, 4 or 8] (qlinear.h:
    byte j, bit c (Q5) or bits 2c..2c+1 (Q6, Q2_K) for element 4c + j, then 16 + 4c + j)."""
    q5 = qtype.startswith("Q5")
    hb = ((q >> _plane_shift(qtype)) & (1 if q5 else 3)).to(torch.int32).reshape(*q.shape[:-1], 2, 4, 4)  # [half, c, j]
    shift = (torch.arange(4, dtype=torch.int32) * (1 if q5 else 2)).reshape(4, 1)
    if q5:  # one byte per j: half 0 in bits 0-3, half 1 in bits 4-7
        b = (hb[..., 0, :, :] << shift).sum(-2) | ((hb[..., 1, :, :] << shift).sum(-2) << 4)
    else:  # half 0 bytes, then half 1 bytes
        b = torch.cat([(hb[..., 0, :, :] << shift).sum(-2), (hb[..., 1, :, :] << shift).sum(-2)], dim=-1)
    return b.to(torch.uint8)


def _unplane(b: torch.Tensor, qtype: str) -> torch.Tensor:
    """Inverse of :func:`_plane`: the plane bits of each element, back in place, [rows, nb, 32]."""
    q5 = qtype.startswith("Q5")
    c = torch.arange(4, dtype=torch.int32).reshape(4, 1)
    b = b.to(torch.int32)
    if q5:
        halves = [(b[..., None, :] >> c) & 1, (b[..., None, :] >> (c + 4)) & 1]
    else:
        halves = [(b[..., None, :4] >> (2 * c)) & 3, (b[..., None, 4:] >> (2 * c)) & 3]
    hb = torch.stack(halves, dim=-3).reshape(*b.shape[:-1], 32)
    return (hb << _plane_shift(qtype)).to(torch.uint8)


def pack_units(q: torch.Tensor, fields: dict[str, torch.Tensor], qtype: str) -> torch.Tensor:
    """Units (rows a multiple of 16) -> the packed layout, flat uint8 (see qlinear.h)."""
    rows, k = q.shape
    groups, nb = rows // GROUP_ROWS, k // BLOCK
    qb = q.reshape(rows, nb, 32)
    quants = qb if qtype == "Q8_0" else _join_nibbles(qb)
    parts = [interleave_rows(quants.reshape(groups, GROUP_ROWS, nb, -1))] if quant_bytes(qtype)[0] else []
    if quant_bytes(qtype)[1]:
        parts.append(interleave_rows(_plane(qb, qtype).reshape(groups, GROUP_ROWS, nb, -1)))
    blocks = torch.cat(parts, dim=-1)  # [groups, nb, quant bytes]
    if qtype not in K_TYPES:
        fs = [_row_fields(fields[name], groups) for name in ("d", "m") if name in fields]
        return torch.cat([blocks] + fs, dim=-1).reshape(-1).contiguous()
    ns = k // SUPER
    if qtype in _SCALE_HEADER_TYPES:  # d, then one int8 scale per sub-block (Q6_K, Q3_K 16; IQ3_S, IQ4_XS 8)
        subs = fields["sc"].shape[-1]
        header = [_row_fields(fields["d"], groups), _row_fields(fields["sc"].reshape(rows, ns * subs, 1), groups).reshape(groups, ns, -1)]
    elif qtype == "Q2_K":  # d, dmin, then per 16-weight sub-block the 16 rows' scale-and-min bytes
        header = [_row_fields(fields[name], groups) for name in ("d", "dmin")]
        header.append(_row_fields(fields["sm"].reshape(rows, ns * 16, 1), groups).reshape(groups, ns, -1))
    else:
        header = [_row_fields(fields[name], groups) for name in ("d", "dmin")]
        header += [_row_fields(fields[name].reshape(rows, ns * 8, 1), groups).reshape(groups, ns, -1) for name in ("sc", "mn")]
    return torch.cat(header + [blocks.reshape(groups, ns, -1)], dim=-1).reshape(-1).contiguous()


def unpack_units(data: torch.Tensor, qtype: str, rows: int, k: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Inverse of :func:`pack_units`."""
    groups, nb = rows // GROUP_ROWS, k // BLOCK
    qn, qp = quant_bytes(qtype)
    qbytes = (qn + qp) * GROUP_ROWS
    fields: dict[str, torch.Tensor] = {}
    if qtype in K_TYPES:
        ns = k // SUPER
        s = data.reshape(groups, ns, -1)
        h = _HEADER_BYTES[qtype]
        blocks = s[..., h:].reshape(groups, nb, qbytes)
        if qtype in _SCALE_HEADER_TYPES:
            subs = (h - 32) // GROUP_ROWS
            fields["d"] = _unrow_fields(s[..., 0:32], 2)
            fields["sc"] = _unrow_fields(s[..., 32:h].reshape(groups, ns * subs, 16), 1).reshape(rows, ns, subs)
        elif qtype == "Q2_K":
            fields["d"] = _unrow_fields(s[..., 0:32], 2)
            fields["dmin"] = _unrow_fields(s[..., 32:64], 2)
            fields["sm"] = _unrow_fields(s[..., 64:h].reshape(groups, ns * 16, 16), 1).reshape(rows, ns, 16)
        else:
            fields["d"] = _unrow_fields(s[..., 0:32], 2)
            fields["dmin"] = _unrow_fields(s[..., 32:64], 2)
            fields["sc"] = _unrow_fields(s[..., 64:192].reshape(groups, ns * 8, 16), 1).reshape(rows, ns, 8)
            fields["mn"] = _unrow_fields(s[..., 192:320].reshape(groups, ns * 8, 16), 1).reshape(rows, ns, 8)
    else:
        g = data.reshape(groups, nb, group_block_bytes(qtype))
        blocks = g[..., :qbytes]
        fields["d"] = _unrow_fields(g[..., qbytes : qbytes + 32], 2)
        if qtype in ("Q4_1", "Q5_1"):
            fields["m"] = _unrow_fields(g[..., qbytes + 32 : qbytes + 64], 2)
    quants = deinterleave_rows(blocks[..., : qn * GROUP_ROWS].contiguous()).reshape(rows, nb, qn)
    q = quants if qtype == "Q8_0" else _nibbles(quants) if qn else torch.zeros(rows, nb, 32, dtype=torch.uint8)
    if qp:
        q = q | _unplane(deinterleave_rows(blocks[..., qn * GROUP_ROWS :].contiguous()).reshape(rows, nb, qp), qtype)
    return q.reshape(rows, k), fields


# ---------------------------------------------------------------- whole tensors


def pack_blocks(raw: torch.Tensor, qtype: str, shape: tuple[int, int]) -> torch.Tensor:
    """GGUF blocks uint8 [N, bytes_per_row] -> the kernel's flat uint8 layout (see qlinear.h)."""
    n, k = shape
    bw, bb = GGUF_BLOCKS[qtype]
    if k % bw or raw.dtype != torch.uint8 or tuple(raw.shape) != (n, k // bw * bb):
        raise ValueError(f"{qtype} blocks for shape {shape} must be uint8 [{n}, {k // bw * bb}], got {tuple(raw.shape)}")
    groups = -(-n // GROUP_ROWS)
    if groups * GROUP_ROWS != n:
        raw = torch.cat([raw, raw.new_zeros(groups * GROUP_ROWS - n, raw.shape[1])])
    q, fields = decode(raw, qtype, k)
    return pack_units(q, fields, qtype)


def unpack_blocks(data: torch.Tensor, qtype: str, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`pack_blocks`: uint8 [N, bytes_per_row] GGUF blocks."""
    n, k = shape
    groups = -(-n // GROUP_ROWS)
    q, fields = unpack_units(data, qtype, groups * GROUP_ROWS, k)
    return encode(q, fields, qtype)[:n].contiguous()


def dequantize_blocks(raw: torch.Tensor, qtype: str, shape: tuple[int, int]) -> torch.Tensor:
    """GGUF blocks uint8 [N, bytes_per_row] -> float32 [N, K], bit-identical to gguf.quants (the
    loader's dequantization, :func:`engine.loader.dequantize.dequantize_rows`)."""
    return dequantize_rows(raw.contiguous(), qtype, shape[1])


# The types a dense weight may be quantized to at load (--weight-quant): those gguf-py's quantizer
# writes (bit-identical to ggml's) and the kernels serve.  gguf-py has no K-type quantizer.
QUANTIZE_TYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")


def quantize_blocks(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """Dense [N, K] -> GGUF ``qtype`` blocks uint8 [N, K / 32 * bytes per block] (gguf-py's quantizer,
    as llama-quantize writes them from float32); float32 temporaries a few MiB at a time."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if qtype not in QUANTIZE_TYPES:
        raise ValueError(f"cannot quantize to {qtype}: one of {', '.join(QUANTIZE_TYPES)}")
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"{qtype} needs in_features divisible by {BLOCK}, got {k}")
    out = torch.empty(n, k // BLOCK * BLOCK_BYTES[qtype], dtype=torch.uint8)
    step = max(1, (1 << 22) // k)  # bounded float32 temporaries for big matrices (the LM head)
    for s in range(0, n, step):
        rows = w[s : s + step].float().numpy()
        out[s : s + step] = torch.from_numpy(quantize(rows, GGMLQuantizationType[qtype]).reshape(rows.shape[0], -1))
    return out
