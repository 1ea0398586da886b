"""The server's engine and its life: load in the background, warm up, serve, drain, stop.

The HTTP socket opens at once; ``/health`` answers 503 until the model is loaded and one tiny
generation has run, then 200 until the engine dies or SIGTERM starts the drain.  Handlers reach
the engine only through :meth:`ServerState.engines` and :meth:`ServerState.submit`, which turn the
engine's exceptions into HTTP errors.  If the engine loop dies, every open stream has already
ended with an error; ``/health`` answers 503 and, ``ENGINE_DEAD_EXIT_DELAY_S`` later (time for
those error events to go out and a probe to see the 503), ``on_engine_dead`` stops the process,
which exits non-zero so an orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

from engine.async_engine import AsyncEngine, Delivery, EngineDeadError, Mailbox, QueueFullError
from engine.engine import LLMEngine
from engine.loader import ModelLoadError
from engine.request import SamplingParams
from engine.stats import RequestStats
from engine.validation import RequestError
from service import faults
from service.config import ServiceConfig
from service.errors import APIError
from service.metrics import Metrics

if TYPE_CHECKING:
    from service.tracing import Tracer

logger = logging.getLogger("service")

RETRY_AFTER_S = 1  # 429: the queue usually moves within a second or so
ENGINE_DEAD_EXIT_DELAY_S = 1.0


class InFlight(Protocol):
    """A request being served, as the drain sees it (service.generate.Generation registers itself)."""

    def cancel(self, error: APIError) -> None:
        """End it early: its consumer gets ``error`` and its sequences are aborted."""


class ServerState:
    def __init__(self, config: ServiceConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.engine: Optional[LLMEngine] = None
        self.async_engine: Optional[AsyncEngine] = None
        self.ready = False  # loaded and warmed up
        self.draining = False  # SIGTERM: no new work
        self.load_error: Optional[str] = None
        # Called with the message when the model cannot be loaded; __main__ stops the server.
        self.on_load_failure: Callable[[str], None] = lambda message: None
        self.engine_died = False  # the engine loop died: the process must exit non-zero
        # Called (on the event loop) a moment after the engine loop died; __main__ stops the server.
        self.on_engine_dead: Callable[[], None] = lambda: None
        self.created = int(time.time())
        self.generations: "weakref.WeakSet[InFlight]" = weakref.WeakSet()  # in flight, for the drain
        # service.tracing.Tracer when --otlp-traces-endpoint is set: also told of every finished request.
        self.tracer: Optional["Tracer"] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._load_thread: Optional[threading.Thread] = None

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Load and warm up on a daemon thread (a SIGTERM mid-load need not wait for it), then serve."""
        loop = self._loop = asyncio.get_running_loop()
        done: asyncio.Future[LLMEngine] = loop.create_future()

        def load() -> None:
            try:
                engine = LLMEngine(self.config.engine)
                _warm_up(engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the event loop
                loop.call_soon_threadsafe(_settle, done, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, done, engine, None)

        self._load_thread = threading.Thread(target=load, name="engine-load", daemon=True)
        self._load_thread.start()
        try:
            engine = await done
        except (ModelLoadError, ValueError) as exc:
            self._fail(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - an unexpected failure: keep the traceback in the log
            logger.exception("loading the model failed")
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        on_finish = self.metrics.on_finish
        if self.tracer is not None:
            record, trace = self.metrics.on_finish, self.tracer.on_finish

            def on_finish(r: RequestStats) -> None:
                record(r)
                trace(r)

        async_engine = AsyncEngine(
            engine, on_step=self.metrics.on_step, on_finish=on_finish, on_dead=self._engine_thread_died
        )
        if faults.enabled():
            faults.install(engine)
        self.metrics.bind(
            engine.model_name,
            num_running=lambda: engine.scheduler.num_running,
            num_waiting=lambda: async_engine.num_waiting,
            kv_usage=lambda: engine.kv.usage,
            kv_blocks_used=lambda: engine.kv.num_used_blocks,
            kv_blocks_resident=lambda: engine.kv.num_resident_blocks,
            block_size=engine.kv.block_size,
            num_blocks=engine.kv.num_blocks,
            healthy=lambda: 1.0 if self.engine_alive else 0.0,
        )
        async_engine.start()
        self.engine, self.async_engine = engine, async_engine
        self.ready = True
        logger.info("ready: serving %s (context %d tokens)", engine.model_name, engine.max_model_len)

    @property
    def loading(self) -> bool:
        """The model is still loading or warming up (on its daemon thread)."""
        return self._load_thread is not None and self._load_thread.is_alive()

    def _fail(self, message: str) -> None:
        self.load_error = message
        logger.error("cannot load the model: %s", message)
        self.on_load_failure(message)

    def _engine_thread_died(self, exc: BaseException) -> None:
        """AsyncEngine's on_dead, on the engine thread: its streams are failed already."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._engine_died, exc)

    def _engine_died(self, exc: BaseException) -> None:
        self.engine_died = True
        logger.critical(
            "the engine loop died (%s): /health answers 503; exiting in %gs so the server is restarted",
            type(exc).__name__, ENGINE_DEAD_EXIT_DELAY_S,
        )
        assert self._loop is not None
        self._loop.call_later(ENGINE_DEAD_EXIT_DELAY_S, self.on_engine_dead)

    def drain(self) -> None:
        """Shutdown, step one (any thread): refuse new work; cut what still runs after the timeout.

        Cut requests end cleanly (an error event then ``[DONE]``, or a 503), so uvicorn's own
        graceful-shutdown timeout, set a little longer, never has to cancel a task.
        """
        if self.draining:
            return
        self.draining = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, self.config.shutdown_timeout, self._cut)

    def _cut(self) -> None:
        running = list(self.generations)
        if running:
            logger.warning("shutdown timeout: ending %d unfinished request(s)", len(running))
        for gen in running:
            gen.cancel(APIError(503, "the server shut down before this request finished", code="shutting_down"))

    def stop(self) -> None:
        if self.async_engine is not None:
            self.async_engine.stop()

    @property
    def engine_alive(self) -> bool:
        return self.ready and self.async_engine is not None and self.async_engine.healthy

    @property
    def healthy(self) -> bool:
        """What /health reports: alive and taking new work."""
        return self.engine_alive and not self.draining

    # --- what handlers use ------------------------------------------------------------------

    def engines(self) -> tuple[LLMEngine, AsyncEngine]:
        """The engine, or the 503 that says why there is none to use."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down", reject_reason="shutting_down")
        if not self.ready or self.engine is None or self.async_engine is None:
            raise APIError(503, "the model is still loading; retry when /health answers 200", headers={"Retry-After": "5"})
        if not self.async_engine.healthy:
            raise APIError(503, "the engine has stopped; this server must be restarted", code="engine_dead")
        return self.engine, self.async_engine

    def check_model(self, name: Optional[str]) -> LLMEngine:
        """The engine, if ``name`` (when given) is the model it serves; else the 404 (or the 503 of
        ``engines``)."""
        engine, _ = self.engines()
        if name is not None and name != engine.model_name:
            raise APIError(
                404, f"the model '{name}' does not exist; this server serves '{engine.model_name}'",
                param="model", code="model_not_found",
            )
        return engine

    def submit(
        self, prompts: Sequence[tuple[str, Sequence[int]]], params: SamplingParams, priority: int,
        box: Mailbox[Delivery],
    ) -> None:
        """Validate and queue ``(request_id, prompt_ids)`` pairs, all or none (``AsyncEngine.submit``);
        prompt i's deltas (or the error that ends it) arrive in ``box`` as ``(i, item)``."""
        _, async_engine = self.engines()
        try:
            async_engine.submit(prompts, params, box, priority)
        except RequestError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        except QueueFullError as exc:
            raise APIError(
                429, f"{exc}; retry later", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}
            ) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None

    def abort(self, request_id: str) -> None:
        if self.async_engine is not None:
            self.async_engine.abort(request_id)


def _settle(future: asyncio.Future, result: object, exc: Optional[BaseException]) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _warm_up(engine: LLMEngine) -> None:
    """One tiny greedy generation, so the first real request does not pay for lazy initialisation,
    and the prefix-cache reserve's KV blocks made resident, so the first requests' do not fault."""
    t0 = time.monotonic()
    blocks = engine.prefault_kv_cache()
    logger.info("made %d KV-cache blocks (the prefix-cache reserve, %.0f MiB) resident in %.2fs",
                blocks, blocks * engine.kv_block_bytes / 2**20, time.monotonic() - t0)
    t0 = time.monotonic()
    ids = engine.tokenizer.encode("Hello") or [0]
    engine.add_request("warmup", ids, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    logger.info("warm-up generation took %.2fs", time.monotonic() - t0)
