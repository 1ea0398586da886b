"""One HTTP request's trip through the engine, shared by completions and chat.

:class:`Generation` submits every prompt of a request (each asks for ``n`` choices) and merges
their delta streams into one, in arrival order.  It owns what every request needs whatever its
response shape: aborting unfinished sequences when the consumer goes away (client disconnect,
error, shutdown timeout), inter-token latency and generated-token metrics, the token counts for
``usage``, and the one log line per finished request.  Prompts and keys are never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import Counter
from typing import AsyncIterator, Awaitable, Optional, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from engine.async_engine import Delivery, EngineDeadError, Mailbox
from engine.engine import LLMEngine
from engine.request import CompletionDelta, SamplingParams
from service.errors import APIError, bad_request
from service.protocol import SamplingFields
from service.state import ServerState

logger = logging.getLogger("service.requests")

T = TypeVar("T")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def admit(req: SamplingFields, state: ServerState) -> LLMEngine:
    """The checks both generation routes make first: the model asked for is the one served, an
    engine is running (503 otherwise), and ``stream_options`` comes only with ``stream``."""
    engine = state.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return engine


class Generation:
    def __init__(
        self,
        state: ServerState,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int = 0,
    ) -> None:
        self.state = state
        self.request_id = request_id
        self.prompts = prompts
        self.n = params.n
        self.t0 = time.monotonic()
        self.engine_ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        # Every prompt's deltas arrive here tagged with its index, straight from the engine thread's
        # hand-off: one wake-up per streamed token on the event loop.
        self._box: Mailbox[Delivery] = Mailbox(asyncio.get_running_loop())
        state.submit(list(zip(self.engine_ids, prompts)), params, priority, self._box)  # all prompts or none
        state.generations.add(self)
        if params.structured is not None:
            state.metrics.structured_request(params.structured.kind)
        self.first_token_at: Optional[float] = None
        self.finish_reasons: Counter[str] = Counter()
        self.completion_tokens = 0
        self.cached_tokens = 0
        self._last_token_at: dict[tuple[int, int], float] = {}

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    async def deltas(self) -> AsyncIterator[tuple[int, CompletionDelta]]:
        """(prompt index, delta) for every delta of every choice; raises APIError if the engine fails.

        Consume it under ``contextlib.aclosing`` so an early exit aborts the rest at once.
        """
        box = self._box
        open_choices = self.num_choices
        outcome = "abort"
        try:
            while open_choices:
                i, item = await box.get()
                if isinstance(item, APIError):  # cancel(): ended by the server, not the engine
                    raise item
                if isinstance(item, BaseException):
                    outcome = "error"
                    if isinstance(item, EngineDeadError):
                        raise APIError(503, str(item), code="engine_dead")
                    raise APIError(500, f"generation failed: {item}")
                self._observe(i, item)
                if item.finish_reason == "error":
                    outcome = "error"
                    raise APIError(500, f"generation failed: {item.error or 'engine error'}")
                if item.finished:
                    open_choices -= 1
                yield i, item
            outcome = "done"
        finally:
            self.state.generations.discard(self)
            if outcome != "done":
                for rid in self.engine_ids:
                    self.state.abort(rid)  # frees the KV blocks now
                self.state.metrics.ended_early(outcome, self.num_choices - sum(self.finish_reasons.values()))
            self._log(outcome)

    def cancel(self, error: APIError) -> None:
        """End this request early: its consumer gets ``error`` and its sequences are aborted."""
        self._box.put((-1, error))

    def _observe(self, prompt_index: int, d: CompletionDelta) -> None:
        now = time.monotonic()
        if d.new_token_ids:
            self.state.metrics.generated(len(d.new_token_ids))
            key = (prompt_index, d.index)
            last = self._last_token_at.get(key)
            if last is not None:
                self.state.metrics.inter_token_latency(now - last)
            self._last_token_at[key] = now
            if self.first_token_at is None:
                self.first_token_at = now
        if d.finished:
            self.finish_reasons[d.finish_reason or "stop"] += 1
            self.completion_tokens += d.num_output_tokens
            if d.index == 0:
                self.cached_tokens += d.num_cached_tokens

    def _log(self, outcome: str) -> None:
        ttft = f"{self.first_token_at - self.t0:.3f}s" if self.first_token_at is not None else "-"
        finish = ",".join(f"{k}:{v}" for k, v in sorted(self.finish_reasons.items())) or "-"
        what = {"done": "finished", "abort": "aborted", "error": "failed"}[outcome]
        logger.info(
            "%s %s: prompts=%d n=%d prompt_tokens=%d completion_tokens=%d cached_tokens=%d finish=%s ttft=%s e2e=%.3fs",
            self.request_id, what, len(self.prompts), self.n, self.prompt_tokens, self.completion_tokens,
            self.cached_tokens, finish, ttft, time.monotonic() - self.t0,
        )


# --- responses ------------------------------------------------------------------------------------


class ClientDisconnected(Exception):
    pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` (a non-streaming generation); cancel it, aborting its requests, if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        task.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def finish_reason(d: CompletionDelta) -> Optional[str]:
    """The OpenAI finish_reason of a choice's delta: None until it finishes, then "length" when it
    ran out of tokens and "stop" for every other end (the engine's "stop", "abort" and "error")."""
    if not d.finished:
        return None
    return "length" if d.finish_reason == "length" else "stop"


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ResponseView(Protocol):
    """What a route builds from a Generation: its stream of SSE events, or its whole body."""

    def stream(self) -> AsyncIterator[str]: ...

    async def collect(self) -> BaseModel: ...


async def respond(view: ResponseView, stream: bool, raw: Request) -> Response:
    """The route's answer: server-sent events as they come, or the whole body once done (499, the
    nginx convention, when the client left first: nobody reads that body, and the request is aborted)."""
    if stream:
        return StreamingResponse(sse_stream(view.stream()), media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        body = await unless_disconnected(raw, view.collect())
    except ClientDisconnected:
        return Response(status_code=499)
    return Response(body.model_dump_json(), media_type="application/json")


async def sse_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Server-sent events ending in ``[DONE]``; an error after the headers went out becomes an error event."""
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    except APIError as exc:
        yield sse(exc.body())
    yield SSE_DONE
