"""The engine: one step = schedule -> run the model (and sample) -> process outputs.

``LLMEngine`` is the synchronous core: requests enter through ``add_request`` (validated once,
engine/validation.py), each ``step`` advances every scheduled one by a token or a prompt chunk.
The offline ``LLM`` (engine/llm.py) and the service's ``AsyncEngine`` (engine/async_engine.py,
the step loop on its own thread) drive it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from typing import Callable, Optional, Sequence

import torch

from engine import process
from engine.attention.dispatch import int8_decodes_in_place
from engine.config import EngineConfig, default_model_name
from engine.kv_cache import KVCacheManager, sizing
from engine.kv_cache.layout import resolve_kv_cache_dtype
from engine.loader import LoadedModel, load_model
from engine.model_runner import ModelRunner, RunnerOutput
from engine.output_processor import OutputProcessor, request_stats
from engine.quant.attach import attach_quantized_weights, skip_dense
from engine.request import CompletionDelta, Request, RequestStatus, SamplingParams, choice_requests
from engine.scheduler import Scheduler, SchedulerOutput
from engine.stats import RequestStats, StepStats
from engine.structured import GrammarCompiler, StructuredOutputError
from engine.validation import RequestError, validate_request

logger = logging.getLogger(__name__)

StepResult = tuple[list[CompletionDelta], Optional[StepStats], list[RequestStats]]


class LLMEngine:
    """A loaded model with its KV cache, scheduler and output processor, advanced one ``step``
    at a time by one driver (``LLM`` or ``AsyncEngine``'s thread; not thread-safe)."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: Optional[LoadedModel] = None,
        progress: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.config = config
        process.bound_onednn_caches()
        torch.set_num_threads(config.num_threads)
        with process.existing_objects_frozen():
            t0 = time.monotonic()
            skip = functools.partial(skip_dense, config)
            loaded = loaded or load_model(config.model, config.torch_dtype, progress=progress, skip_dense=skip)
            t_load = time.monotonic()
            self.model_config = loaded.config
            # "auto" KV cache resolved for this model and CPU, on a copy: everything below (the layers,
            # block sizing, the start-up log) reads the storage type it gets.
            int8_in_place = int8_decodes_in_place(config.torch_dtype, config.cache.block_size, loaded.config.head_dim)
            kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, config.torch_dtype, int8_in_place)
            cache = dataclasses.replace(config.cache, kv_cache_dtype=kv_dtype)
            config = self.config = dataclasses.replace(config, cache=cache)
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
            attach_quantized_weights(self.runner.model, config, loaded, absent)
            del loaded
            t_weights = time.monotonic()
            self.runner.allocate_kv_cache()
            self.kv = KVCacheManager(
                num_blocks,
                config.cache.block_size,
                config.cache.enable_prefix_caching,
                self._prefix_cache_blocks(num_blocks),
            )
            self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
            self.output = OutputProcessor(self.tokenizer, self.scheduler)
            tok = self.tokenizer
            self.grammars = GrammarCompiler(tok.backend.to_str, tok.vocab_size, tok.eos_token_ids)
            self._arrival_seq = itertools.count()
            # Test-only fault injection: called with each step's SchedulerOutput before the model runs.
            self.fault_hook: Optional[Callable[[SchedulerOutput], None]] = None
            process.release_freed_memory()
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

    # --- requests -----------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestError if this request cannot run here (engine/validation.py); changes nothing."""
        validate_request(prompt_ids, params, self.model_config.vocab_size, self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: Optional[float] = None,
    ) -> list[Request]:
        """Validate and queue a request (text or token ids); returns its sequences, one per choice."""
        prompt_ids = self.tokenize(prompt)
        self.validate(prompt_ids, params)
        return self.enqueue(request_id, prompt_ids, params, priority, arrival_time)

    def enqueue(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: Optional[float] = None,
    ) -> list[Request]:
        """Queue a request that ``validate`` accepted (``AsyncEngine.submit`` validates on the caller's
        thread, then hands it here): ``n > 1`` becomes n sequences, the later ones reusing the first's
        prompt blocks.  Raises RequestError only for a structured-output constraint that does not compile."""
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        reqs = choice_requests(
            request_id, prompt_ids, params, self.model_config.eos_token_ids, priority, arrival,
            next(self._arrival_seq), share_prompt=self.config.cache.enable_prefix_caching,
        )
        if params.structured is not None:
            try:
                for req in reqs:
                    req.matcher = self.grammars.new_matcher(params.structured)
            except StructuredOutputError as exc:
                raise RequestError(str(exc), exc.param) from None
        for req in reqs:
            self.output.add(req)
            self.scheduler.add(req)
        return reqs

    def abort_request(self, request_id: str) -> list[CompletionDelta]:
        """Abort a request (all n sequences of it) wherever it is; its blocks are free when this returns."""
        out = []
        for req in list(self.scheduler.requests.values()):
            if req.parent_id == request_id or req.request_id == request_id:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                out.append(self.output.delta(req))
        return out

    def fail_requests(self, requests: Sequence[Request], message: str) -> list[CompletionDelta]:
        """End these requests with an error (a step that raised); the rest keep running."""
        out = []
        for req in requests:
            if not req.is_finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
                req.error = message
                out.append(self.output.delta(req))
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

    def step(self) -> StepResult:
        """Schedule, run the model (which samples), process the outputs: returns the deltas of every
        request that advanced, the step's stats (None when nothing was scheduled) and the stats of
        the requests that finished.  A step that raises fails only its own requests."""
        t0 = time.perf_counter()
        preemptions_before = self.scheduler.num_preemptions
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
            return self._fail_step(sched, exc)
        t2 = time.perf_counter()
        deltas, finished = self.output.process(sched, runner_out, advanced)
        t3 = time.perf_counter()
        stats = self._step_stats(sched, runner_out, len(advanced), preemptions_before, (t0, t1, t2, t3))
        return deltas, stats, finished

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> StepResult:
        logger.exception("engine step failed; failing the %d requests in it", len(sched.scheduled))
        reqs = [s.request for s in sched.scheduled]
        deltas = self.fail_requests(reqs, f"internal error while generating: {type(exc).__name__}")
        return deltas, None, [request_stats(r) for r in reqs]

    def _step_stats(
        self,
        sched: SchedulerOutput,
        runner_out: RunnerOutput,
        num_generated: int,
        preemptions_before: int,
        times: tuple[float, float, float, float],
    ) -> StepStats:
        """``times``: perf_counter at the step's start, after scheduling, after the model, at the end."""
        t0, t1, t2, t3 = times
        tm = runner_out.timings
        cache_stats = self.kv.stats.reset()
        return StepStats(
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
            num_generated_tokens=num_generated,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_used=self.kv.num_used_blocks,
            kv_usage=self.kv.usage,
            num_preemptions=self.scheduler.num_preemptions - preemptions_before,
            prefix_cache_queries=cache_stats.queries,
            prefix_cache_hits=cache_stats.hits,
        )
