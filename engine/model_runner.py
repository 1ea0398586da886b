"""Scheduler output -> model inputs -> logits -> sampled tokens.

Owns the model weights and the KV-cache tensors (one per layer, laid out as
``engine/kv_cache/layout.py`` says, bound to the attention layers).  Each step it builds
the flattened input ids and the attention metadata (positions, slot mapping, query start
locations, sequence lengths, block tables: ``attention/metadata.py``), runs the model once
under a forward context carrying that metadata, and computes logits only for rows that
sample (plus prompt rows of requests that asked for prompt logprobs).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Collection, Optional

import torch

from engine.attention.metadata import CPUAttentionMetadata, build_attention_metadata
from engine.config import EngineConfig, ModelConfig
from engine.forward_context import ForwardContext, set_forward_context
from engine.kv_cache.layout import allocate_kv_cache, kv_cache_torch_dtype
from engine.models.llama import LlamaForCausalLM
from engine.request import Logprob, Request
from engine.sampler import fused_argmax, sample, top_logprobs
from engine.scheduler import SchedulerOutput
from engine.structured.masks import MaskBatch, MaskPlanner

logger = logging.getLogger(__name__)


@dataclass
class StepTimings:
    prepare_inputs_s: float = 0.0
    model_forward_s: float = 0.0
    kv_cache_update_s: float = 0.0
    attention_s: float = 0.0
    sampling_s: float = 0.0
    structured_mask_s: float = 0.0  # building and applying grammar masks (part of sampling_s, or overlapping the forward)


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request id -> token, for requests that sample this step
    logprobs: dict[str, Logprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Optional[Logprob]]] = field(default_factory=dict)  # appended chunk by chunk
    timings: StepTimings = field(default_factory=StepTimings)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, num_blocks: int) -> None:
        self.config = config
        self.model_config = model_config
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.dtype = config.torch_dtype
        self.model = LlamaForCausalLM(model_config, config.cache, self.dtype, max_model_len)
        self.num_blocks = num_blocks
        self.max_blocks_per_req = -(-max_model_len // self.block_size)
        self.kv_caches: list[torch.Tensor] = []
        self.masks = MaskPlanner(model_config.vocab_size)

    def load_weights(self, weights: dict[str, torch.Tensor], absent: Collection[str] = ()) -> None:
        """The model's weights (LlamaForCausalLM.load_weights; ``absent``: those served from GGUF blocks)."""
        self.model.load_weights(weights, absent)
        self.model.eval()

    def prefault_kv_cache(self, num_blocks: int) -> None:
        """Make the first ``num_blocks`` blocks of every layer's cache resident now: the pool hands
        out never-used blocks in id order, and a page's first touch (~2 us, ~28 us on a VM whose host
        has taken the guest's free memory back) would otherwise land on the first requests."""
        for cache in self.kv_caches:
            cache[:num_blocks].zero_()

    def allocate_kv_cache(self) -> None:
        """One tensor per layer, bound to its attention layer; pages become resident as they fill."""
        cache_dtype = kv_cache_torch_dtype(self.config.cache.kv_cache_dtype, self.dtype)
        mc = self.model_config
        layers = self.model.attention_layers()
        self.kv_caches = [
            allocate_kv_cache(self.num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim, cache_dtype)
            for _ in layers
        ]
        by_name = {layer.layer_name: layer for layer in layers}
        for layer, cache in zip(layers, self.kv_caches):
            target = layer.kv_sharing_target_layer_name
            layer.kv_cache = by_name[target].kv_cache if target else cache

    def attention_kernels(self) -> str:
        """The attention kernel path the layers run, for the start-up log."""
        layers = self.model.attention_layers()
        return layers[0].impl.describe() if layers else "none"

    # --- one step -----------------------------------------------------------------------

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, CPUAttentionMetadata, list[int]]:
        """The batch as tensors: token ids [T], positions [T], attention metadata, and the rows needing logits."""
        scheduled = out.scheduled
        starts = [s.request.num_computed_tokens for s in scheduled]
        counts = [s.num_new_tokens for s in scheduled]
        meta, positions = build_attention_metadata(starts, counts, [s.block_ids for s in scheduled], self.block_size)
        query_start = meta.query_start_locs()
        ids: list[int] = []
        for s, a, n in zip(scheduled, starts, counts):
            ids.extend(s.request.all_token_ids[a : a + n])
        logit_rows: list[int] = []
        for i, s in enumerate(scheduled):
            req = s.request
            if req.params.prompt_logprobs is not None and starts[i] < req.num_prompt_tokens:
                logit_rows.extend(range(query_start[i], query_start[i + 1]))
            elif s.samples:
                logit_rows.append(query_start[i + 1] - 1)
        return torch.tensor(ids, dtype=torch.long), positions, meta, logit_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        input_ids, positions, meta, logit_rows = self._prepare(out)
        t1 = time.perf_counter()
        ctx = ForwardContext(meta)
        # When every row needs logits (decode-only steps) the last layer is not pruned and nothing gathered.
        out_rows = None if len(logit_rows) == input_ids.shape[0] else torch.tensor(logit_rows, dtype=torch.long)
        # Only plain greedy rows, every row that needs logits sampling: the LM head may hand back their
        # tokens instead (Linear.argmax), without writing the logits (32 rows: 6.3 MB of float32).
        greedy = [s.request for s in out.scheduled if s.samples]
        fused = len(greedy) == len(logit_rows) and fused_argmax(greedy)
        # Constrained rows' masks: started when the last step committed its tokens, else now (a worker thread).
        masks = self.masks.for_step(greedy)
        with set_forward_context(ctx):
            hidden = self.model(input_ids, positions, out_rows)
            tokens = self.model.greedy_tokens(hidden) if fused else None
            logits = self.model.compute_logits(hidden) if logit_rows and tokens is None else None
        t2 = time.perf_counter()
        if tokens is None:
            result = self._sample(out, logits, logit_rows, meta, masks)
        else:
            result = RunnerOutput(sampled=dict(zip((r.request_id for r in greedy), tokens.tolist())))
        t3 = time.perf_counter()
        result.timings = StepTimings(
            t1 - t0, t2 - t1, ctx.kv_update_s, ctx.attention_s, t3 - t2, masks.seconds if masks is not None else 0.0
        )
        return result

    def _sample(
        self,
        out: SchedulerOutput,
        logits: Optional[torch.Tensor],
        logit_rows: list[int],
        meta: CPUAttentionMetadata,
        masks: Optional[MaskBatch] = None,
    ) -> RunnerOutput:
        result = RunnerOutput(sampled={})
        if logits is None:
            return result
        row_of = {r: i for i, r in enumerate(logit_rows)}
        qsl = meta.query_start_loc_list
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        for i, s in enumerate(out.scheduled):
            req = s.request
            start, end = qsl[i], qsl[i + 1]
            if req.params.prompt_logprobs is not None and req.num_computed_tokens < req.num_prompt_tokens:
                result.prompt_logprobs[req.request_id] = self._prompt_logprobs(req, s.num_new_tokens, logits, row_of, start)
            if s.samples:
                sample_rows.append(row_of[end - 1])
                sample_reqs.append(req)
        if sample_reqs:
            self._sample_rows(result, logits[sample_rows] if len(sample_rows) != logits.shape[0] else logits, sample_reqs, masks)
        return result

    def _sample_rows(self, result: RunnerOutput, logits: torch.Tensor, requests: list[Request], masks: Optional[MaskBatch]) -> None:
        """Sample ``requests`` from ``logits`` (row i request i's) into ``result``."""
        sampled = sample(logits, requests, masks)
        self.masks.commit(requests, sampled.token_ids)
        for req, token, lp in zip(requests, sampled.token_ids, sampled.logprobs):
            result.sampled[req.request_id] = token
            if lp is not None:
                result.logprobs[req.request_id] = lp

    def _prompt_logprobs(
        self, req: Request, n: int, logits: torch.Tensor, row_of: dict[int, int], start: int
    ) -> list[Optional[Logprob]]:
        """Logprob of each prompt token given the ones before it, for the prompt tokens this chunk predicts."""
        first = req.num_computed_tokens
        out: list[Optional[Logprob]] = [None] if first == 0 else []  # the first prompt token has no context
        # Row for position p predicts token p + 1; only predict tokens that are still prompt tokens.
        last = min(first + n, req.num_prompt_tokens - 1)
        if last <= first:
            return out
        rows = torch.tensor([row_of[start + (p - first)] for p in range(first, last)])
        targets = torch.tensor(req.prompt_token_ids[first + 1 : last + 1])
        out.extend(top_logprobs(logits[rows], targets, [req.params.prompt_logprobs] * len(targets)))
        return out
