"""What each engine step and each finished request report, for logs and Prometheus.

The engine fills these; ``service/metrics.py`` reads them.  Plain data, cheap
to build: a handful of floats per step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    schedule_s: float
    prepare_inputs_s: float
    kv_cache_update_s: float  # summed over layers
    attention_s: float  # summed over layers
    model_forward_s: float  # the whole forward pass, attention included
    sampling_s: float
    structured_mask_s: float  # building and applying grammar masks (engine/structured)
    detokenize_s: float
    total_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_generated_tokens: int  # tokens sampled this step (prompt chunks that did not finish sample none)
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_usage: float  # 0..1
    num_preemptions: int  # this step
    prefix_cache_queries: int  # prompt tokens looked up this step
    prefix_cache_hits: int

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass
class RequestStats:
    """Timings of one finished request (seconds)."""

    request_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    queue_s: float  # arrival to first scheduled
    ttft_s: float | None  # arrival to first token
    e2e_s: float
    tpot_s: float | None  # (last token - first token) / (tokens - 1)
