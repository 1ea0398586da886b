"""Prometheus metrics, fed from the engine's StepStats / RequestStats and from the HTTP layer.

Names and labels are the contract in ``deploy/metrics.txt`` (dashboards and alerts use them):
one ``cpuserve:`` prefix, base units (``_seconds``), ``_total`` counters, a ``model_name`` label
on everything.  The registry is our own, not prometheus-client's global one, so an app built
twice in one process (tests) never collides.

``on_step`` / ``on_finish`` run on the engine thread; prometheus-client is thread-safe.  The
running / waiting / KV-usage / health gauges are read live at scrape time, so they are right even
when no step runs (an abort frees blocks between steps).  Until the model has loaded its name (the
``model_name`` label) is unknown, so nothing is recorded before then, not even HTTP responses.
"""

from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from engine.stats import RequestStats, StepStats
from engine.structured.spec import KINDS as STRUCTURED_KINDS

# No `<name>_created` series: they double the output and nothing here uses them.
disable_created_metrics()

PREFIX = "cpuserve:"
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("queue_full", "invalid", "unauthorized", "too_large", "shutting_down")

_STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

# StepStats field -> histogram name (without prefix) and help
_STEP_PHASES = {
    "schedule_s": ("step_schedule_seconds", "Time per engine step spent scheduling"),
    "prepare_inputs_s": ("step_prepare_inputs_seconds", "Time per engine step building model inputs"),
    "kv_cache_update_s": ("step_kv_cache_update_seconds", "Time per engine step writing K/V into the cache (all layers)"),
    "attention_s": ("step_attention_seconds", "Time per engine step in attention (all layers)"),
    "model_forward_s": ("step_model_forward_seconds", "Time per engine step in the model forward pass"),
    "sampling_s": ("step_sampling_seconds", "Time per engine step sampling tokens"),
    "structured_mask_s": (
        "step_structured_mask_seconds",
        "Time per engine step building and applying grammar token masks (constrained requests; 0 without any)",
    ),
    "detokenize_s": ("step_detokenize_seconds", "Time per engine step detokenizing and checking stop strings"),
    "total_s": ("step_duration_seconds", "Total time of one engine step"),
}


