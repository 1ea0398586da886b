"""Optional OpenTelemetry traces (``--otlp-traces-endpoint``): one trace per finished sequence.

Each finished engine request becomes a span ``llm_request`` (as vLLM names it) with three
children laid end to end, from the engine's own timings (engine/stats.py RequestStats):
``queue`` (arrival to first scheduled), ``prefill`` (to the first token) and ``decode`` (to the
finish). Attributes follow OpenTelemetry's gen_ai conventions (token counts, finish reason,
engine request id); never the prompt or the output.

The exporter is an optional dependency (requirements-otel.txt: opentelemetry-sdk and the OTLP
over HTTP/protobuf exporter): without the flag nothing is imported; with the flag and without
the packages the server refuses to start with one line saying what to install. Spans are
batched and sent from the SDK's own thread, so the engine thread only records timestamps.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from engine.stats import RequestStats

INSTALL_HINT = "--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install -r requirements-otel.txt"
SERVICE_NAME = "cpuserve"


class Tracer:
    """Turns finished requests' timings into spans sent to an OTLP/HTTP collector."""

    def __init__(self, endpoint: str, model_name: Callable[[], Optional[str]]) -> None:
        """``endpoint``: the collector's traces URL (http://host:4318/v1/traces). Raises
        RuntimeError when the optional packages are missing."""
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise RuntimeError(INSTALL_HINT) from exc
        import service

        self._provider = TracerProvider(
            resource=Resource.create({"service.name": SERVICE_NAME, "service.version": service.__version__})
        )
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("cpuserve")
        self._model_name = model_name

    def on_finish(self, r: RequestStats) -> None:
        """Record one finished sequence (engine thread: only builds spans, the SDK sends them)."""
        from opentelemetry import trace

        end = time.time_ns()
        start = end - _ns(r.e2e_s)
        scheduled = min(end, start + _ns(r.queue_s))
        first_token = min(end, start + _ns(r.ttft_s)) if r.ttft_s is not None else end
        attrs: dict[str, Any] = {
            "gen_ai.request.id": r.request_id,
            "gen_ai.request.model": self._model_name() or "",
            "gen_ai.response.finish_reasons": [r.finish_reason],
            "gen_ai.usage.input_tokens": r.num_prompt_tokens,
            "gen_ai.usage.output_tokens": r.num_output_tokens,
            "gen_ai.usage.cached_input_tokens": r.num_cached_tokens,
            "gen_ai.latency.time_in_queue": r.queue_s,
            "gen_ai.latency.time_to_first_token": r.ttft_s if r.ttft_s is not None else -1.0,
            "gen_ai.latency.e2e": r.e2e_s,
        }
        root = self._tracer.start_span("llm_request", kind=trace.SpanKind.SERVER, start_time=start, attributes=attrs)
        ctx = trace.set_span_in_context(root)
        for name, t0, t1 in (("queue", start, scheduled), ("prefill", scheduled, first_token),
                             ("decode", first_token, end)):
            self._tracer.start_span(name, context=ctx, start_time=t0).end(end_time=t1)
        if r.finish_reason == "error":
            root.set_status(trace.Status(trace.StatusCode.ERROR))
        root.end(end_time=end)

    def shutdown(self) -> None:
        """Send what is batched (at server stop)."""
        self._provider.shutdown()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
