"""The engine as the HTTP service drives it: a step loop on its own thread, streams on the event loop.

The event loop never runs model code, nor any torch op big enough to go parallel: every thread
that starts an OpenMP region gets its own worker team, and more OpenMP threads than cores slow
every step (engine/process.py, ``release_openmp_team``; ``start`` frees the calling thread's).
Requests are validated on the caller's thread as they enter (``submit``), then they and aborts
cross into the engine thread through a queue; each step's deltas come back through
``loop.call_soon_threadsafe`` into one :class:`Mailbox` per consumer.  A step that raises fails
only the requests in it; if the loop itself dies, every open stream ends with an error and
``healthy`` turns False, so the service can exit and be restarted.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Generic, Optional, Sequence, TypeVar

from engine.engine import LLMEngine
from engine.process import release_openmp_team
from engine.request import CompletionDelta, SamplingParams
from engine.stats import RequestStats, StepStats
from engine.validation import RequestError

logger = logging.getLogger(__name__)
T = TypeVar("T")


class QueueFullError(Exception):
    """The waiting queue is at its limit; the caller should retry later (HTTP 429)."""


class EngineDeadError(Exception):
    """The engine loop has stopped; nothing more will be served."""


class Mailbox(Generic[T]):
    """An unbounded queue with one consumer, on one event loop (not thread-safe).

    What ``asyncio.Queue`` does for a token stream, without its size limit, task accounting
    and list of getters: every streamed token crosses one, and on a 2-core host the event
    loop's CPU is taken from the model's threads.
    """

    __slots__ = ("_items", "_waiter", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._waiter: Optional[asyncio.Future[None]] = None
        self.loop = loop  # where put() must be called (the engine thread goes through call_soon_threadsafe)

    def put(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> T:
        while not self._items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


Delivery = tuple[int, "CompletionDelta | BaseException"]  # (the submitter's tag, a delta or the error that ended it)


@dataclass
class _Stream:
    box: Mailbox[Delivery]
    tag: int
    unfinished_choices: int  # counted down on the engine thread as choices finish


def _deliver(batch: list[tuple[Mailbox[Delivery], Delivery]]) -> None:
    for box, item in batch:
        box.put(item)


StepCallback = Callable[[StepStats], None]
FinishCallback = Callable[[RequestStats], None]
DeadCallback = Callable[[BaseException], None]


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        on_step: Optional[StepCallback] = None,
        on_finish: Optional[FinishCallback] = None,
        on_dead: Optional[DeadCallback] = None,
    ) -> None:
        self.engine = engine
        self.on_step = on_step
        self.on_finish = on_finish
        self.on_dead = on_dead  # called on the engine thread, after every stream was failed, if the loop dies
        self._commands: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and _pending
        self._pending = 0  # sequences accepted, not yet handed to the scheduler
        self._stop = threading.Event()
        self.dead: Optional[BaseException] = None
        self.max_waiting = engine.config.scheduler.max_waiting
        self.step_hook: Optional[Callable[[], None]] = None  # test-only fault injection, called before each step
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # --- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        release_openmp_team()
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for a batch slot (a request with ``n`` choices counts ``n``)."""
        return self.engine.scheduler.num_waiting + self._pending

    # --- requests ---------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> AsyncIterator[CompletionDelta]:
        """Validate and queue a request; returns its stream of deltas (all n choices, in step order).

        Raises as ``submit`` does.  Leaving the stream before its last delta aborts the request.
        """
        box: Mailbox[Delivery] = Mailbox(asyncio.get_running_loop())
        self.submit([(request_id, prompt_ids)], params, box, priority)
        return self._iterate(request_id, box, params.n)

    def submit(
        self,
        prompts: Sequence[tuple[str, Sequence[int]]],
        params: SamplingParams,
        box: Mailbox[Delivery],
        priority: int = 0,
    ) -> None:
        """Validate ``(request_id, prompt_ids)`` pairs sharing ``params``, then queue all or none.

        This is where a served request is validated, once.  Raises RequestError (bad request),
        QueueFullError (429) or EngineDeadError at once.  The queue limit counts sequences, the
        earlier prompts' included; an empty queue always takes the first prompt, whatever its ``n``.

        Prompt i's deltas, or the error that ends it early, arrive in ``box`` as ``(i, item)``,
        on the running loop.  The consumer counts the ``n`` finished choices of each itself and must
        ``abort`` the requests it stops reading before then.  The HTTP service merges a request's
        prompts this way: a streamed token then crosses one hand-off on the event loop, not two.
        """
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        for _, prompt_ids in prompts:
            self.engine.validate(prompt_ids, params)
        with self._lock:
            # As if queued one by one: the last prompt waits behind all the earlier ones.
            waiting = self.num_waiting + (len(prompts) - 1) * params.n
            if waiting and waiting + params.n > self.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} sequences)")
            ids = [rid for rid, _ in prompts]
            taken = next((rid for i, rid in enumerate(ids) if rid in self._streams or rid in ids[:i]), None)
            if taken is not None:
                raise RequestError(f"request id {taken!r} is already in use")
            for tag, rid in enumerate(ids):
                self._streams[rid] = _Stream(box, tag, params.n)
            self._pending += params.n * len(prompts)
        arrival = time.monotonic()
        for rid, prompt_ids in prompts:
            self._commands.put(("add", rid, list(prompt_ids), params, priority, arrival))
        self._wake.set()

    async def _iterate(self, request_id: str, box: Mailbox[Delivery], n: int) -> AsyncIterator[CompletionDelta]:
        finished = False
        open_choices = n
        try:
            while True:
                _, item = await box.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it
                    raise item
                if item.finished:
                    open_choices -= 1
                    finished = open_choices <= 0
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away (client disconnect) or an error: free its blocks now
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            known = request_id in self._streams
        if known:
            self._commands.put(("abort", request_id))
            self._wake.set()

    # --- the loop (engine thread) -----------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                if self.step_hook is not None:
                    self.step_hook()
                deltas, step_stats, finished = self.engine.step()
                self._dispatch(deltas)
                self._report(step_stats, finished)
        except BaseException as exc:  # noqa: BLE001 - the loop is gone: tell every stream
            logger.exception("engine loop died")
            self.dead = exc
            self._fail_all(EngineDeadError(f"the engine stopped: {type(exc).__name__}"))
            if self.on_dead is not None:
                try:
                    self.on_dead(exc)
                except Exception:  # noqa: BLE001
                    logger.exception("on_dead callback failed")

    def _report(self, step_stats: Optional[StepStats], finished: list[RequestStats]) -> None:
        """Hand stats to the callbacks; a broken metrics callback must not stop generation."""
        try:
            if step_stats is not None and self.on_step is not None:
                self.on_step(step_stats)
            if self.on_finish is not None:
                for rs in finished:
                    self.on_finish(rs)
        except Exception:  # noqa: BLE001
            logger.exception("stats callback failed")

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt_ids, params, priority, arrival = cmd
                with self._lock:
                    self._pending -= params.n
                    alive = rid in self._streams
                if not alive:
                    continue  # aborted before it reached the scheduler
                try:
                    self.engine.enqueue(rid, prompt_ids, params, priority, arrival)
                except Exception as exc:  # noqa: BLE001 - e.g. a grammar that fails to compile; never crash the loop
                    self._dispatch_error(rid, exc)
            elif cmd[0] == "abort":
                rid = cmd[1]
                deltas = self.engine.abort_request(rid)
                if not deltas:  # never reached the scheduler (or already done): just close the stream
                    with self._lock:
                        self._streams.pop(rid, None)
                self._dispatch(deltas)

    def _dispatch(self, deltas: list[CompletionDelta]) -> None:
        """Hand a step's deltas to their streams: one wake-up of each event loop per step, not one
        per delta, which would cost a cross-thread call and a lock round trip per running request."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[Mailbox[Delivery], Delivery]]] = {}
        with self._lock:
            for d in deltas:
                stream = self._streams.get(d.parent_id)
                if stream is None:
                    continue
                if d.finished:
                    stream.unfinished_choices -= 1
                    if stream.unfinished_choices <= 0:
                        del self._streams[d.parent_id]
                batches.setdefault(stream.box.loop, []).append((stream.box, (stream.tag, d)))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_deliver, batch)

    def _dispatch_error(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.box.loop.call_soon_threadsafe(stream.box.put, (stream.tag, exc))

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.box.loop.call_soon_threadsafe(stream.box.put, (stream.tag, exc))
