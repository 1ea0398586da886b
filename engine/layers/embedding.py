"""A token embedding looked up from its GGUF blocks: no dense copy of the table.

A step reads a few hundred rows of the embedding at most, yet a dense bf16 table costs
``vocab x hidden x 2`` bytes resident (~200 MB for a 1B model's 49k x 2048); the file already
holds the table as quantized blocks.  ``BlockEmbedding`` gathers the step's rows of blocks and
dequantizes just those, with the loader's own dequantization, so its output is bit-identical to the
dense table's rows.  The blocks stay in the memory-mapped file where they can: only the pages of
rows actually looked up become resident, and they are the page cache's, not a private copy.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from engine.loader.types import GGUFTensor
from engine.loader.dequantize import dequantize_rows


class BlockEmbedding(nn.Module):
    """``forward(ids)`` = ``dense_table[ids]`` in ``dtype``, from raw GGUF rows uint8 [vocab, bytes_per_row]."""

    def __init__(self, blocks: torch.Tensor, qtype: str, shape: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[0] != shape[0]:
            raise ValueError(f"{qtype} embedding blocks {tuple(blocks.shape)} do not fit shape {shape}")
        self.blocks = blocks
        self.qtype = qtype
        self.num_embeddings, self.embedding_dim = int(shape[0]), int(shape[1])
        self.dtype = dtype

    @classmethod
    def from_gguf(cls, tensor: GGUFTensor, path: str, dtype: torch.dtype) -> "BlockEmbedding":
        """The embedding over its own read-only-in-practice mapping of ``path`` (copy-on-write, as the
        loader's), so the loader's mapping of the whole file can go; a private copy of the blocks
        where they are not the file's bytes in place (``file_offset`` None)."""
        rows, width = tensor.data.shape
        if tensor.file_offset is None:
            blocks = tensor.data.clone()
        else:
            mapped = np.memmap(path, dtype=np.uint8, mode="c", offset=tensor.file_offset, shape=(rows * width,))
            blocks = torch.from_numpy(mapped).view(rows, width)
        return cls(blocks, tensor.qtype, tensor.shape, dtype)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] int64 -> [num_tokens, embedding_dim] in ``dtype``."""
        return dequantize_rows(self.blocks.index_select(0, ids), self.qtype, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype} blocks ({self.nbytes / 2**20:.1f} MiB)"
