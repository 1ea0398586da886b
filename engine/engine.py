"""The engine: one step = schedule -> run the model -> sample -> detokenize -> outputs.

``LLMEngine`` is the synchronous core.  ``LLM`` is the offline front door
(``LLM(model=...).generate(prompts, params)``); ``AsyncEngine`` (engine/async_engine.py)
runs the step loop on its own thread for the HTTP service.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import itertools
import logging
import os
import time
from typing import Callable, Optional, Sequence

import torch

from engine.attention.dispatch import int8_decodes_in_place
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVCacheManager, sizing
from engine.kv_cache.layout import resolve_kv_cache_dtype
from engine.loader import GGUFTensor, LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.output_processor import RequestTextState
from engine.request import (
    CompletionDelta,
    CompletionOutput,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    SamplingParamsError,
)
from engine.scheduler import Scheduler, SchedulerOutput
from engine.stats import RequestStats, StepStats
from engine.structured import GrammarCompiler, StructuredOutputError

logger = logging.getLogger(__name__)


# Limits that keep one request from taking the server: n sequences per prompt, stop strings
# (each is searched for in every step's new text), and a seed torch's generator accepts.
MAX_N = 128
MAX_STOP_STRINGS = 64
SEED_RANGE = (-(2**63), 2**63 - 1)


class RequestError(ValueError):
    """A request the engine cannot accept (too long, bad token ids...); ``param`` names the culprit."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        loaded: Optional[LoadedModel] = None,
        progress: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.config = config
        _bound_onednn_caches()
        torch.set_num_threads(config.num_threads)
        t0 = time.monotonic()
        loaded = loaded or load_model(config.model, config.torch_dtype, progress=progress, skip_dense=self._skip_dense)
        t_load = time.monotonic()
        self.model_config = loaded.config
        # "auto" KV cache resolved for this model and CPU, on a copy: everything below (the layers,
        # block sizing, the start-up log) reads the storage type it gets.
        int8_in_place = int8_decodes_in_place(config.torch_dtype, config.cache.block_size, loaded.config.head_dim)
        kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, config.torch_dtype, int8_in_place)
        config = self.config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_cache_dtype=kv_dtype))
        self.tokenizer = loaded.tokenizer
        self.model_name = config.served_model_name or default_model_name(loaded.source)
        self.max_model_len = min(
            config.scheduler.max_model_len or loaded.config.max_position_embeddings,
            loaded.config.max_position_embeddings,
        )
        num_blocks = self._num_blocks()
        self.runner = ModelRunner(config, loaded.config, self.max_model_len, num_blocks)
        absent = set(loaded.gguf_tensors) - set(loaded.weights)  # served from their blocks alone
        self.runner.load_weights(loaded.weights, absent)
        self._attach_packed_weights(loaded, absent)
        del loaded
        t_weights = time.monotonic()
        self.runner.allocate_kv_cache()
        self.kv = KVCacheManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching, self._prefix_cache_blocks(num_blocks)
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.text_states: dict[str, RequestTextState] = {}
        self.grammars = GrammarCompiler(self.tokenizer.backend.to_str(), self.tokenizer.vocab_size, self.tokenizer.eos_token_ids)
        self._arrival_seq = itertools.count()
        # Test-only fault injection: called with each step's SchedulerOutput before the model runs.
        self.fault_hook: Optional[Callable[[SchedulerOutput], None]] = None
        _release_freed_memory()
        self.load_time_s = time.monotonic() - t0
        reserve = self.kv.reserve_blocks  # 0 without prefix caching
        logger.info(
            "engine ready in %.1fs (file %.1fs, weights %.1fs): %s, %d layers, dtype %s, KV cache %d blocks x %d tokens "
            "= %d tokens (%.2f GiB, %s; cached prefixes keep up to %d freed blocks = %d tokens, %.0f MiB), "
            "attention kernels %s",
            self.load_time_s,
            t_load - t0,
            t_weights - t_load,
            self.model_name,
            self.model_config.num_hidden_layers,
            config.dtype,
            num_blocks,
            config.cache.block_size,
            num_blocks * config.cache.block_size,
            num_blocks * self.kv_block_bytes / 2**30,
            config.cache.kv_cache_dtype,
            reserve,
            reserve * config.cache.block_size,
            reserve * self.kv_block_bytes / 2**20,
            self.runner.attention_kernels(),
        )

    # --- set-up -------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV-cache block over all layers (keys, values, int8 scales)."""
        return sizing.kv_block_bytes(self.config, self.model_config)

    def _num_blocks(self) -> int:
        return sizing.num_blocks(self.config, self.model_config, self.max_model_len)

    def _prefix_cache_blocks(self, num_blocks: int) -> int:
        return sizing.prefix_cache_blocks(self.config, self.model_config, self.max_model_len, num_blocks)

    def _skip_dense(self, model_config: ModelConfig, gguf_tensors: dict[str, GGUFTensor]) -> set[str]:
        """The loader's ``skip_dense``: the GGUF weights this engine will serve from their blocks alone
        (packed projections, a quantized embedding), so it never dequantizes them."""
        if self.config.weight_quant == "none":
            return set()
        from engine.layers import quant

        large_act_bits = 8 if self.config.large_batch_int8 else 0
        return quant.dense_free_weights(gguf_tensors, model_config.tie_word_embeddings, large_act_bits)

    def _attach_packed_weights(self, loaded: LoadedModel, absent: set[str]) -> None:
        """Keep GGUF's low-bit blocks for small-batch matmuls where the native kernels exist.

        ``weight_quant``: "auto" packs the file's own blocks (exact w.r.t. the weights);
        "q8_0" also quantizes dense weights (HF checkpoints; lossy); "none" stays dense.
        ``large_batch_matmul`` decides whether batches above the small-batch limit use them too,
        and whether row-int8 copies serve the largest (within ``rows_int8_budget_gb``).  ``absent``:
        the weights loaded without a dense copy, which must end up served from their blocks.
        """
        if self.config.weight_quant == "none":
            self._check_served(absent)
            return
        from engine.layers import quant
        from engine.layers.embedding import BlockEmbedding

        model = self.runner.model
        large_int8 = self.config.large_batch_int8
        rows_int8 = self.config.large_batch_rows_int8
        if rows_int8 and not quant.rows_int8_fast():
            logger.info("no AVX-512 VNNI or AMX here: large batches use the packed blocks, not row-int8 copies")
            rows_int8 = False
        stats = quant.attach_gguf_weights(
            model,
            loaded.gguf_tensors,
            quantize_dense=self.config.weight_quant == "q8_0",
            large_act_bits=8 if large_int8 else 0,
        )
        if quant.EMBEDDING in absent:
            model.embed_tokens = BlockEmbedding.from_gguf(
                loaded.gguf_tensors[quant.EMBEDDING], loaded.source, self.config.torch_dtype
            )
            logger.info("token embedding looked up from its %s blocks (%.0f MiB, mapped from the file; no dense copy)",
                        model.embed_tokens.qtype, model.embed_tokens.nbytes / 2**20)
        if stats["dense"]:
            logger.info("dense projections: %s", quant.dense_summary(stats["dense_reasons"]))
        if stats["packed"] or stats["quantized"]:
            if rows_int8:
                budget = None if self.config.large_batch_matmul == "int8_rows" else int(self.config.rows_int8_budget_gb * 2**30)
                rows_int8, why = quant.rows_int8_decision(quant.rows_int8_bytes(model), budget)
                logger.info("row-int8 weight copies for large batches: %s", why)
            if rows_int8:  # before binding: the native layers copy each projection's routing
                stats["bytes"] += quant.attach_rows_int8(model)
                quant.tune_rows_int8_min_rows(model)
            native_layers = model.bind_packed_layers()
            large = "dense"
            if large_int8:
                large = "packed, int8 activations" + (
                    f"; row-int8 copies ({quant.rows_isas()[-1]}) for larger ones" if rows_int8 else ""
                )
            logger.info(
                "packed weights: %d from the file, %d quantized to Q8_0, %d dense (%.0f MiB); large batches: %s; "
                "%d layers on the native packed path",
                stats["packed"], stats["quantized"], stats["dense"], stats["bytes"] / 2**20, large, native_layers,
            )
            params = dict(model.named_parameters())
            never_loaded = sum(params[t].numel() * params[t].element_size() for t in self._targets(absent) if t in params)
            freed = quant.release_dense_weights(model) - never_loaded
            if freed:
                logger.info("freed %.0f MiB of dense weights that the packed ones fully serve", freed / 2**20)
        self._check_served(absent)

    def _targets(self, absent: set[str]) -> set[str]:
        """The model parameters that the weights loaded without a dense copy would have filled."""
        targets = {self.runner.model.parameter_for(name)[0] for name in absent}
        if "embed_tokens.weight" in targets and self.model_config.tie_word_embeddings:
            targets.add("lm_head.weight")
        return targets

    def _check_served(self, absent: set[str]) -> None:
        """Fail loudly if a weight loaded without its dense copy is still read densely (its
        parameter was never filled): the loader's skip_dense and the packing disagreed."""
        params = dict(self.runner.model.named_parameters())
        unserved = sorted(t for t in self._targets(absent) if t in params and params[t].numel())
        if unserved:
            raise RuntimeError(f"weights loaded without a dense copy are not served by packed kernels: {unserved[:5]}")

    # --- requests -----------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for anything that cannot run; checked before any state changes."""
        vocab = self.model_config.vocab_size
        if not prompt_ids:
            raise RequestError("the prompt is empty", "prompt")
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.max_model_len} "
                "tokens and at least one must be left to generate",
                "prompt",
            )
        if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"context length of {self.max_model_len}",
                "max_tokens",
            )
        if params.n > MAX_N:
            raise RequestError(f"'n' must be at most {MAX_N}", "n")
        if len(params.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(params.stop)}", "stop")
        if params.seed is not None and not SEED_RANGE[0] <= params.seed <= SEED_RANGE[1]:
            raise RequestError("'seed' must be a signed 64-bit integer", "seed")
        for name, ids in (("logit_bias", params.logit_bias.keys()), ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"{name} names token id {bad}, outside the vocabulary (0..{vocab - 1})", name)
        try:
            params.validate()
        except SamplingParamsError as exc:
            raise RequestError(str(exc), exc.param) from None

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: Optional[float] = None,
    ) -> list[Request]:
        """Queue a request; ``n > 1`` becomes n sequences, the later ones reusing the first's prompt blocks."""
        prompt_ids = self.tokenize(prompt)
        self.validate(prompt_ids, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seq = next(self._arrival_seq)
        reqs = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = SamplingParams(**{**params.__dict__, "n": 1})
                if params.seed is not None:
                    child_params.seed = params.seed + i
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                rid,
                prompt_ids,
                child_params,
                self.model_config.eos_token_ids,
                priority,
                arrival,
                parent_id=request_id,
                index=i,
                arrival_seq=seq,
            )
            if i > 0 and self.config.cache.enable_prefix_caching:
                req.prefill_after = reqs[0]
            reqs.append(req)
        if params.structured is not None:
            try:
                for req in reqs:
                    req.matcher = self.grammars.new_matcher(params.structured)
            except StructuredOutputError as exc:
                raise RequestError(str(exc), exc.param) from None
        for req in reqs:
            self.text_states[req.request_id] = RequestTextState(self.tokenizer, req)
            self.scheduler.add(req)
        return reqs

    def abort_request(self, request_id: str) -> list[CompletionDelta]:
        """Abort a request (all n sequences of it) wherever it is; its blocks are free when this returns."""
        out = []
        for req in list(self.scheduler.requests.values()):
            if req.parent_id == request_id or req.request_id == request_id:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                out.append(self._delta(req))
        return out

    def fail_requests(self, requests: Sequence[Request], message: str) -> list[CompletionDelta]:
        """End these requests with an error (a step that raised); the rest keep running."""
        out = []
        for req in requests:
            if not req.is_finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
                req.error = message
                out.append(self._delta(req))
        return out

    def prefault_kv_cache(self) -> int:
        """Make the blocks the prefix-cache reserve will occupy resident now (the server's warm-up
        calls this, so first requests do not pay their page faults); returns how many."""
        n = self.kv.reserve_blocks
        self.runner.prefault_kv_cache(n)
        self.kv.mark_resident(n)
        return n

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # --- the step -----------------------------------------------------------------------

    def step(self) -> tuple[list[CompletionDelta], Optional[StepStats], list[RequestStats]]:
        t0 = time.perf_counter()
        preempt_before = self.scheduler.num_preemptions
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        if sched.is_empty:
            return [], None, []
        try:
            if self.fault_hook is not None:
                self.fault_hook(sched)
            runner_out = self.runner.execute(sched)
            advanced = self.scheduler.update(sched, runner_out.sampled)
        except Exception as exc:  # noqa: BLE001 - one bad step fails its own requests, not the engine
            logger.exception("engine step failed; failing the %d requests in it", len(sched.scheduled))
            reqs = [s.request for s in sched.scheduled]
            deltas = self.fail_requests(reqs, f"internal error while generating: {type(exc).__name__}")
            return deltas, None, [self._request_stats(r) for r in reqs]
        t2 = time.perf_counter()

        deltas: list[CompletionDelta] = []
        finished_stats: list[RequestStats] = []
        now = time.monotonic()
        for req in advanced:
            lp = runner_out.logprobs.get(req.request_id)
            if lp is not None:
                req.output_logprobs.append(lp)
            if req.times.first_token is None:
                req.times.first_token = now
            req.times.last_token = now
            state = self.text_states[req.request_id]
            stop = state.update(req, token_level_stop=req.status == RequestStatus.FINISHED_STOPPED)
            if stop is not None and not req.is_finished:
                req.stop_reason = stop
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        for rid, lps in runner_out.prompt_logprobs.items():
            req = next(s.request for s in sched.scheduled if s.request.request_id == rid)
            if len(req.prompt_logprobs) < req.num_prompt_tokens:
                req.prompt_logprobs.extend(lps)
        for req in advanced:
            deltas.append(self._delta(req))
            if req.is_finished:
                finished_stats.append(self._request_stats(req))
        t3 = time.perf_counter()

        tm = runner_out.timings
        cache_stats = self.kv.stats.reset()
        stats = StepStats(
            schedule_s=t1 - t0,
            prepare_inputs_s=tm.prepare_inputs_s,
            kv_cache_update_s=tm.kv_cache_update_s,
            attention_s=tm.attention_s,
            model_forward_s=tm.model_forward_s,
            sampling_s=tm.sampling_s,
            structured_mask_s=tm.structured_mask_s,
            detokenize_s=t3 - t2,
            total_s=t3 - t0,
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            num_generated_tokens=len(advanced),
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_used=self.kv.num_used_blocks,
            kv_usage=self.kv.usage,
            num_preemptions=self.scheduler.num_preemptions - preempt_before,
            prefix_cache_queries=cache_stats.queries,
            prefix_cache_hits=cache_stats.hits,
        )
        return deltas, stats, finished_stats

    def _delta(self, req: Request) -> CompletionDelta:
        state = self.text_states.get(req.request_id)
        finished = req.is_finished
        new_text = state.take_new_text(finished) if state is not None else ""
        new_ids = req.output_token_ids[req.num_sent_tokens :]
        new_lps = req.output_logprobs[req.num_sent_tokens :]
        req.num_sent_tokens = req.num_output_tokens
        prompt_lps = None
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            if len(req.prompt_logprobs) >= req.num_prompt_tokens or finished:
                prompt_lps = req.prompt_logprobs
                req.prompt_logprobs_sent = True
        if finished:
            self.text_states.pop(req.request_id, None)
        return CompletionDelta(
            request_id=req.request_id,
            parent_id=req.parent_id,
            index=req.index,
            new_token_ids=new_ids,
            new_text=new_text,
            new_logprobs=new_lps,
            finished=finished,
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt_logprobs=prompt_lps,
            error=req.error,
            times=req.times if finished else None,
        )

    def _request_stats(self, req: Request) -> RequestStats:
        t = req.times
        end = t.finished or time.monotonic()
        tpot = None
        if t.first_token is not None and t.last_token is not None and req.num_output_tokens > 1:
            tpot = (t.last_token - t.first_token) / (req.num_output_tokens - 1)
        return RequestStats(
            request_id=req.request_id,
            finish_reason=req.status.value,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            queue_s=(t.first_scheduled or end) - t.arrival,
            ttft_s=(t.first_token - t.arrival) if t.first_token is not None else None,
            e2e_s=end - t.arrival,
            tpot_s=tpot,
        )


