"""Linear layers that hold a dense weight and, optionally, a packed low-bit copy for small batches.

Small batches (decode) are memory-bound: reading 4-bit or 8-bit blocks instead
of bf16 cuts the bytes per token, so they go to the packed kernel when one is
attached.  Large batches (prefill) are compute-bound: they go to the dense matmul,
or, where the engine allows it (``large_act_bits``), to the packed kernel with
int8 activations, whose integer dot products outrun bf16 ones, and from a few more
rows on to a row-scaled int8 copy of the weight (``rows_int8``), faster still.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        # Set by engine.quant.attach.attach_packed(); when it serves every batch size the engine
        # frees the dense weight (quant.release_dense_weights: an empty [0, in_features] tensor).
        self.packed: Optional[Any] = None
        self.packed_max_rows = 0
        self.large_act_bits = 0  # > 0: batches above packed_max_rows also go to the packed kernel
        # Set with large_act_bits by attach_packed: a row-scaled int8 copy for batches of at least
        # rows_int8_min_rows rows (engine.quant.weights.RowInt8Weight).
        self.rows_int8: Optional[Any] = None
        self.rows_int8_min_rows = 0
        # Set by engine.quant.routing.route_dense_bf16 for a dense bf16 weight: either the weight
        # repacked (dense_packed; the plain one freed) and dense_op(x, packed, n, bias, float32_out)
        # for every batch, or dense_op(x, weight, bias, float32_out) for up to dense_max_rows rows.
        self.dense_op: Optional[Any] = None
        self.dense_packed: Optional[torch.Tensor] = None
        self.dense_max_rows = 0

    def forward(self, x: torch.Tensor, float32_out: bool = False) -> torch.Tensor:
        """``x @ W.T + bias`` in x's dtype; ``float32_out`` (logits) returns float32, which the packed
        kernels write directly instead of rounding to bf16 and converting back."""
        if self.packed is not None:
            if x.shape[0] <= self.packed_max_rows:
                return self.packed(x, self.bias, float32_out=float32_out)
            if self._takes_rows_int8(x.shape[0]):
                return self.rows_int8(x, self.bias, float32_out)
            if self.large_act_bits:
                return self.packed(x, self.bias, self.large_act_bits, float32_out)
        if self.dense_packed is not None:
            y = self.dense_op(x.reshape(-1, self.in_features).to(torch.bfloat16), self.dense_packed, self.out_features,
                              self.bias, float32_out)
            return y.reshape(*x.shape[:-1], self.out_features)
        if x.shape[0] <= self.dense_max_rows and x.dim() == 2 and x.dtype == torch.bfloat16:
            return self.dense_op(x, self.weight, self.bias, float32_out)
        y = F.linear(x, self.weight, self.bias)
        return y.float() if float32_out else y

    def argmax(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``forward(x, float32_out=True).argmax(-1)`` on the path forward() takes for x's batch, where
        that is a packed kernel (which keeps each row's maximum instead of writing the product); else None."""
        if self.packed is None:
            return None
        m = x.shape[0]
        if m <= self.packed_max_rows:
            return self.packed.argmax(x, self.bias)
        if self._takes_rows_int8(m):
            return self.rows_int8.argmax(x, self.bias)
        return self.packed.argmax(x, self.bias, self.large_act_bits) if self.large_act_bits else None

    def _takes_rows_int8(self, m: int) -> bool:
        """Whether forward() sends a batch of m rows to the row-int8 copy."""
        return (
            self.packed is not None
            and self.rows_int8 is not None
            and self.packed_max_rows < m
            and m >= self.rows_int8_min_rows
        )
