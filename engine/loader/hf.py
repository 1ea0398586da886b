"""Hugging Face directory reader: ``config.json`` + ``*.safetensors`` + ``tokenizer.json``.

Only safetensors are read (never pickle / ``torch.load``: a checkpoint must not be able to run code).
Both config spellings are understood: transformers 4 (``rope_theta``, ``rope_scaling``) and
transformers 5 (``rope_parameters`` holding both).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Optional

import torch

from engine.config import ModelConfig
from engine.loader.types import LoadedModel, ModelLoadError, ProgressFn, expected_weight_names
from engine.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
SUPPORTED_ROPE_TYPES = ("linear", "llama3")  # what engine/models/llama.py implements besides plain RoPE
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed by the model


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{os.path.dirname(path)} has no {os.path.basename(path)}; not a Hugging Face model directory") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _rope(cfg: dict) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from either config spelling; scaling is HF-style with a ``rope_type`` key,
    None for plain RoPE."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or params
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return float(theta), None
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return float(theta), scaling


def config_from_hf(cfg: dict) -> ModelConfig:
    """ModelConfig from a parsed ``config.json``; refuses features the engine does not implement."""
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported model architecture {', '.join(archs) or cfg.get('model_type') or 'unknown'} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported activation {cfg['hidden_act']!r} (only silu)")
    if arch == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ModelLoadError("Llama checkpoints with attention_bias/mlp_bias are not supported")
    if arch == "qwen2" and cfg.get("use_sliding_window"):
        raise ModelLoadError("Qwen2 sliding-window attention is not supported")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        theta, scaling = _rope(cfg)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2",  # Qwen2 always has q/k/v biases
            rope_scaling=scaling,
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing {e.args[0]!r}") from None


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map", {})
        files = sorted({os.path.join(path, f) for f in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"safetensors shard listed in the index is missing: {os.path.basename(missing[0])}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights in {path} (pickle checkpoints such as pytorch_model.bin are not loaded)"
        )
    return files


def load_hf_dir(path: str, dtype: torch.dtype, progress: Optional[ProgressFn] = None) -> LoadedModel:
    """Load a Hugging Face model directory with weights cast to ``dtype``."""
    from safetensors import safe_open

    raw_cfg = _read_json(os.path.join(path, "config.json"))
    cfg = config_from_hf(raw_cfg)
    try:
        tokenizer = Tokenizer.from_hf_dir(path)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {e}") from None
    cfg.bos_token_id = tokenizer.bos_token_id
    cfg.eos_token_ids = tokenizer.eos_token_ids

    files = _safetensors_files(path)
    handles: list[Any] = []
    keys: list[tuple[int, str]] = []
    try:
        for i, f in enumerate(files):
            handles.append(safe_open(f, framework="pt"))
            keys.extend((i, k) for k in handles[-1].keys() if not k.endswith(_IGNORED_SUFFIXES))
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ModelLoadError(f"cannot read safetensors file {os.path.basename(files[len(handles)])}: {e}") from None

    names = {k for _, k in keys}
    if not cfg.tie_word_embeddings and "lm_head.weight" not in names:
        cfg.tie_word_embeddings = True  # no separate head in the checkpoint: it shares the embedding
    expected = expected_weight_names(cfg)
    missing = expected - names
    if missing:
        raise ModelLoadError(f"checkpoint is missing weights: {', '.join(sorted(missing)[:5])}")
    unexpected = names - expected - {"lm_head.weight"}
    if unexpected:
        raise ModelLoadError(f"unexpected weights in checkpoint: {', '.join(sorted(unexpected)[:5])}")

    weights: dict[str, torch.Tensor] = {}
    wanted = [(i, k) for i, k in keys if k in expected]
    for done, (i, k) in enumerate(wanted, 1):
        weights[k] = handles[i].get_tensor(k).to(dtype)
        if progress is not None:
            progress(f"loading weights {done}/{len(wanted)}")
    return LoadedModel(config=cfg, weights=weights, tokenizer=tokenizer, gguf_tensors={}, source=path)