# oneDNN (torch's CPU matmuls) keeps a compiled primitive per matmul shape, 1024 by default in each of
# two caches (ideep's and oneDNN's own).  A server sees a new shape for nearly every batch size and
# prompt-chunk length, so resident memory climbed ~400 MB over a 10-minute soak before the caches
# filled.  64 entries hold every layer's shapes for several recent batch sizes at the same speed.
ONEDNN_CACHE_CAPACITY = "64"


def _bound_onednn_caches() -> None:
    """Cap oneDNN's per-shape caches unless the user set them (read lazily, at the first matmul)."""
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(name, ONEDNN_CACHE_CAPACITY)


def _release_freed_memory() -> None:
    """Hand the loader's temporary buffers back to the OS (glibc keeps freed heap otherwise: ~300 MB of RSS)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def default_model_name(source: str) -> str:
    """'.../SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct'; a directory -> its name."""
    base = os.path.basename(os.path.normpath(source)).removesuffix(".gguf")
    stem, _, last = base.rpartition(".")
    return stem if stem and last.upper().startswith(("Q", "F", "BF", "IQ")) else base


class LLM:
    """Offline batch generation: ``LLM(model="default").generate(["Hello"], SamplingParams(max_tokens=8))``."""

    def __init__(self, model: str = "default", config: Optional[EngineConfig] = None, **kwargs) -> None:  # noqa: ANN003
        config = config or EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # noqa: ANN201
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: Optional[SamplingParams | Sequence[SamplingParams]] = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        order: list[str] = []
        results: dict[str, RequestOutput] = {}
        for prompt, p in zip(prompts, params_list):
            rid = str(next(self._ids))
            reqs = self.engine.add_request(rid, prompt, p)
            order.append(rid)
            results[rid] = RequestOutput(
                rid,
                reqs[0].prompt_token_ids,
                [CompletionOutput(i, "", [], None) for i in range(p.n)],
            )
        while self.engine.has_unfinished():
            deltas, _, _ = self.engine.step()
            for d in deltas:
                out = results[d.parent_id]
                choice = out.outputs[d.index]
                choice.text += d.new_text
                choice.token_ids.extend(d.new_token_ids)
                choice.logprobs.extend(d.new_logprobs)
                if d.prompt_logprobs is not None:
                    out.prompt_logprobs = d.prompt_logprobs
                out.num_cached_tokens = max(out.num_cached_tokens, d.num_cached_tokens)
                if d.finished:
                    choice.finish_reason = d.finish_reason
                    choice.stop_reason = d.stop_reason
        return [results[rid] for rid in order]