class Metrics:
    """All of cpuserve's metrics.  Labelled series exist once :meth:`bind` names the model."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, label, buckets=buckets, registry=r)

        self._phase_hists = {field: hist(name, doc, _STEP_BUCKETS) for field, (name, doc) in _STEP_PHASES.items()}
        self._step_tokens = hist("step_tokens", "Tokens (prefill + decode) processed per engine step", _STEP_TOKEN_BUCKETS)
        self._ttft = hist("time_to_first_token_seconds", "Arrival to first generated token", _TTFT_BUCKETS)
        self._itl = hist("inter_token_latency_seconds", "Gap between successive streamed tokens of a request", _TOKEN_LATENCY_BUCKETS)
        self._tpot = hist("time_per_output_token_seconds", "Mean time per output token after the first, per request", _TOKEN_LATENCY_BUCKETS)
        self._e2e = hist("e2e_request_latency_seconds", "Arrival to finish, per request", _REQUEST_BUCKETS)
        self._queue = hist("request_queue_time_seconds", "Arrival to first scheduled, per request", _REQUEST_BUCKETS)
        self._prompt_len = hist("request_prompt_tokens", "Prompt length per finished request", _LENGTH_BUCKETS)
        self._gen_len = hist("request_generation_tokens", "Generated tokens per finished request", _LENGTH_BUCKETS)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, label + list(extra), registry=r)

        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (prefix-cache hits excluded)")
        self._gen_tokens = counter("generation_tokens", "Tokens generated")
        self._finished = counter("requests_finished", "Finished requests (sequences) by finish reason", ("finish_reason",))
        self._preemptions = counter("preemptions", "Sequences preempted for lack of KV-cache blocks")
        self._pc_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self._pc_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self._rejected = counter("requests_rejected", "Requests refused before reaching the engine, by reason", ("reason",))
        self._http = counter("http_requests", "HTTP responses by route and status code", ("route", "status"))
        self._structured = counter(
            "structured_requests", "Requests whose output is constrained (JSON schema, regex, ...), by kind", ("kind",)
        )

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, label, registry=r)

        self._running = gauge("num_requests_running", "Sequences in the running batch")
        self._waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled")
        self._kv_usage = gauge("kv_cache_usage_ratio", "Fraction of KV-cache blocks held by live requests (0 to 1)")
        self._kv_blocks = gauge("kv_cache_blocks_used", "KV-cache blocks held by live requests (0 when idle: none leaked)")
        self._kv_resident = gauge(
            "kv_cache_blocks_resident",
            "KV-cache blocks whose memory is resident: used at least once or made resident at start-up (live blocks' peak plus the prefix-cache reserve)",
        )
        # An info gauge (always 1) whose labels describe the KV cache, as vLLM's cache_config_info:
        # the Gateway API Inference Extension's endpoint picker reads block_size and num_blocks
        # from it to model each replica's prefix cache (deploy/k8s/components/inference-pool).
        self._cache_info = Gauge(
            PREFIX + "cache_config_info", "KV-cache configuration in the labels: tokens per block, blocks in the cache",
            [*label, "block_size", "num_blocks"], registry=r,
        )
        self._healthy = gauge("engine_healthy", "1 when the engine is loaded, warmed up and running, else 0")
        self.model_name: Optional[str] = None

    def bind(
        self,
        model_name: str,
        num_running: Callable[[], float],
        num_waiting: Callable[[], float],
        kv_usage: Callable[[], float],
        healthy: Callable[[], float],
        kv_blocks_used: Callable[[], float],
        kv_blocks_resident: Callable[[], float],
        block_size: int,
        num_blocks: int,
    ) -> None:
        """Name the model and create every series (zeros included, so rate() and alerts see them)."""
        self.model_name = m = model_name
        self._phases = {field: h.labels(m) for field, h in self._phase_hists.items()}
        self._step_tokens_m = self._step_tokens.labels(m)
        # The per-token series, looked up once: they are updated for every streamed token.
        self._gen_tokens_m = self._gen_tokens.labels(m)
        self._itl_m = self._itl.labels(m)
        for h in (self._ttft, self._itl, self._tpot, self._e2e, self._queue, self._prompt_len, self._gen_len):
            h.labels(m)
        for c in (self._prompt_tokens, self._gen_tokens, self._preemptions, self._pc_queries, self._pc_hits):
            c.labels(m)
        for reason in FINISH_REASONS:
            self._finished.labels(m, reason)
        for reason in REJECT_REASONS:
            self._rejected.labels(m, reason)
        for kind in STRUCTURED_KINDS:
            self._structured.labels(m, kind)
        self._running.labels(m).set_function(num_running)
        self._waiting.labels(m).set_function(num_waiting)
        self._kv_usage.labels(m).set_function(kv_usage)
        self._kv_blocks.labels(m).set_function(kv_blocks_used)
        self._kv_resident.labels(m).set_function(kv_blocks_resident)
        self._healthy.labels(m).set_function(healthy)
        self._cache_info.labels(m, str(block_size), str(num_blocks)).set(1)

    # --- engine thread ---------------------------------------------------------------------

    def on_step(self, s: StepStats) -> None:
        m = self.model_name
        for field, h in self._phases.items():
            h.observe(getattr(s, field))
        self._step_tokens_m.observe(s.num_tokens)
        if s.num_prefill_tokens:
            self._prompt_tokens.labels(m).inc(s.num_prefill_tokens)
        if s.num_preemptions:
            self._preemptions.labels(m).inc(s.num_preemptions)
        if s.prefix_cache_queries:
            self._pc_queries.labels(m).inc(s.prefix_cache_queries)
        if s.prefix_cache_hits:
            self._pc_hits.labels(m).inc(s.prefix_cache_hits)

    def on_finish(self, r: RequestStats) -> None:
        m = self.model_name
        self._finished.labels(m, r.finish_reason).inc()
        self._queue.labels(m).observe(r.queue_s)
        self._e2e.labels(m).observe(r.e2e_s)
        if r.ttft_s is not None:
            self._ttft.labels(m).observe(r.ttft_s)
        if r.tpot_s is not None:
            self._tpot.labels(m).observe(r.tpot_s)
        self._prompt_len.labels(m).observe(r.num_prompt_tokens)
        self._gen_len.labels(m).observe(r.num_output_tokens)

    # --- event loop ------------------------------------------------------------------------

    def generated(self, num_tokens: int) -> None:
        if self.model_name is not None and num_tokens:
            self._gen_tokens_m.inc(num_tokens)

    def inter_token_latency(self, seconds: float) -> None:
        if self.model_name is not None:
            self._itl_m.observe(seconds)

    def ended_early(self, finish_reason: str, num_sequences: int) -> None:
        """Sequences the service ended (client gone: abort; engine died: error); the engine reports no stats for them."""
        if self.model_name is not None and num_sequences:
            self._finished.labels(self.model_name, finish_reason).inc(num_sequences)

    def structured_request(self, kind: str) -> None:
        if self.model_name is not None:
            self._structured.labels(self.model_name, kind).inc()

    def rejected(self, reason: str) -> None:
        if self.model_name is not None:
            self._rejected.labels(self.model_name, reason).inc()

    def http_response(self, route: str, status: int) -> None:
        if self.model_name is not None:
            self._http.labels(self.model_name, route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
