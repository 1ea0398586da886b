"""Packed low-bit weights (GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks) for the
small-batch matmuls of decode.

Decode reads every weight once per token, so its speed is bytes per token over memory bandwidth.
GGUF files already ship the linear weights as 4.5-8.5 bit blocks; keeping those blocks (instead of
dequantizing to bf16, 16 bits) and multiplying them directly, as llama.cpp does, reads 2-3.5x
fewer bytes and is exact with respect to the weights: the float reference model is the dequantized
file.  The native kernel (``engine/csrc/qlinear.cpp``) rounds each 32-block of the activation row
to integers with one float scale per block and runs integer dot products (AVX-512 VNNI, AVX-VNNI,
AVX2, scalar; picked at run time).  That rounding is the only approximation:

* ``act_bits=16`` (default): 15-bit integers as two int8 digits.  On the default model over 64
  greedy decode steps the logits stay within 0.013 of the float32 reference (64/64 tokens agree);
  a bf16 model's own rounding (0.85) dwarfs it.  Twice the integer work of int8, which costs
  nothing at batch 1 (memory-bound) and up to ~1.5x at 16-32 rows.
* ``act_bits=8``: llama.cpp's int8 activations: max logit error 1.44, 63/64 tokens agree.

(``python -m benchmarks.linear_kernels --accuracy`` measures these.)

Prefill batches are compute-bound: ``Linear`` sends batches of at most ``packed_max_rows`` rows
here (:func:`default_max_rows`: 48 for Q4, 32 for Q8_0) and larger ones to the dense matmul, or,
when the engine asks for it (``EngineConfig.large_batch_matmul``, on by default for bf16 runs),
here too with int8 activations: VNNI int8 dot products outrun oneDNN's bf16 GEMM by 1.1-1.4x at
32-1024 rows on the development host (``benchmarks/linear_kernels.py``, column "packed a8").

Packed layout (built by ``engine/layers/gguf_blocks.py`` with torch ops, described in
``engine/csrc/qlinear.h``): groups of 16 output rows, each a sequential run of "group-blocks" whose
quants are interleaved in 4-byte words so one vector instruction advances 16 rows at once.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import nn

from engine import envs
from engine.layers import gguf_blocks
from engine.layers.gguf_blocks import QTYPE_IDS, deinterleave_rows as _deinterleave_rows, interleave_rows as _interleave_rows
from engine.loader.gguf import dequantize_rows

if TYPE_CHECKING:
    from engine.layers.linear import Linear
    from engine.loader import GGUFTensor

logger = logging.getLogger(__name__)

BLOCK = gguf_blocks.BLOCK
BLOCK_BYTES = {q: b for q, (w, b) in gguf_blocks.GGUF_BLOCKS.items() if w == BLOCK}  # GGUF bytes per 32 weights (32-weight types)
GROUP_ROWS = gguf_blocks.GROUP_ROWS
GROUP_BLOCK_BYTES = {q: gguf_blocks.group_block_bytes(q) for q in QTYPE_IDS}  # average, per 16 rows x 32 weights
# The routing constants below come in two families by bytes per weight: "Q4" for the 4.5-5.5 bit
# types (Q4_*, Q5_*), "Q8" for the 6.6-8.5 bit ones (Q6_K, Q8_0), whose block kernel saves fewer
# bytes over the dense or row-int8 paths and does more unpacking per byte than Q4's.
FAMILY = {"Q4_0": "Q4", "Q4_1": "Q4", "Q5_0": "Q4", "Q5_1": "Q4", "Q4_K": "Q4", "Q5_K": "Q4", "Q6_K": "Q8", "Q8_0": "Q8"}
ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx-vnni", 3: "avx512-vnni", 4: "amx-int8"}  # amx-int8: row-int8 only

# Largest batch that goes to the packed kernel, by (qtype family, activation bits).  Measured with
# benchmarks/linear_kernels.py on a 2-core AVX-512 VNNI host (no AMX) at the default model's
# shapes, dense bf16 ``F.linear`` (oneDNN) overtakes the packed kernel at about: Q4 a16 64-96 rows,
# Q8_0 a16 48-64, a8 beyond 96 / 64.  Decode is memory-bound and the packed kernel reads 3.2x (Q4)
# / 1.9x (Q8_0) fewer bytes; past a few dozen rows both are compute-bound, a16 does twice the
# integer dot products of a8, and Q8_0 saves fewer bytes, so its crossover comes first.  The
# defaults sit below those crossovers, leaving room for hosts whose dense GEMM is relatively
# faster (AMX); rerun the benchmark there.  CPUSERVE_PACKED_MAX_ROWS overrides them all; 0
# disables the packed path.
MAX_ROWS = {("Q4", 16): 48, ("Q8", 16): 32, ("Q4", 8): 64, ("Q8", 8): 64}
DEFAULT_MAX_ROWS = MAX_ROWS[("Q4", 16)]
# When larger batches may use int8 activations, the weight's own (16-bit) precision is kept only
# where it costs nothing: up to 4 rows, memory-bound.  From 8 rows int8 is ~1.4x faster.
MAX_ROWS_BEFORE_INT8 = 4

# Batches of at least this many rows (above the small-batch limit) use the row-scaled int8 copy
# when there is one, by the source blocks' family.  With the weights streamed from memory
# (benchmarks/linear_kernels.py, 2-core AVX-512 VNNI host), against the block kernel with int8
# activations: Q4 layers 0.6-0.8x at 8 rows (the copy reads 1.6x the bytes), 0.9-1.04x at 16,
# 1.05-1.12x at 20, 1.1-1.2x at 32, 1.35-1.45x at 455; the Q8_0 LM head (the copy reads fewer
# bytes) 1.25x from 8 rows, 1.5x at 32.
ROWS_INT8_MIN_ROWS = {"Q4": 20, "Q8": 8}
# Where the Q4 copies start to win depends on the core's integer throughput against its memory
# bandwidth (the copy reads 1.6x the bytes): ~20 rows on the 2-core AMD Zen 5 above, ~6-8 on a
# 2-core Intel Xeon (AVX-512 VNNI, 15 GB/s a thread: 1.17-1.25x at 8 rows, 1.3-1.5x at 12-16).
# So the engine times these batch sizes on the model's own projections at load
# (tune_rows_int8_min_rows); CPUSERVE_ROWS_INT8_MIN_ROWS pins a value instead.
ROWS_INT8_CANDIDATES = (6, 8, 12, 16, 20)
# Switches whose timed total is within this fraction of the fastest count as tied, and the tie
# goes to the most rows: the copies are the less accurate path (benchmarks.quality: 96.4% greedy
# agreement where they take every step, 97.4% for the blocks with int8 activations), and on a
# noisy host a near-tie flipped between loads (the Intel host: 12 rows in most, 8 in some, which
# moved the default path's agreement between 98.2% and 96.6%).
ROWS_INT8_TIE = 0.01

# Activation precision inside the kernel: 16 = each 32-block rounded to 15 bits (two int8 digits,
# twice the integer dot products; error ~3e-5 of the block max, below bf16's own rounding), 8 =
# llama.cpp's int8 (error ~4e-3 of the block max).  CPUSERVE_PACKED_ACT_BITS overrides.
DEFAULT_ACT_BITS = 16


def _native() -> Optional[Any]:
    from engine import native

    return native.module_with("qlinear_forward")


def _native_argmax(op_name: str, x: torch.Tensor, *args: Any) -> Optional[torch.Tensor]:
    """Each row's argmax (int64 [M]) from the named fused-argmax op of a packed or row-int8 weight;
    None where the op is missing, x is not a bf16/float32 matrix, or a value was NaN (the op then
    returns an empty tensor): the caller takes the logits instead."""
    op = getattr(_native(), op_name, None)
    if op is None or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        return None
    ids = op(x, *args)
    return ids if ids.numel() == x.shape[0] else None


def native_available() -> bool:
    return _native() is not None


def available_isas() -> list[str]:
    """The block kernels' paths usable here, best last."""
    mod = _native()
    return [ISA_NAMES[i] for i in mod.qlinear_isas()] if mod is not None else []


