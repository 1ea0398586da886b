"""``python -m service``: flags (or ``CPUSERVE_*`` environment variables) -> config -> uvicorn.

Every flag has an environment variable: ``--kv-cache-gb`` is ``CPUSERVE_KV_CACHE_GB``; a flag on
the command line wins over its variable.  A bad setting or model path prints one line and exits 1
before anything starts.  SIGTERM (or Ctrl-C) stops taking new requests, lets in-flight ones finish
for up to ``--shutdown-timeout`` seconds, then exits 0.  Exit status 1: the model could not be
loaded; 3: the engine loop died while serving (restart the server).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Mapping, Optional, Sequence

import uvicorn

import service
from engine import envs
from engine.config import (
    KV_CACHE_DTYPES,
    LARGE_BATCH_MATMULS,
    PREFIX_CACHE_MAX_GB,
    ROWS_INT8_BUDGET_GB,
    WEIGHT_QUANTS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from engine.loader import ModelLoadError, resolve_model_path
from service.config import DEFAULT_MAX_REQUEST_BYTES, ServiceConfig
from service.logs import LOG_FORMATS
from service.logs import configure as configure_logging

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# Idle keep-alive connections stay open this long.  Longer than clients keep them (httpx and the
# openai client: 5 s; load balancers: 60 s), so a client never sends a request on a connection the
# server is closing at that instant (uvicorn's default, 5 s, races httpx's: a POST lost to a reset).
KEEP_ALIVE_S = 75
logger = logging.getLogger("service")


def build_parser(env: Optional[Mapping[str, str]] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m service",
        description="cpuserve: an OpenAI-compatible completions server for CPU hosts.",
        epilog=f"Each flag can also be set through the environment variable shown with it "
        f"({envs.FLAG_ENV_PREFIX}<FLAG>, e.g. {envs.flag_env_name('--api-key')}); the command line wins.",
    )

    def add(flag: str, help: str, **kwargs) -> None:  # noqa: A002, ANN003
        name = envs.flag_env_name(flag)
        value = envs.flag_env_value(flag, env)
        if value:
            # argparse converts string defaults with `type` but never checks them against `choices`
            convert, choices = kwargs.get("type", str), kwargs.get("choices")
            try:
                ok = convert(value) in choices if choices is not None else convert(value) is not None
            except ValueError:
                ok = False
            if not ok:
                parser.error(f"environment variable {name}: invalid value {value!r}")
            kwargs["default"] = value
        suffix = " (default: %(default)s)" if kwargs.get("default") is not None else ""
        parser.add_argument(flag, help=f"{help}{suffix} [env {name}]", **kwargs)

    add("--model", "a GGUF file, a Hugging Face model directory, or 'default' (the bundled SmolLM2-135M-Instruct)", default="default")
    add("--host", "address to listen on; 0.0.0.0 exposes the server beyond this machine", default="127.0.0.1")
    add("--port", "TCP port to listen on", type=int, default=8000)
    add("--dtype", "weights and activations dtype", choices=["bfloat16", "float32"], default="bfloat16")
    add(
        "--weight-quant",
        "linear weights: 'auto' keeps a GGUF file's Q4/Q8 blocks for the native kernels, 'q8_0' also "
        "quantizes dense (Hugging Face) weights to Q8_0 (lossy), 'none' uses dense weights only",
        choices=list(WEIGHT_QUANTS),
        default="auto",
    )
    add(
        "--large-batch-matmul",
        "batches above the small-batch limit (prefill, big decode batches): 'int8_rows' runs the packed "
        "weights with int8 activations and, from a batch size timed at load (6-20 rows; Q8_0: 8), row-scaled "
        "int8 copies of them (faster, ~1 byte per weight more memory; AVX-512 VNNI only, elsewhere as 'int8'); 'int8' the packed weights "
        "only; 'dense' the dense matmul; 'auto' int8_rows for bfloat16 while the copies fit --rows-int8-budget-gb "
        "(else int8), and dense for float32",
        choices=list(LARGE_BATCH_MATMULS),
        default="auto",
    )
    add(
        "--rows-int8-budget-gb",
        "most memory (GiB) the row-int8 weight copies of --large-batch-matmul auto may take; beyond it they are "
        "not made (the start-up log says which, and their size)",
        type=float,
        default=ROWS_INT8_BUDGET_GB,
    )
    add("--served-model-name", "the model name clients send and responses carry (default: from the model file)")
    add("--max-num-seqs", "most sequences in one batch (continuous batching)", type=int, default=64)
    add("--max-num-batched-tokens", "most prompt tokens (prefill chunks) in one engine step; each running decode adds one more", type=int, default=SchedulerConfig.max_num_batched_tokens)
    add(
        "--max-model-len",
        "context length (default: the model's); a prompt plus max_tokens beyond it is refused with 400, not clipped",
        type=int,
    )
    add("--kv-cache-gb", "KV-cache size in GiB (default: a quarter of available memory, 0.5 to 8)", type=float)
    add("--prefix-cache-gb", f"memory finished requests' KV blocks may keep as cached prefixes before they are reused; made resident at start-up, and the cache's resident memory stops at its live blocks plus this (default: 1/32 of --kv-cache-gb, at least one full context, at most {PREFIX_CACHE_MAX_GB:g})", type=float)
    add("--kv-cache-dtype", "KV-cache storage type: auto is int8 (one scale per token and kv head) for bfloat16 runs with native attention kernels (AVX-512 VNNI or AVX2), else the run's dtype; int8 and fp8 take about half of bf16's memory", choices=list(KV_CACHE_DTYPES), default="auto")
    add("--block-size", "tokens per KV-cache block (a multiple of 8)", type=int, default=16)
    add("--max-queue", "most sequences (a request with n choices counts n) waiting for a batch slot; beyond it requests get 429 with Retry-After", type=int, default=1024)
    add("--max-request-bytes", "largest request body accepted; larger ones get 413", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    add("--api-key", "if set, /v1/*, /tokenize, /detokenize and /version need 'Authorization: Bearer <key>' (/health and /metrics stay open)")
    add("--threads", "threads for the model's math (default: OMP_NUM_THREADS, else the CPUs this process may use)", type=int)
    add("--shutdown-timeout", "seconds in-flight requests get to finish after SIGTERM", type=float, default=30.0)
    add("--log-level", "log level", choices=LOG_LEVELS, default="info")
    add(
        "--log-format",
        "'json' writes one JSON object per line (time, level, logger, message, request_id) for log "
        "collectors; request ids come from the X-Request-Id header or are generated; prompts are never logged",
        choices=list(LOG_FORMATS),
        default="text",
    )
    add(
        "--otlp-traces-endpoint",
        "send OpenTelemetry traces (a span per request: queue, prefill, decode) to this OTLP/HTTP "
        "collector URL, e.g. http://otel-collector:4318/v1/traces; needs pip install -r requirements-otel.txt",
    )
    parser.add_argument("--version", action="version", version=f"cpuserve {service.__version__}")
    return parser


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    """Raises ValueError for settings the engine refuses."""
    if not 0 <= args.port <= 65535:
        raise ValueError("--port must be between 0 (any free port) and 65535")
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_queue", "max_request_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise ValueError("--threads must be at least 1")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError("--max-model-len must be at least 2")
    if args.kv_cache_gb is not None and args.kv_cache_gb <= 0:
        raise ValueError("--kv-cache-gb must be positive")
    if args.rows_int8_budget_gb < 0:
        raise ValueError("--rows-int8-budget-gb must not be negative")
    if args.shutdown_timeout < 0:
        raise ValueError("--shutdown-timeout must not be negative")
    extra = {"num_threads": args.threads} if args.threads is not None else {}
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        weight_quant=args.weight_quant,
        large_batch_matmul=args.large_batch_matmul,
        rows_int8_budget_gb=args.rows_int8_budget_gb,
        served_model_name=args.served_model_name,
        cache=CacheConfig(block_size=args.block_size, kv_cache_gb=args.kv_cache_gb, kv_cache_dtype=args.kv_cache_dtype,
                          prefix_cache_gb=args.prefix_cache_gb),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            max_waiting=args.max_queue,
        ),
        **extra,
    )
    return ServiceConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level,
    )


class _Server(uvicorn.Server):
    """uvicorn's server, plus: a shutdown signal first turns new work away (503), then drains."""

    def __init__(self, config: uvicorn.Config, state) -> None:  # noqa: ANN001
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:  # noqa: ANN001
        if not self.state.draining:
            logger.info(
                "received %s: refusing new requests, draining in-flight ones for up to %gs",
                signal.Signals(sig).name, self.state.config.shutdown_timeout,
            )
            self.state.drain()
        super().handle_exit(sig, frame)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        config = config_from_args(args)
        resolve_model_path(config.engine.model)  # a wrong path fails here, in one line, before anything starts
    except (ValueError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    from service.app import create_app
    from service.metrics import Metrics
    from service.state import ServerState

    state = ServerState(config, Metrics())
    if args.otlp_traces_endpoint:
        from service.tracing import Tracer

        try:
            state.tracer = Tracer(args.otlp_traces_endpoint, lambda: state.metrics.model_name)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    app = create_app(config, state)
    server = _Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_config=None,  # keep the logging set up above
            log_level=config.log_level,
            access_log=config.log_level == "debug",  # the service logs one line per finished request itself
            # a backstop only: the drain ends unfinished requests itself at --shutdown-timeout
            timeout_graceful_shutdown=config.shutdown_timeout + 5,
            timeout_keep_alive=KEEP_ALIVE_S,
            lifespan="on",
        ),
        state,
    )

    def stop_on_load_failure(message: str) -> None:
        server.should_exit = True

    state.on_load_failure = stop_on_load_failure

    def stop_after_engine_death() -> None:  # its streams have ended already; exit non-zero (below)
        server.should_exit = True

    state.on_engine_dead = stop_after_engine_death
    # uvicorn re-raises the signal that stopped it once it has drained; by then we are done, and
    # exit 0 rather than die of the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        if state.tracer is not None:
            state.tracer.shutdown()  # send the spans still batched
    if state.loading:
        # Stopped (SIGTERM) while the model was still loading: the loader thread is inside torch,
        # and finalizing the interpreter under it aborts the process ("terminate called without
        # an active exception", exit 134).  Nothing else is left to clean up: leave at once.
        logger.info("stopped while the model was loading")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if state.load_error is not None or not server.started:
        return 1
    if state.engine_died:
        logger.error("stopped: the engine loop died; exit status 3 so the server is restarted")
        return 3
    logger.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
