"""GGUF reader: metadata -> ModelConfig, tensors -> dense HF-named weights plus raw quantized blocks.

The file is memory-mapped (``gguf.GGUFReader``, copy-on-write so torch can wrap the bytes without a
copy or a read-only warning). Dense weights are float32 dequantization (engine/loader/dequantize.py)
then a cast to the requested dtype, on a small thread pool (torch and numpy release the GIL).
The metadata is parsed by engine/loader/gguf_reader.py.

llama.cpp's converter permutes the rows of llama's Q and K projections into the interleaved-pair
RoPE layout ggml uses; we undo that exactly as transformers' GGUF loader does, for the dense weight
and the raw rows alike, so everything here is in Hugging Face layout. Qwen2 files are not permuted.
"""

from __future__ import annotations

import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy as np
import torch

from engine.config import ModelConfig
from engine.loader.dequantize import dequantize_rows
from engine.loader.gguf_reader import open_reader
from engine.loader.types import GGUFTensor, LoadedModel, ModelLoadError, ProgressFn, SkipDense, expected_weight_names
from engine.tokenizer import Tokenizer, gguf_field

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# Types gguf.quants can dequantize and that we have tested; others (IQ1_*, IQ2_*, TQ*, integer
# types) are refused.
SUPPORTED_QTYPES = frozenset(
    ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # llama3-style per-dimension RoPE divisors; folded into config.rope_scaling


def gguf_to_hf_name(name: str) -> Optional[str]:
    """Hugging Face parameter name for a GGUF tensor name, or None if unknown."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def qk_unpermute_index(rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation: ``new[i] = old[index[i]]``.

    Equivalent to transformers' ``w.reshape(n_head, dim, 2, ...).swapaxes(1, 2).reshape(w.shape)``
    with ``dim = rows // n_head // 2``; as a row gather it applies equally to raw quantized rows.
    """
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


def _llama3_rope_scaling(freqs: np.ndarray, theta: float, head_dim: int, reader: Any, arch: str) -> dict:
    """Recover the HF ``llama3`` rope_scaling dict from a ``rope_freqs`` tensor (the per-dimension
    divisors llama.cpp's converter writes), verifying the result reproduces the tensor exactly."""
    factor = float(freqs.max())
    orig = int(gguf_field(reader, f"{arch}.rope.scaling.original_context_length", 8192) or 8192)
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
        expected = np.empty_like(wavelen)
        for i, wl in enumerate(wavelen):
            if wl < orig / high:
                expected[i] = 1.0
            elif wl > orig / low:
                expected[i] = factor
            else:
                smooth = (orig / wl - low) / (high - low)
                expected[i] = 1.0 / ((1 - smooth) / factor + smooth)
        if np.allclose(expected, freqs.astype(np.float64), rtol=1e-4, atol=1e-6):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": orig,
            }
    raise ModelLoadError("unsupported RoPE scaling: the rope_freqs tensor does not match llama3-style scaling")