def rows_isas() -> list[str]:
    """The row-int8 kernel's paths usable here, best last (scalar, avx512-vnni, amx-int8)."""
    mod = _native()
    return [ISA_NAMES[i] for i in mod.qlinear_rows_isas()] if mod is not None and hasattr(mod, "qlinear_rows_isas") else []


def rows_int8_fast() -> bool:
    """Whether this CPU has a fast path for the row-int8 kernel (AVX-512 VNNI or AMX int8;
    elsewhere only the scalar reference exists, and the block kernels serve large batches)."""
    return len(rows_isas()) > 1


def isa_id(isa: Optional[str]) -> int:
    """-1 (best) for None, else the native path id of a name in :data:`ISA_NAMES`."""
    if isa is None:
        return -1
    for k, v in ISA_NAMES.items():
        if v == isa:
            return k
    raise ValueError(f"unknown instruction-set path {isa!r}; known: {', '.join(ISA_NAMES.values())}")


class _WeightShape:
    """``out_features`` / ``in_features`` of a weight held as ``shape = (N, K)``."""

    shape: tuple[int, int]

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]


class PackedWeight(_WeightShape):
    """A weight [out_features, in_features] held as packed GGUF blocks; ``self(x, bias)`` = F.linear.

    ``isa`` pins an instruction-set path (tests, benchmarks); None takes the best one.  Without the
    native extension the call falls back to dequantize-then-matmul (correct but slow; the model
    never attaches a packed weight in that case, see :func:`attach_packed`).
    """

    def __init__(
        self,
        data: torch.Tensor,
        qtype: str,
        shape: tuple[int, int],
        isa: Optional[str] = None,
        act_bits: Optional[int] = None,
    ) -> None:
        n, k = shape
        groups = -(-n // GROUP_ROWS)
        expected = groups * (k // BLOCK) * GROUP_BLOCK_BYTES[qtype]
        if data.dtype != torch.uint8 or data.numel() != expected or k % gguf_blocks.block_weights(qtype):
            raise ValueError(f"packed {qtype} data of {data.numel()} bytes does not fit shape {shape}")
        self.data = data.contiguous()
        self.qtype = qtype
        self.qtype_id = QTYPE_IDS[qtype]
        self.shape = (int(n), int(k))
        self.isa = isa
        self._isa_id = isa_id(isa)
        self.act_bits = default_act_bits() if act_bits is None else int(act_bits)
        if self.act_bits not in (8, 16):
            raise ValueError(f"act_bits must be 8 or 16, got {act_bits}")
        self._op = None

    @property
    def isa_id(self) -> int:
        """The instruction-set path as the native op takes it (-1: the best one)."""
        return self._isa_id

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def with_isa(self, isa: Optional[str], act_bits: Optional[int] = None) -> "PackedWeight":
        """The same packed data, pinned to another instruction-set path (and activation precision)."""
        return PackedWeight(self.data, self.qtype, self.shape, isa, self.act_bits if act_bits is None else act_bits)

    def __call__(
        self, x: torch.Tensor, bias: Optional[torch.Tensor] = None, act_bits: int = 0, float32_out: bool = False
    ) -> torch.Tensor:
        """``x @ W.T + bias``; ``act_bits`` (8 or 16) overrides this weight's activation precision;
        ``float32_out`` returns float32 whatever x's dtype (logits)."""
        op = self._op
        if op is None:
            mod = _native()
            op = self._op = mod.qlinear_forward if mod is not None else False
        if x.dim() != 2:
            lead = x.shape[:-1]
            return self(x.reshape(-1, x.shape[-1]), bias, act_bits, float32_out).view(*lead, self.shape[0])
        out_dtype = torch.float32 if float32_out else x.dtype
        if op is False:
            y = x.float() @ self.dequantize().t()
            if bias is not None:
                y = y + bias.float()
            return y.to(out_dtype)
        bits = act_bits or self.act_bits
        if x.dtype not in (torch.bfloat16, torch.float32):
            return op(x.float(), self.data, self.qtype_id, self.shape[0], self.shape[1],
                      None if bias is None else bias.float(), self._isa_id, bits).to(out_dtype)
        return op(x, self.data, self.qtype_id, self.shape[0], self.shape[1], bias, self._isa_id, bits, float32_out)

    def argmax(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None, act_bits: int = 0) -> Optional[torch.Tensor]:
        """``self(x, bias, act_bits, float32_out=True).argmax(-1)`` (int64 [M]) without writing the
        product: greedy tokens straight from a small batch's LM head (a decode step at batch 1 wrote
        196 KB of float32 logits that the sampler then read back).  None where a value was NaN (or
        there is no native op): the caller then takes the logits."""
        return _native_argmax(
            "qlinear_argmax", x, self.data, self.qtype_id, self.shape[0], self.shape[1], bias, self._isa_id,
            act_bits or self.act_bits,
        )

    def to_gguf_blocks(self) -> torch.Tensor:
        """The raw GGUF blocks, uint8 [out_features, bytes_per_row] (inverse of the packing)."""
        return unpack_blocks(self.data, self.qtype, self.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [out_features, in_features]."""
        return dequantize_blocks(self.to_gguf_blocks(), self.qtype, self.shape)

    def __repr__(self) -> str:
        return (
            f"PackedWeight({self.qtype}, shape={self.shape}, {self.nbytes / 2**20:.2f} MiB, "
            f"isa={self.isa or 'best'}, act_bits={self.act_bits})"
        )


class PackedParts(_WeightShape):
    """Row-stacked packed weights of different qtypes, ``self(x, bias)`` = F.linear of their stack.

    A merged projection whose sources differ in type (a Q4_K_M file's qkv_proj: q and k in Q4_K,
    v in Q6_K in half the layers) keeps each source's own blocks instead of going dense; each part
    is one kernel call into its slice of the output columns.  The fused decoder layer takes single
    packed weights only, so such a layer runs the modular path.
    """

    def __init__(self, parts: Sequence[PackedWeight]) -> None:
        if len(parts) < 2 or len({p.in_features for p in parts}) != 1 or any(p.out_features % GROUP_ROWS for p in parts[:-1]):
            raise ValueError("packed parts need one in_features and whole 16-row groups in all but the last")
        self.parts = list(parts)
        self.shape = (sum(p.out_features for p in parts), parts[0].in_features)
        # routing (max rows, row-int8 switch) follows the qtype holding the most rows
        self.qtype = max(parts, key=lambda p: p.out_features).qtype
        self.act_bits = parts[0].act_bits
        self.isa = parts[0].isa

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def with_isa(self, isa: Optional[str], act_bits: Optional[int] = None) -> "PackedParts":
        return PackedParts([p.with_isa(isa, act_bits) for p in self.parts])

    def __call__(
        self, x: torch.Tensor, bias: Optional[torch.Tensor] = None, act_bits: int = 0, float32_out: bool = False
    ) -> torch.Tensor:
        outs, at = [], 0
        for p in self.parts:
            b = None if bias is None else bias[at : at + p.out_features]
            outs.append(p(x, b, act_bits, float32_out))
            at += p.out_features
        return torch.cat(outs, dim=-1)

    def argmax(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None, act_bits: int = 0) -> Optional[torch.Tensor]:
        """None: the caller takes the logits (parts serve merged layer projections, not LM heads)."""
        return None

    def rows_int8(self, isa: Optional[str] = None) -> "RowInt8Weight":
        """The row-int8 copy of the stack: the parts' copies end to end (whole groups each)."""
        copies = [rows_int8_from(p, isa) for p in self.parts]
        return RowInt8Weight(
            torch.cat([c.data for c in copies]), torch.cat([c.scales for c in copies]), self.shape, isa
        )

    def dequantize(self) -> torch.Tensor:
        """float32 [out_features, in_features]."""
        return torch.cat([p.dequantize() for p in self.parts])

    def __repr__(self) -> str:
        return f"PackedParts({', '.join(repr(p) for p in self.parts)})"


class RowInt8Weight:
    """A weight [out_features, in_features] as int8 with one float scale per output row, for large
    batches; ``self(x, bias)`` = F.linear with x rounded to integers inside the kernel.

    Built from a :class:`PackedWeight` (:func:`rows_int8_from`), it trades the file's per-block
    scales (exact w.r.t. the weights) for per-row ones, a second rounding of each weight to 1/254
    of its row's largest magnitude, so that the kernel's inner loop is integer dot products and
    one FMA per block: 1.3-1.5x the block kernel's speed from ~16 rows up on the development host
    (``benchmarks/linear_kernels.py``), 1.6x the bytes of Q4_1.  The accuracy cost is measured with
    the other paths (``benchmarks/quality.py``).

    How x is rounded depends on the kernel (``act_bits``; 0 = the kernel's own): AVX-512 VNNI
    rounds each 32-block to int8 with its own scale (8); AMX int8 tiles round each whole row to
    15 bits (16), summing the row's products in int32 tiles with no per-block float work, ~30x
    less rounding error on the default model's activations.  The scalar reference runs either;
    each fast kernel gives its reference's bits.  AMX needs in_features divisible by 64 and at
    most 65536 (int32 sums); other widths take the AVX-512 kernel.
    """

    def __init__(
        self, data: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], isa: Optional[str] = None, act_bits: int = 0
    ) -> None:
        n, k = shape
        groups = -(-n // GROUP_ROWS)
        if data.dtype != torch.uint8 or data.numel() != groups * k * GROUP_ROWS or k % BLOCK:
            raise ValueError(f"row-int8 data of {data.numel()} bytes does not fit shape {shape}")
        if scales.dtype != torch.float32 or scales.numel() != groups * GROUP_ROWS:
            raise ValueError(f"row-int8 scales must be float32 [{groups * GROUP_ROWS}]")
        self.data = data.contiguous()
        self.scales = scales.contiguous()
        self.shape = (int(n), int(k))
        self.isa = isa
        self.isa_id = isa_id(isa)
        self.act_bits = act_bits
        mod = _native()
        self._op = getattr(mod, "qlinear_rows_forward", None) if mod is not None else None
        if self._op is None:
            raise RuntimeError("row-int8 weights need the native extension")

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scales.numel()

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None, float32_out: bool = False) -> torch.Tensor:
        """``x @ W.T + bias`` in x's dtype, or float32 with ``float32_out``."""
        if x.dim() != 2:
            lead = x.shape[:-1]
            return self(x.reshape(-1, x.shape[-1]), bias, float32_out).view(*lead, self.shape[0])
        if x.dtype not in (torch.bfloat16, torch.float32):
            b = None if bias is None else bias.float()
            y = self._op(x.float(), self.data, self.scales, self.shape[0], self.shape[1], b, self.isa_id, False, self.act_bits)
            return y if float32_out else y.to(x.dtype)
        return self._op(x, self.data, self.scales, self.shape[0], self.shape[1], bias, self.isa_id, float32_out, self.act_bits)

    def argmax(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """``self(x, bias, float32_out=True).argmax(-1)`` (int64 [M]) without writing the product:
        greedy tokens straight from the LM head.  None where a value was NaN (or the extension
        predates the op): the caller then takes the logits."""
        return _native_argmax(
            "qlinear_rows_argmax", x, self.data, self.scales, self.shape[0], self.shape[1], bias, self.isa_id,
            self.act_bits,
        )

    def dequantize(self) -> torch.Tensor:
        """float32 [out_features, in_features]: exactly the weights the kernel multiplies."""
        n, k = self.shape
        groups = -(-n // GROUP_ROWS)
        q = _deinterleave_rows(self.data.reshape(groups, k // BLOCK, BLOCK * GROUP_ROWS)).reshape(groups * GROUP_ROWS, k)
        return ((q.to(torch.int16) - 128).float() * self.scales[:, None])[:n]

    def __repr__(self) -> str:
        return f"RowInt8Weight(shape={self.shape}, {self.nbytes / 2**20:.2f} MiB, isa={self.isa or 'best'})"


def quantize_rows_int8(w: torch.Tensor, isa: Optional[str] = None) -> RowInt8Weight:
    """Dense [N, K] -> int8 per output row (scale = row max |w| / 127, round half to even)."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"row-int8 needs in_features divisible by {BLOCK}, got {k}")
    groups = -(-n // GROUP_ROWS)
    data = torch.empty(groups * GROUP_ROWS, k, dtype=torch.uint8)
    scales = torch.zeros(groups * GROUP_ROWS, dtype=torch.float32)
    data[n:] = 128
    step = max(1, (1 << 22) // k)  # bounded float32 temporaries for big matrices (the LM head)
    for s in range(0, n, step):
        e = min(n, s + step)
        b = w[s:e].float()
        d = b.abs().amax(dim=1) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        data[s:e] = (torch.round(b * inv[:, None]).clamp(-127, 127).to(torch.int16) + 128).to(torch.uint8)
        scales[s:e] = d
    packed = _interleave_rows(data.reshape(groups, GROUP_ROWS, k // BLOCK, BLOCK)).reshape(-1).contiguous()
    return RowInt8Weight(packed, scales, (int(n), int(k)), isa)


def rows_int8_from(packed: "PackedWeight | PackedParts", isa: Optional[str] = None) -> RowInt8Weight:
    """The row-int8 copy of a packed weight: ``quantize_rows_int8(packed.dequantize())``, computed
    natively a row at a time (bit-identical; the torch ops' float32 temporaries took ~0.85 s of the
    default model's start-up, the native pass ~0.1 s)."""
    if isinstance(packed, PackedParts):
        return packed.rows_int8(isa)
    data, scales = _native().qlinear_rows_from_packed(packed.data, packed.qtype_id, *packed.shape)
    return RowInt8Weight(data, scales, packed.shape, isa)


# ---------------------------------------------------------------- layout


def pack_blocks(raw: torch.Tensor, qtype: str, shape: tuple[int, int]) -> torch.Tensor:
    """GGUF blocks uint8 [N, bytes_per_row] -> the kernel's flat uint8 layout (see qlinear.h)."""
    n, k = shape
    bw, bb = gguf_blocks.GGUF_BLOCKS[qtype]
    if k % bw or raw.dtype != torch.uint8 or tuple(raw.shape) != (n, k // bw * bb):
        raise ValueError(f"{qtype} blocks for shape {shape} must be uint8 [{n}, {k // bw * bb}], got {tuple(raw.shape)}")
    groups = -(-n // GROUP_ROWS)
    if groups * GROUP_ROWS != n:
        raw = torch.cat([raw, raw.new_zeros(groups * GROUP_ROWS - n, raw.shape[1])])
    q, fields = gguf_blocks.decode(raw, qtype, k)
    return gguf_blocks.pack_units(q, fields, qtype)


def unpack_blocks(data: torch.Tensor, qtype: str, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`pack_blocks`: uint8 [N, bytes_per_row] GGUF blocks."""
    n, k = shape
    groups = -(-n // GROUP_ROWS)
    q, fields = gguf_blocks.unpack_units(data, qtype, groups * GROUP_ROWS, k)
    return gguf_blocks.encode(q, fields, qtype)[:n].contiguous()


def dequantize_blocks(raw: torch.Tensor, qtype: str, shape: tuple[int, int]) -> torch.Tensor:
    """GGUF blocks uint8 [N, bytes_per_row] -> float32 [N, K], bit-identical to gguf.quants (the
    loader's dequantization, :func:`engine.loader.gguf.dequantize_rows`)."""
    return dequantize_rows(raw.contiguous(), qtype, shape[1])


# ---------------------------------------------------------------- constructors


def packing_refusal(tensors: Sequence["GGUFTensor"]) -> Optional[str]:
    """Why the row-concatenation of these GGUF tensors cannot be packed (None: it can)."""
    if not tensors:
        return "no tensors"
    k = int(tensors[0].shape[1])
    if any(int(t.shape[1]) != k for t in tensors):
        return "in_features differ"
    for t in tensors:
        if t.qtype not in QTYPE_IDS:
            return f"{t.qtype} has no packed kernel"
        if k % gguf_blocks.block_weights(t.qtype):
            return f"{t.qtype} needs in_features divisible by {gguf_blocks.block_weights(t.qtype)}, got {k}"
    if len({t.qtype for t in tensors}) > 1 and any(int(t.shape[0]) % GROUP_ROWS for t in tensors[:-1]):
        return "mixed qtypes with a part of rows not divisible by 16"
    if not native_available():
        return "no native extension"
    return None


def packable(tensors: Sequence["GGUFTensor"]) -> bool:
    """Whether :func:`pack_gguf` packs these tensors (:func:`packing_refusal` finds no reason not to)."""
    return packing_refusal(tensors) is None


def pack_gguf(
    tensors: Sequence["GGUFTensor"], isa: Optional[str] = None, act_bits: Optional[int] = None
) -> "Optional[PackedWeight | PackedParts]":
    """Pack the row-concatenation of GGUF tensors (e.g. q, k, v -> qkv_proj), or None when there is
    no kernel for them (:func:`packing_refusal` says why).  Tensors of one qtype become one
    PackedWeight; mixed qtypes a PackedParts of each run of equal ones."""
    if packing_refusal(tensors) is not None:
        return None
    runs: list[list["GGUFTensor"]] = []
    for t in tensors:
        if runs and runs[-1][0].qtype == t.qtype:
            runs[-1].append(t)
        else:
            runs.append([t])
    parts = []
    for run in runs:
        qtype, k = run[0].qtype, int(run[0].shape[1])
        n = sum(int(t.shape[0]) for t in run)
        raw = run[0].data if len(run) == 1 else torch.cat([t.data for t in run], dim=0)
        parts.append(PackedWeight(pack_blocks(raw, qtype, (n, k)), qtype, (n, k), isa, act_bits))
    return parts[0] if len(parts) == 1 else PackedParts(parts)


def quantize_q8_0_blocks(w: torch.Tensor) -> torch.Tensor:
    """Dense [N, K] -> GGUF Q8_0 blocks uint8 [N, K/32 * 34], bit-identical to gguf.quants / ggml."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 needs in_features divisible by {BLOCK}, got {k}")
    out = torch.empty(n, k // BLOCK, BLOCK_BYTES["Q8_0"], dtype=torch.uint8)
    step = max(1, (1 << 22) // k)  # bounded float32 temporaries for big matrices (the LM head)
    for s in range(0, n, step):
        b = w[s : s + step].float().reshape(-1, k // BLOCK, BLOCK)
        d = b.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        v = b * inv
        a = v.abs()
        fl = a.floor()
        q = torch.sign(v) * (fl + torch.floor(2 * (a - fl)))  # round half away from zero, as ggml's roundf
        out[s : s + step, :, 0:2] = d.half().view(torch.uint8)
        out[s : s + step, :, 2:] = q.to(torch.int8).view(torch.uint8)
    return out.reshape(n, -1)


def quantize_q8_0(w: torch.Tensor, isa: Optional[str] = None, act_bits: Optional[int] = None) -> PackedWeight:
    """Q8_0-quantize a dense weight [N, K] (opt-in, lossy: ~0.4% relative error per weight)."""
    n, k = w.shape
    return PackedWeight(pack_blocks(quantize_q8_0_blocks(w), "Q8_0", (n, k)), "Q8_0", (int(n), int(k)), isa, act_bits)


# ---------------------------------------------------------------- wiring into the model


def default_max_rows(qtype: str = "Q4_1", act_bits: Optional[int] = None, large_act_bits: int = 0) -> int:
    """Largest batch sent to the packed kernel at the weight's own activation precision
    (env CPUSERVE_PACKED_MAX_ROWS overrides)."""
    env = envs.CPUSERVE_PACKED_MAX_ROWS
    if env is not None:
        return max(0, env)
    bits = default_act_bits() if act_bits is None else act_bits
    if large_act_bits and large_act_bits < bits:
        return MAX_ROWS_BEFORE_INT8
    return MAX_ROWS[(FAMILY[qtype], bits)]


def default_act_bits() -> int:
    env = envs.CPUSERVE_PACKED_ACT_BITS
    return env if env is not None else DEFAULT_ACT_BITS


def attach_packed(
    linear: "Linear",
    packed: "Optional[PackedWeight | PackedParts]",
    max_rows: Optional[int] = None,
    large_act_bits: int = 0,
    rows_int8: bool = False,
) -> bool:
    """Route ``linear``'s batches of at most ``max_rows`` rows to ``packed`` (and, with
    ``large_act_bits``, larger ones too, at that activation precision; with ``rows_int8`` as
    well, those of :data:`ROWS_INT8_MIN_ROWS` rows or more to a row-scaled int8 copy); False if
    not attached (None, shape mismatch, or no native kernel: the dense path then serves every batch)."""
    if packed is None:
        return False
    if packed.shape != (linear.out_features, linear.in_features):
        raise ValueError(f"packed weight {packed.shape} does not match linear {(linear.out_features, linear.in_features)}")
    if not native_available():
        return False
    linear.packed = packed
    if max_rows is None:
        max_rows = default_max_rows(packed.qtype, packed.act_bits, large_act_bits)
    linear.packed_max_rows = max_rows
    linear.large_act_bits = large_act_bits
    linear.rows_int8 = rows_int8_from(packed) if rows_int8 and large_act_bits else None
    linear.rows_int8_min_rows = ROWS_INT8_MIN_ROWS[FAMILY[packed.qtype]]
    return True


def _large_batch_packed(model: nn.Module) -> list["Linear"]:
    """The model's Linears whose large batches run on their packed blocks (those a row-int8 copy can serve)."""
    from engine.layers.linear import Linear

    return [m for m in model.modules() if isinstance(m, Linear) and m.packed is not None and m.large_act_bits]


def rows_int8_bytes(model: nn.Module) -> int:
    """Bytes the row-int8 copies of the model's large-batch packed Linears take (or would): one
    byte per weight plus a float32 scale per row, rows padded to whole groups of 16."""
    total = 0
    for lin in _large_batch_packed(model):
        n, k = lin.packed.shape
        rows = -(-n // GROUP_ROWS) * GROUP_ROWS
        total += rows * k + 4 * rows
    return total


def rows_int8_decision(cost: int, budget: Optional[int]) -> tuple[bool, str]:
    """Whether to make the row-int8 copies that take ``cost`` bytes, under a budget of ``budget``
    bytes (None: the user asked for them whatever they take), and why, for the start-up log."""
    mib = f"{cost / 2**20:.0f} MiB"
    if budget is None:
        return True, f"on ({mib}): --large-batch-matmul int8_rows"
    if cost <= budget:
        return True, f"on ({mib}, within the {budget / 2**20:.0f} MiB budget of --rows-int8-budget-gb)"
    return False, (
        f"off: they would take {mib}, over the {budget / 2**20:.0f} MiB budget of --rows-int8-budget-gb "
        "(raise it, or --large-batch-matmul int8_rows, to make them)"
    )


def attach_rows_int8(model: nn.Module) -> int:
    """Give each large-batch packed Linear its row-int8 copy (what ``attach_packed(..., rows_int8=True)``
    does one at a time), for when the engine has decided they fit its budget; returns their bytes."""
    total = 0
    for lin in _large_batch_packed(model):
        if lin.rows_int8 is None:
            lin.rows_int8 = rows_int8_from(lin.packed)
        total += lin.rows_int8.nbytes
    return total


def release_dense_weights(model: nn.Module) -> int:
    """Free the dense weight of every Linear whose packed copies serve every batch size (packed
    with ``large_act_bits``: small batches on the blocks, large ones on the blocks or the row-int8
    copy), unless another module shares it (a tied embedding).  Returns the bytes freed: for the
    default model in bf16 ~210 MB of resident memory nothing would read again."""
    from engine.layers.linear import Linear

    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
    freed = 0
    for lin in model.modules():
        if isinstance(lin, Linear) and lin.packed is not None and lin.large_act_bits and id(lin.weight) not in shared:
            freed += lin.weight.numel() * lin.weight.element_size()
            lin.weight = nn.Parameter(lin.weight.new_empty(0, lin.in_features), requires_grad=False)
    return freed


def dense_summary(reasons: Sequence[tuple[str, str]]) -> str:
    """One log line's worth of (module name, reason) pairs: names that differ only in their layer
    index and share the reason are counted together, e.g. "mlp.down_proj in 16 layers (Q3_K
    8192x2048: Q3_K has no packed kernel)"."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, why in reasons:
        parts = name.split(".")
        key = ".".join(parts[2:]) if parts[0] == "layers" and len(parts) > 2 else name
        groups.setdefault((key, why), []).append(name)
    return "; ".join(
        f"{key} in {len(names)} layers ({why})" if len(names) > 1 or names[0] != key else f"{key} ({why})"
        for (key, why), names in groups.items()
    )


_MERGED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.down_proj": ("mlp.down_proj",),
}


_MERGED_INTO = {src: merged for merged, srcs in _MERGED.items() for src in srcs}
EMBEDDING = "model.embed_tokens.weight"
_UNQUANTIZED = ("F32", "F16", "BF16")


def _linear_sources(name: str, gguf_tensors: dict[str, "GGUFTensor"]) -> list[str]:
    """HF names of the GGUF weights whose rows make the model's Linear ``name`` (``lm_head`` or
    ``layers.<i>.<self_attn|mlp>.<proj>``): q, k, v for qkv_proj; the token embedding for a tied head."""
    if name == "lm_head":
        return ["lm_head.weight"] if "lm_head.weight" in gguf_tensors else [EMBEDDING]
    parts = name.split(".")
    base, key = ".".join(parts[:-2]), ".".join(parts[-2:])
    return [f"model.{base}.{s}.weight" for s in _MERGED.get(key, (key,))]


def _gguf_linears(gguf_tensors: dict[str, "GGUFTensor"]) -> set[str]:
    """Module names of the Linears that these GGUF weights (HF names) make: the inverse of _linear_sources."""
    names = {"lm_head"}
    for hf in gguf_tensors:
        parts = hf.removeprefix("model.").removesuffix(".weight").split(".")  # layers.<i>.<block>.<proj>
        if len(parts) == 4 and parts[0] == "layers" and ".".join(parts[2:]) in _MERGED_INTO:
            names.add(".".join(parts[:2]) + "." + _MERGED_INTO[".".join(parts[2:])])
    return names


def dense_free_weights(gguf_tensors: dict[str, "GGUFTensor"], tied: bool, large_act_bits: int) -> set[str]:
    """HF names of the GGUF weights the engine serves from their blocks alone, so the loader need
    not dequantize them (``engine.loader.SkipDense``).

    A projection's weights when :func:`attach_gguf_weights` packs them and large batches use the
    packed blocks too (``large_act_bits``: then :func:`release_dense_weights` frees the dense copy);
    with dense large batches every projection keeps its dense weight.  The token embedding when it
    is quantized and nothing else reads its dense rows: untied, or tied to a head served so
    (engine.layers.embedding then dequantizes the rows a step looks up).  Empty without the native
    extension (nothing is packed).
    """
    if not native_available():
        return set()
    free: set[str] = set()
    if large_act_bits:
        for name in _gguf_linears(gguf_tensors):
            sources = _linear_sources(name, gguf_tensors)
            if all(s in gguf_tensors for s in sources) and packable([gguf_tensors[s] for s in sources]):
                free.update(sources)
    embedding = gguf_tensors.get(EMBEDDING)
    if embedding is not None and embedding.qtype not in _UNQUANTIZED and not tied:
        free.add(EMBEDDING)
    return free


def choose_rows_int8_switch(best: dict[tuple[int, str], float]) -> int:
    """The switch, from ``best[m, "blocks" | "rows"]`` (seconds for one batch of each candidate
    size on either path): the most rows among those whose total over one batch of every size is
    within :data:`ROWS_INT8_TIE` of the least total (so one noisy size cannot flip it alone)."""

    def total(switch: int) -> float:  # every candidate batch size once, with the switch at `switch`
        return sum(best[m, "blocks" if m < switch else "rows"] for m in ROWS_INT8_CANDIDATES)

    fastest = min(total(m) for m in ROWS_INT8_CANDIDATES)
    return max(m for m in ROWS_INT8_CANDIDATES if total(m) <= fastest * (1 + ROWS_INT8_TIE))


def tune_rows_int8_min_rows(model: nn.Module, passes: int = 3) -> Optional[int]:
    """Set the model's Q4 projections' row-int8 switch (``rows_int8_min_rows``) to the one of
    :data:`ROWS_INT8_CANDIDATES` that, on this host, minimises the time of one batch of each
    candidate size (below the switch on the block kernel with int8 activations, from it on the
    row-int8 copies; near-ties go to the most rows: choose_rows_int8_switch); returns it (None:
    nothing to tune).

    Timed over every projection in turn, so their weights stream from memory as in a step,
    best of ``passes`` alternating passes: ~0.2 s at load for the default model.
    """
    from engine.layers.linear import Linear

    tuned = [
        lin
        for lin in model.modules()
        if isinstance(lin, Linear) and lin.rows_int8 is not None and lin.large_act_bits and FAMILY[lin.packed.qtype] == "Q4"
    ]
    if not tuned:
        return None
    env = envs.CPUSERVE_ROWS_INT8_MIN_ROWS
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"CPUSERVE_ROWS_INT8_MIN_ROWS={env!r}: expected a row count (a positive integer)")
        chosen = int(env)
    else:
        dtype = tuned[0].weight.dtype
        sizes = {lin.in_features for lin in tuned}
        xs = {(m, k): torch.randn(m, k).to(dtype) for m in ROWS_INT8_CANDIDATES for k in sizes}
        best = {(m, path): float("inf") for m in ROWS_INT8_CANDIDATES for path in ("blocks", "rows")}
        for _ in range(passes):
            for m in ROWS_INT8_CANDIDATES:
                for path in ("blocks", "rows"):
                    t0 = time.perf_counter()
                    for lin in tuned:
                        x = xs[m, lin.in_features]
                        if path == "rows":
                            lin.rows_int8(x, lin.bias)
                        else:
                            lin.packed(x, lin.bias, lin.large_act_bits)
                    best[m, path] = min(best[m, path], time.perf_counter() - t0)

        chosen = choose_rows_int8_switch(best)
        logger.info(
            "row-int8 copies from %d rows (row-int8 / block kernel time at %s rows: %s)",
            chosen,
            "/".join(map(str, ROWS_INT8_CANDIDATES)),
            " ".join(f"{best[m, 'rows'] / best[m, 'blocks']:.2f}" for m in ROWS_INT8_CANDIDATES),
        )
    for lin in tuned:
        lin.rows_int8_min_rows = chosen
    return chosen


def attach_gguf_weights(
    model: nn.Module,
    gguf_tensors: dict[str, "GGUFTensor"],
    max_rows: Optional[int] = None,
    quantize_dense: bool = False,
    large_act_bits: int = 0,
    rows_int8: bool = False,
) -> dict[str, Any]:
    """Attach packed weights to every Linear of a Llama-family model (HF names, as the loader gives).

    Each projection takes its GGUF blocks when there is a kernel for their qtype (a merged one of
    mixed qtypes as :class:`PackedParts`); otherwise, with
    ``quantize_dense`` (opt-in, lossy), a Q8_0 copy of its dense weight; else it stays dense.  The
    LM head uses ``lm_head.weight`` or, tied, ``model.embed_tokens.weight``.  With ``rows_int8``
    (and ``large_act_bits``) each also gets a row-scaled int8 copy for large batches.  Returns
    counts, packed bytes (both copies) and, under "dense_reasons", (name, "qtype shape: reason")
    for each projection left dense (:func:`dense_summary` words them for the load log).
    """
    from engine.layers.linear import Linear

    stats: dict[str, Any] = {"packed": 0, "quantized": 0, "dense": 0, "bytes": 0, "dense_reasons": []}
    if not native_available() or (max_rows is not None and max_rows <= 0):
        why = "no native extension" if not native_available() else "packed path disabled (max rows 0)"
        stats["dense_reasons"] = [(n, why) for n, m in model.named_modules() if isinstance(m, Linear)]
        stats["dense"] = len(stats["dense_reasons"])
        return stats
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        sources = _linear_sources(name, gguf_tensors)
        packed, why = None, "not in the file as blocks"
        if all(s in gguf_tensors for s in sources):
            found = [gguf_tensors[s] for s in sources]
            why = packing_refusal(found)
            if why is None:
                packed = pack_gguf(found)
            else:  # for the load log: which tensors run dense, and why
                kinds = ", ".join(f"{t.qtype} {int(t.shape[0])}x{int(t.shape[1])}" for t in found)
                why = f"{kinds}: {why}"
        if packed is not None:
            stats["packed"] += 1
        elif quantize_dense:
            packed = quantize_q8_0(module.weight.data)
            stats["quantized"] += 1
        else:
            stats["dense"] += 1
            stats["dense_reasons"].append((name, why))
            continue
        attach_packed(module, packed, max_rows, large_act_bits, rows_int8)
        stats["bytes"] += packed.nbytes + (module.rows_int8.nbytes if module.rows_int8 is not None else 0)
    return stats
