"""What every loader returns, raises and checks against: the shared vocabulary of gguf.py and hf.py.

A module of its own so that the readers and the package's ``load_model`` (which picks a reader)
import it one way, with no cycle between the package and its readers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Collection, Optional

import torch

from engine.config import ModelConfig

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

ProgressFn = Callable[[str], None]


class ModelLoadError(Exception):
    """A model could not be loaded; the message alone tells the user why (the CLI prints it, no traceback)."""


@dataclass
class GGUFTensor:
    """One weight matrix's raw GGUF blocks, kept for native quantized kernels.

    ``data`` holds the bytes exactly as stored (uint8, ``[rows, bytes_per_row]``); a row is one output
    feature, and blocks run along the input features. For llama q/k projections the rows are already
    un-permuted into Hugging Face order, so row ``i`` here dequantizes to row ``i`` of the dense weight.
    """

    qtype: str
    data: torch.Tensor
    shape: tuple[int, int]
    # Where ``data`` starts in the file when it is the file's own bytes in the file's order (a
    # view of the memory map), so a user of a few rows can map just this tensor; None for rows
    # the loader reordered (llama q/k).
    file_offset: Optional[int] = None


# Given the model's config and the raw blocks of every 2-D GGUF weight (HF names), the names whose
# dense copy the caller will never read (it serves them from the blocks): the loader skips them.
SkipDense = Callable[[ModelConfig, dict[str, GGUFTensor]], Collection[str]]


@dataclass
class LoadedModel:
    config: ModelConfig
    # HF names, dense, requested dtype; no lm_head.weight when tied, none of the load's skip_dense names
    weights: dict[str, torch.Tensor]
    tokenizer: "Tokenizer"
    gguf_tensors: dict[str, GGUFTensor] = field(default_factory=dict)  # 2-D weights only; empty for HF dirs
    source: str = ""


def expected_weight_names(cfg: ModelConfig) -> set[str]:
    """The HF parameter names a model with this config must have; loaders check against it so a
    truncated or mismatched checkpoint fails here with a clear message, not deep in the model code."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names.update(
            p + s
            for s in (
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
                "mlp.down_proj.weight",
            )
        )
        if cfg.attention_bias:
            names.update(p + f"self_attn.{x}_proj.bias" for x in "qkv")
    return names
