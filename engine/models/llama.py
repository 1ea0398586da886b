"""Llama-family decoder (Llama, SmolLM, Qwen2): one implementation, configured by ModelConfig.

Works on a flattened batch: ``input_ids`` and ``positions`` are [num_tokens] for
every request of the step back to back; the attention layer finds each
request's rows and cache from the step's forward context.
"""

from __future__ import annotations

import math
from typing import Any, Collection, Optional

import torch
from torch import nn

from engine.attention.layer import Attention
from engine.config import CacheConfig, ModelConfig
from engine.layers.fused import add_rms_norm_, apply_rope_, silu_and_mul
from engine.layers.linear import Linear


# Submodules are called through ``.forward`` on the per-layer path: ``nn.Module.__call__``'s hook
# bookkeeping, which this engine never uses, was ~5% of a small model's batch-1 decode step.


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), computed in place: x and residual are consumed."""
        return add_rms_norm_(x, residual, self.weight, self.eps)


def rope_cos_sin(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """float32 [max_positions, head_dim] = [cos | sin] of the rotary angles (HF's default and llama3 scaling)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind != "default":
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, cache: CacheConfig, dtype: torch.dtype, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, False, dtype)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            layer_name=f"model.layers.{layer_idx}.self_attn.attn",
            kv_cache_dtype=cache.kv_cache_dtype,
            block_size=cache.block_size,
            model_dtype=dtype,
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor, out_rows: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)
        q, k, v = qkv.split_with_sizes(self.qkv_sizes, dim=-1)
        q, k = apply_rope_(positions, q, k, cos_sin, self.head_dim)  # in place: q, k stay views of qkv
        out = self.attn.forward(q, k, v)
        return self.o_proj.forward(out if out_rows is None else out[out_rows])


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, cache: CacheConfig, dtype: torch.dtype, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, cache, dtype, layer_idx)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # Set by bind_packed: this layer's packed path as two native calls around the attention
        # layer (engine/csrc/decoder_layer.cpp), for batches of at most packed_max_rows rows.
        self.packed: Optional[Any] = None
        self.packed_max_rows = 0

    def bind_packed(self) -> bool:
        """Route this layer through the native composite when all four projections hold packed
        weights (and the extension has it): the same kernels in the same order as the modular
        path below, minus most of the Python around them (batch-1 forward + logits 3.48 ->
        2.95 ms)."""
        from engine import native

        mod = native.module_with("PackedDecoderLayer")
        attn, mlp = self.self_attn, self.mlp
        projs = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        model_dtype = attn.qkv_proj.weight.dtype in (torch.bfloat16, torch.float32)  # the fused ops' dtypes
        from engine.quant.weights import PackedParts, PackedWeight

        if mod is None or not model_dtype or any(not isinstance(p.packed, (PackedWeight, PackedParts)) for p in projs):
            return False

        def spec(lin: Linear) -> Any:
            p, r = lin.packed, lin.rows_int8
            rows = (None, None, -1) if r is None else (r.data, r.scales, r.isa_id)
            if isinstance(p, PackedParts):  # mixed qtypes (a Q4_K_M file's Q6_K v rows): one kernel call a part
                parts, at = [], 0
                for w in p.parts:
                    bias = None if lin.bias is None else lin.bias[at : at + w.out_features]
                    parts.append(mod.PackedProjection(w.data, w.qtype_id, w.out_features, w.in_features, bias,
                                                      w.isa_id, w.act_bits, 0, 0))
                    at += w.out_features
                return mod.PackedProjection.stacked(parts, lin.packed_max_rows, lin.large_act_bits, lin.bias,
                                                    *rows, lin.rows_int8_min_rows)
            return mod.PackedProjection(p.data, p.qtype_id, p.shape[0], p.shape[1], lin.bias, p.isa_id,
                                        p.act_bits, lin.packed_max_rows, lin.large_act_bits, *rows,
                                        lin.rows_int8_min_rows)

        self.packed = mod.PackedDecoderLayer(
            self.input_layernorm.weight, self.post_attention_layernorm.weight, self.input_layernorm.eps,
            *[spec(p) for p in projs], attn.head_dim, attn.q_size, attn.kv_size,
        )
        # Larger batches take the modular path, unless every projection sends them to its packed kernel too.
        big = all(p.large_act_bits for p in projs)
        self.packed_max_rows = 1 << 62 if big else min(p.packed_max_rows for p in projs)
        return True

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        out_rows: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream) of every token, or of the rows ``out_rows`` lists: past
        the attention (which caches every token's K/V and attends for all) the layer runs on
        those rows alone.  With no rows it returns empty tensors."""
        if self.packed is not None and x.shape[0] <= self.packed_max_rows:
            q, k, v, out, residual = self.packed.pre_attention(x, residual, positions, cos_sin)
            self.self_attn.attn.forward(q, k, v, out)
            if out_rows is not None:
                out, residual = out[out_rows], residual[out_rows]
            return self.packed.post_attention(out, residual), residual
        x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(positions, x, cos_sin, out_rows)
        if out_rows is not None:
            residual = residual[out_rows]
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class LlamaForCausalLM(nn.Module):
    """Decoder stack + LM head.  ``forward`` returns final hidden states; ``compute_logits`` the rows asked for."""

    def __init__(self, config: ModelConfig, cache: CacheConfig, dtype: torch.dtype, max_model_len: int) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        # Left uninitialised (load_weights fills it, or fails on a checkpoint without it): the random
        # init nn.Embedding runs otherwise took 0.17 s of every start-up for 49,152 x 576 values.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype)
        )
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, cache, dtype, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", rope_cos_sin(config, max_model_len), persistent=False)
        # Set by bind_packed_layers when every layer but the last runs natively: each one's three
        # calls (pre-attention, attention layer, post-attention), bound once, for the loop in forward.
        self.packed_body: Optional[list[tuple[Any, Any, Any]]] = None
        self.packed_body_max_rows = 0

    def bind_packed_layers(self) -> int:
        """Bind every decoder layer whose projections are all packed to the native composite
        (LlamaDecoderLayer.bind_packed); returns how many were."""
        bound = sum(layer.bind_packed() for layer in self.layers)
        body = self.layers[:-1]
        if len(body) and all(layer.packed is not None for layer in body):
            self.packed_body = [
                (layer.packed.pre_attention, layer.self_attn.attn.forward, layer.packed.post_attention) for layer in body
            ]
            self.packed_body_max_rows = min(layer.packed_max_rows for layer in body)
        return bound

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, out_rows: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Final hidden states of every token, or of the rows ``out_rows`` lists (in its order).

        A prompt chunk needs every layer's K/V for the tokens after it but logits from at most its
        last token, so with ``out_rows`` the last layer runs its o projection and MLP on those rows
        only, and on none when the list is empty (llama.cpp prunes its last layer the same way).
        Those rows' projections then route by their own count (a lone last token takes the packed
        small-batch kernel).  Four 1024-token prompts in 256-token chunks, engine alone, alternating
        step by step: 0.975-0.988x the time in five runs.
        """
        x = self.embed_tokens(input_ids)
        residual = None
        cos_sin = self.cos_sin
        *body, last = self.layers
        if self.packed_body is not None and x.shape[0] <= self.packed_body_max_rows:
            # LlamaDecoderLayer.forward's native path with its calls bound once, without a frame
            # and module lookups per layer.
            for pre_attention, attend, post_attention in self.packed_body:
                q, k, v, out, residual = pre_attention(x, residual, positions, cos_sin)
                attend(q, k, v, out)
                x = post_attention(out, residual)
        else:
            for layer in body:
                x, residual = layer.forward(positions, x, residual, cos_sin)
        x, residual = last.forward(positions, x, residual, cos_sin, out_rows)
        x, _ = self.norm.forward(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.forward(hidden, float32_out=True)

    def greedy_tokens(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """``compute_logits(hidden).argmax(-1)`` without the logits where the LM head can fuse it, else None."""
        return self.lm_head.argmax(hidden)

    def load_weights(self, weights: dict[str, torch.Tensor], absent: Collection[str] = ()) -> None:
        """Copy Hugging Face-named tensors in, merging q/k/v and gate/up into one matmul each.

        ``absent``: HF names the caller knowingly leaves out because it serves them another way
        (GGUF blocks: engine.quant.attach.dense_free_weights); their parameters stay uninitialised,
        for the caller to replace.  Any other missing weight is an error.
        """
        params = dict(self.named_parameters())
        consumed = {self.parameter_for(name)[0] for name in absent}

        def put(name: str, tensor: torch.Tensor, rows: slice | None = None) -> None:
            dst = params[name]
            (dst.data[rows] if rows is not None else dst.data).copy_(tensor)

        for name, tensor in weights.items():
            target, rows = self.parameter_for(name)
            if target == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if target not in params:
                raise KeyError(f"unexpected weight {name!r}")
            put(target, tensor, rows)
            consumed.add(target)
        missing = set(params) - consumed - ({"lm_head.weight"} if self.config.tie_word_embeddings else set())
        if missing:
            raise KeyError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")

    def parameter_for(self, name: str) -> tuple[str, Optional[slice]]:
        """(parameter name, its rows) that the HF-named weight ``name`` fills."""
        q, kv = self.config.num_attention_heads * self.config.head_dim, self.config.num_key_value_heads * self.config.head_dim
        inter = self.config.intermediate_size
        merged = {
            "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q)),
            "self_attn.k_proj": ("self_attn.qkv_proj", slice(q, q + kv)),
            "self_attn.v_proj": ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv)),
            "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, inter)),
            "mlp.up_proj": ("mlp.gate_up_proj", slice(inter, 2 * inter)),
        }
        target = name.removeprefix("model.")
        for src, (dst, sl) in merged.items():
            if f".{src}." in target:
                return target.replace(src, dst), sl
        return target, None
