"""Which kernel serves a packed Linear's batch: row limits by qtype family and activation
precision, the row-int8 copies' memory budget, and their batch-size switch, timed at load.

Decode (a few rows) is memory-bound, so the packed blocks, reading 2-3.5x fewer bytes than bf16,
win; past a few dozen rows matmuls are compute-bound and the dense GEMM or int8 paths catch up.
The constants below were measured with ``benchmarks/linear_kernels.py`` (figures in
benchmarks/HISTORY.md, "Packed-weight routing"); rerun it on hosts with another balance (AMX).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from engine import envs
from engine.quant.blocks import GROUP_ROWS

if TYPE_CHECKING:
    from engine.layers.linear import Linear

logger = logging.getLogger(__name__)

# Two families by bytes per weight: "Q4" for the 4.5-5.5 bit types, "Q8" for the 6.6-8.5 bit ones,
# whose block kernel saves fewer bytes over the dense or row-int8 paths and unpacks more per byte.
FAMILY = {
    "Q4_0": "Q4", "Q4_1": "Q4", "Q5_0": "Q4", "Q5_1": "Q4", "Q4_K": "Q4", "Q5_K": "Q4", "IQ4_NL": "Q4", "IQ4_XS": "Q4",
    "Q2_K": "Q4", "Q3_K": "Q4", "IQ3_S": "Q4", "IQ3_XXS": "Q4",
    "Q6_K": "Q8", "Q8_0": "Q8",
}

# Largest batch sent to the packed kernel, by (family, activation bits): below the measured
# crossovers with the dense GEMM, leaving room for hosts whose dense GEMM is relatively faster.
# CPUSERVE_PACKED_MAX_ROWS overrides them all; 0 disables the packed path.
MAX_ROWS = {("Q4", 16): 48, ("Q8", 16): 32, ("Q4", 8): 64, ("Q8", 8): 64}
DEFAULT_MAX_ROWS = MAX_ROWS[("Q4", 16)]
# With int8 activations allowed for larger batches, the 16-bit ones are kept only where they cost
# nothing: up to 4 rows, memory-bound.
MAX_ROWS_BEFORE_INT8 = 4

# Batches of at least this many rows (above the small-batch limit) use the row-int8 copy when
# there is one, by family: the Q4 copy reads 1.6x the bytes of its blocks, the Q8 one fewer.
ROWS_INT8_MIN_ROWS = {"Q4": 20, "Q8": 8}
# Where the Q4 copies start to win depends on the core's integer throughput against its memory
# bandwidth, so the engine times these batch sizes at load (tune_rows_int8_min_rows);
# CPUSERVE_ROWS_INT8_MIN_ROWS pins a value instead.
ROWS_INT8_CANDIDATES = (6, 8, 12, 16, 20)
# Timed totals within this fraction of the fastest are tied, and the tie goes to the most rows:
# the copies are the less accurate path, and a noisy host must not flip the choice between loads.
ROWS_INT8_TIE = 0.01

# Dense bf16 weights (a Hugging Face directory served as it is) are repacked for the native
# AVX512-BF16 kernel (engine/csrc/dense_bf16.cpp), which is faster than torch's bf16 GEMM (which
# reorders the weight at every call) at every batch size; a weight tied to the token embedding
# stays as it is, and batches of at most this many rows take the kernel's as-is variant, larger
# ones F.linear.
DENSE_BF16_MAX_ROWS = 16

# Activation precision inside the kernel: 16 = each 32-block rounded to 15 bits (two int8 digits;
# error ~3e-5 of the block max, below bf16's own rounding), 8 = llama.cpp's int8 (~4e-3).
# CPUSERVE_PACKED_ACT_BITS overrides.
DEFAULT_ACT_BITS = 16


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


def large_batch_packed(model: nn.Module) -> list["Linear"]:
    """The model's Linears whose large batches run on their packed blocks (those a row-int8 copy can serve)."""
    from engine.layers.linear import Linear

    return [m for m in model.modules() if isinstance(m, Linear) and m.packed is not None and m.large_act_bits]


def rows_int8_bytes(model: nn.Module) -> int:
    """Bytes the row-int8 copies of the model's large-batch packed Linears take (or would): one
    byte per weight plus a float32 scale per row, rows padded to whole groups of 16."""
    total = 0
    for lin in large_batch_packed(model):
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
    best of ``passes`` alternating passes.
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


def route_dense_bf16(model: nn.Module) -> tuple[int, int]:
    """Send every dense bf16 Linear (no packed weight) to the native AVX512-BF16 kernels where this
    CPU runs them: a weight the Linear owns alone is repacked (dense_bf16_pack: 16 output rows'
    element pairs a vector, the plain copy freed) and serves every batch size; one shared with
    another module (an LM head tied to the token embedding, whose lookup needs the rows) serves
    batches of up to DENSE_BF16_MAX_ROWS rows as it is.  Returns (repacked, as-is) counts."""
    from engine import native
    from engine.layers.linear import Linear

    mod = native.module_with("dense_bf16_packed_forward")
    if mod is None or not mod.dense_bf16_supported():
        return 0, 0
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
    repacked = as_is = 0
    for lin in model.modules():
        w = lin.weight if isinstance(lin, Linear) else None
        if w is None or lin.packed is not None or w.dtype != torch.bfloat16 or not w.numel() or not w.is_contiguous():
            continue
        if lin.bias is not None and (lin.bias.dtype != torch.bfloat16 or not lin.bias.is_contiguous()):
            continue  # the kernels take a contiguous bf16 bias only
        if id(w) in shared or w.shape[1] % 2:
            lin.dense_op, lin.dense_max_rows = mod.dense_bf16_forward, DENSE_BF16_MAX_ROWS
            as_is += 1
            continue
        lin.dense_packed = mod.dense_bf16_pack(w)
        lin.dense_op = mod.dense_bf16_packed_forward
        lin.weight = nn.Parameter(w.new_empty(0, lin.in_features), requires_grad=False)
        repacked += 1
    return repacked, as_is
