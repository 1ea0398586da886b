"""Packed low-bit weights (GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks) and the
native extension's matmuls over them.

Decode reads every weight once per token, so its speed is bytes per token over memory bandwidth:
keeping the file's 4.5-8.5 bit blocks and multiplying them directly, as llama.cpp does, reads
2-3.5x fewer bytes than bf16 and is exact with respect to the weights (the float reference model is
the dequantized file).  The kernel (``engine/csrc/qlinear.cpp``; AVX-512 VNNI, AVX-VNNI, AVX2,
scalar, picked at run time) rounds each 32-block of the activation row to integers with one float
scale per block: 15 bits as two int8 digits (``act_bits=16``, the default) or llama.cpp's int8
(``act_bits=8``).  That rounding is the only approximation (``python -m benchmarks.linear_kernels
--accuracy`` measures it).  Which batches reach these weights is engine/quant/routing.py's call;
building them from a file's tensors or a dense weight is engine/quant/packing.py's.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from engine.quant.blocks import (
    BLOCK,
    GROUP_BLOCK_BYTES,
    GROUP_ROWS,
    QTYPE_IDS,
    block_weights,
    deinterleave_rows,
    dequantize_blocks,
    interleave_rows,
    unpack_blocks,
)
from engine.quant.routing import default_act_bits

ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx-vnni", 3: "avx512-vnni", 4: "amx-int8"}  # amx-int8: row-int8 only


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
    never attaches a packed weight in that case, see :func:`engine.quant.attach.attach_packed`).
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
        if data.dtype != torch.uint8 or data.numel() != expected or k % block_weights(qtype):
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
        product: greedy tokens straight from a small batch's LM head, sparing the logits' write and
        read-back.  None where a value was NaN (or there is no native op): the caller then takes the logits."""
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
    is one kernel call into its slice of the output columns (in the fused decoder layer too:
    PackedProjection.stacked in engine/csrc/decoder_layer.cpp).
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
    one FMA per block: faster than the block kernel for large batches, at 1.6x the bytes of Q4_1
    (``benchmarks/linear_kernels.py``; the accuracy cost: ``benchmarks/quality.py``).

    How x is rounded depends on the kernel (``act_bits``; 0 = the kernel's own): AVX-512 VNNI
    rounds each 32-block to int8 with its own scale (8); AMX int8 tiles round each whole row to
    15 bits (16), summing the row's products in int32 tiles with no per-block float work (far
    less rounding error).  The scalar reference runs either;
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
        q = deinterleave_rows(self.data.reshape(groups, k // BLOCK, BLOCK * GROUP_ROWS)).reshape(groups * GROUP_ROWS, k)
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
    packed = interleave_rows(data.reshape(groups, GROUP_ROWS, k // BLOCK, BLOCK)).reshape(-1).contiguous()
    return RowInt8Weight(packed, scales, (int(n), int(k)), isa)


def rows_int8_from(packed: "PackedWeight | PackedParts", isa: Optional[str] = None) -> RowInt8Weight:
    """The row-int8 copy of a packed weight: ``quantize_rows_int8(packed.dequantize())``, computed
    natively a row at a time (bit-identical, without the torch ops' float32 temporaries)."""
    if isinstance(packed, PackedParts):
        return packed.rows_int8(isa)
    data, scales = _native().qlinear_rows_from_packed(packed.data, packed.qtype_id, *packed.shape)
    return RowInt8Weight(data, scales, packed.shape, isa)