def _rope_scaling(reader: Any, arch: str, tensors: dict[str, Any], theta: float, head_dim: int) -> Optional[dict]:
    if _ROPE_FREQS in tensors:
        from gguf.quants import dequantize

        t = tensors[_ROPE_FREQS]
        freqs = dequantize(t.data, t.tensor_type).reshape(-1)
        return _llama3_rope_scaling(freqs, theta, head_dim, reader, arch)
    # Only what the model implements (engine/models/llama.py: default, linear, llama3); refusing the
    # rest here gives a clear load error instead of silently wrong positions.
    kind = gguf_field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = gguf_field(reader, f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    raise ModelLoadError(f"unsupported RoPE scaling type {kind!r} in GGUF metadata")


def _int_field(reader: Any, key: str, default: Optional[int] = None) -> int:
    value = gguf_field(reader, key, default)
    if isinstance(value, list):  # per-layer arrays: only uniform ones are supported
        if len(set(value)) != 1:
            raise ModelLoadError(f"per-layer values for {key} are not supported")
        value = value[0]
    if value is None:
        raise ModelLoadError(f"GGUF metadata is missing {key}")
    return int(value)


def config_from_gguf(reader: Any, tensors: Optional[dict[str, Any]] = None) -> ModelConfig:
    """ModelConfig from a GGUF's metadata (and tensor list: tied embeddings, biases, vocab rows)."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported model architecture {arch!r} in GGUF file (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if tensors is None:
        tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")

    hidden = _int_field(reader, f"{arch}.embedding_length")
    heads = _int_field(reader, f"{arch}.attention.head_count")
    kv_heads = _int_field(reader, f"{arch}.attention.head_count_kv", heads)
    head_dim = _int_field(reader, f"{arch}.attention.key_length", hidden // heads)
    rope_dims = gguf_field(reader, f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ModelLoadError(f"partial rotary embeddings (rope dims {rope_dims} != head_dim {head_dim}) are not supported")
    theta = float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0))

    embd_rows = int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes are (in, out)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = gguf_field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else embd_rows)
    if int(vocab) != embd_rows:  # the embedding is what the logits are computed over
        vocab = embd_rows

    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=_int_field(reader, f"{arch}.feed_forward_length"),
        num_hidden_layers=_int_field(reader, f"{arch}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6 if arch == "qwen2" else 1e-5)),
        max_position_embeddings=_int_field(reader, f"{arch}.context_length", 4096),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=_rope_scaling(reader, arch, tensors, theta, head_dim),
    )


def _plan(reader: Any, cfg: ModelConfig) -> list[tuple[str, Any]]:
    """(hf_name, reader tensor) pairs to load, after checking names and quant types."""
    plan = []
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            continue
        hf = gguf_to_hf_name(t.name)
        if hf is None:
            raise ModelLoadError(f"unexpected tensor {t.name!r} in GGUF file for architecture {cfg.architecture!r}")
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_QTYPES:
            raise ModelLoadError(
                f"unsupported quantization type {qtype} (tensor {t.name}); supported: {', '.join(sorted(SUPPORTED_QTYPES))}"
            )
        plan.append((hf, t))
    missing = expected_weight_names(cfg) - {hf for hf, _ in plan}
    if missing:
        raise ModelLoadError(f"GGUF file is missing tensors: {', '.join(sorted(missing)[:5])}")
    return plan


def raw_rows(t: Any) -> torch.Tensor:
    """A reader tensor's bytes as uint8 [rows, bytes_per_row] (rows: every dim but the innermost),
    a view of the memory map."""
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost-first
    return torch.from_numpy(np.asarray(t.data).view(np.uint8).reshape(max(1, math.prod(shape[:-1])), -1))


def dequantize_tensor(t: Any) -> torch.Tensor:
    """float32 values of a reader tensor in HF shape (``[out, in]`` for matrices)."""
    shape = tuple(int(d) for d in reversed(t.shape))
    return dequantize_rows(raw_rows(t), t.tensor_type.name, shape[-1]).reshape(shape)


def _unpermute_heads(cfg: ModelConfig, hf: str) -> Optional[int]:
    """The head count whose llama.cpp row permutation ``hf`` carries (llama q/k), else None."""
    if cfg.architecture == "llama":
        if ".q_proj." in hf:
            return cfg.num_attention_heads
        if ".k_proj." in hf:
            return cfg.num_key_value_heads
    return None


def _raw_tensor(t: Any, hf: str, cfg: ModelConfig) -> GGUFTensor:
    """A 2-D tensor's raw blocks in HF row order: a view of the memory map, or for llama q/k a
    row-gathered copy (the only rows that move)."""
    shape = tuple(int(d) for d in reversed(t.shape))
    raw = raw_rows(t)
    n_head = _unpermute_heads(cfg, hf)
    if n_head is not None:
        if shape[0] % (2 * n_head):
            raise ModelLoadError(f"{t.name} has {shape[0]} rows, not divisible into {n_head} heads")
        raw = raw.index_select(0, qk_unpermute_index(shape[0], n_head))
    return GGUFTensor(qtype=t.tensor_type.name, data=raw, shape=shape, file_offset=None if n_head else int(t.data_offset))


def _dense(t: Any, dtype: torch.dtype, gt: Optional[GGUFTensor]) -> torch.Tensor:
    """The dense weight in ``dtype``, HF layout: from the (already un-permuted) raw rows of a 2-D
    tensor, else from the reader tensor."""
    if gt is None:
        dense = dequantize_tensor(t)
    else:
        dense = dequantize_rows(gt.data, gt.qtype, gt.shape[1])
    # F32 dequantization returns a view of the mapped file: copy so weights own their memory.
    return dense.to(dtype, copy=t.tensor_type.name == "F32")


def load_gguf(
    path: str, dtype: torch.dtype, progress: Optional[ProgressFn] = None, skip_dense: Optional[SkipDense] = None
) -> LoadedModel:
    """Load a GGUF file: config, dense weights in ``dtype``, raw 2-D blocks, tokenizer.

    ``skip_dense`` (see :data:`engine.loader.types.SkipDense`) names the weights the caller serves from
    their raw blocks alone: they get no dense copy (``weights`` lacks them), which for a model the
    packed kernels serve saves dequantizing the whole file (seconds, and a bf16 copy 2-4x its size).
    """
    reader = open_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = config_from_gguf(reader, tensors)
    try:
        tokenizer = Tokenizer.from_gguf(reader)
    except ValueError as e:
        raise ModelLoadError(f"cannot build the tokenizer from {os.path.basename(path)}: {e}") from None
    cfg.bos_token_id = tokenizer.bos_token_id
    cfg.eos_token_ids = tokenizer.eos_token_ids
    plan = _plan(reader, cfg)

    raw = {hf: _raw_tensor(t, hf, cfg) for hf, t in plan if len(t.shape) == 2}
    skip = set(skip_dense(cfg, raw)) if skip_dense is not None else set()
    dense_plan = [(hf, t) for hf, t in plan if hf not in skip]
    weights: dict[str, torch.Tensor] = {}
    total = len(dense_plan)
    workers = max(1, min(4, len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [(hf, pool.submit(_dense, t, dtype, raw.get(hf))) for hf, t in dense_plan]
        for done, (hf, fut) in enumerate(futures, 1):
            weights[hf] = fut.result()
            if progress is not None:
                progress(f"loading weights {done}/{total}")
    return LoadedModel(config=cfg, weights=weights, tokenizer=tokenizer, gguf_tensors=raw, source=path)
