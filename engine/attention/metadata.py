"""Per-step attention metadata: one description of the batch that every layer's attention reads.

The model runner builds it once per step (``build_attention_metadata``) from each scheduled
request's computed tokens, new tokens and block ids; the forward context hands it to every
attention layer.  It also carries the native kernel's plan for the batch (``plans``): the
validated metadata and the split of the batch into work units depend only on the batch and
the layer shapes, which every layer of a model shares, so the first layer's call builds it
and the others reuse it (``dispatch.paged_attention``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch


@dataclass
class CPUAttentionMetadata:
    """Per-step description of a mixed batch, shared by every layer.

    Requests are laid out decodes first, then prefills (whole prompts or prompt
    chunks after already-cached context).  Token ``t`` of request ``i`` sits in
    rows ``query_start_loc[i]:query_start_loc[i+1]`` and attends to cache
    positions ``[0, seq_lens[i])``; its own position is
    ``seq_lens[i] - query_len + (t - query_start_loc[i])``.
    """

    num_actual_tokens: int
    num_decodes: int  # requests with exactly one query token, first in the batch
    num_decode_tokens: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs], context length including this step's tokens
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens], block_id * block_size + offset; negative = padding
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    # Host-side copies, so kernels that loop in Python (the ref kernel) avoid .tolist() per layer.
    query_start_loc_list: Optional[list[int]] = None
    seq_lens_list: Optional[list[int]] = None
    # Native kernel plans for this batch by ISA (dispatch.paged_attention); empty until the first layer's call.
    plans: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def query_start_locs(self) -> list[int]:
        """``query_start_loc`` as a list (the host-side copy where there is one)."""
        return self.query_start_loc_list if self.query_start_loc_list is not None else self.query_start_loc.tolist()

    def seq_lens_host(self) -> list[int]:
        """``seq_lens`` as a list (the host-side copy where there is one)."""
        return self.seq_lens_list if self.seq_lens_list is not None else self.seq_lens.tolist()


def metadata_from_lens(
    query_lens: Sequence[int], seq_lens: Sequence[int], block_table: torch.Tensor, slot_mapping: Optional[torch.Tensor] = None
) -> CPUAttentionMetadata:
    """Metadata for a batch given per request query lengths, context lengths and a block table
    (``[num_reqs, max_blocks]`` int32); the kernel self-check, tests and benchmarks build batches with it.
    ``slot_mapping`` defaults to no writes (all zeros: the caller writes the cache itself)."""
    qsl = [0, *itertools.accumulate(query_lens)]
    num_decodes = sum(1 for n in query_lens if n == 1)
    return CPUAttentionMetadata(
        num_actual_tokens=qsl[-1],
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64) if slot_mapping is None else slot_mapping,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_list=qsl,
        seq_lens_list=list(seq_lens),
    )


def build_attention_metadata(
    num_computed: Sequence[int], num_new: Sequence[int], block_ids: Sequence[list[int]], block_size: int
) -> tuple[CPUAttentionMetadata, torch.Tensor]:
    """The step's metadata and each token's position (int64 ``[num_tokens]``).

    Request ``i`` has ``num_computed[i]`` tokens in the cache already and runs ``num_new[i]``
    new ones, whose K/V go to slots of its blocks ``block_ids[i]``.  Positions and slots are
    computed for the whole batch at once with numpy rather than request by request.
    """
    num_reqs = len(num_new)
    query_start = [0, *itertools.accumulate(num_new)]
    seq_lens = [a + n for a, n in zip(num_computed, num_new)]
    max_blocks = max((len(b) for b in block_ids), default=1)
    block_table = np.array([b + [0] * (max_blocks - len(b)) for b in block_ids], dtype=np.int32)
    num_tokens = query_start[-1]
    rows = np.repeat(np.arange(num_reqs), num_new)  # the request of each token
    offsets = np.array(num_computed, dtype=np.int64) - np.array(query_start[:-1], dtype=np.int64)
    positions = np.arange(num_tokens, dtype=np.int64) + offsets[rows]
    slots = block_table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    num_decodes = sum(1 for n in num_new if n == 1)
    meta = CPUAttentionMetadata(
        num_actual_tokens=num_tokens,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slots),
        max_query_len=max(num_new, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_list=query_start,
        seq_lens_list=seq_lens,
    )
    return meta, torch.from_numpy(positions)
