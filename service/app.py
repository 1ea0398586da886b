"""The FastAPI app: routes, error handlers, the gate middleware and the engine's lifespan.

``create_app(config)`` builds everything; ``python -m service`` runs it with uvicorn.  The app
starts answering at once (``/health`` 503) while the model loads and warms up in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

import service
from service import chat, completions
from service.config import ServiceConfig
from service.errors import APIError, bad_request, install_handlers
from service.metrics import Metrics
from service.middleware import GateMiddleware
from service.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from service.state import ServerState

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": desc}
    for code, desc in {
        400: "Invalid request: bad value, wrong type, missing field or malformed JSON",
        401: "Missing or wrong API key",
        404: "Unknown model",
        413: "Request body over the size limit",
        415: "Request body not sent as application/json",
        429: "Waiting queue full; see Retry-After",
        503: "Model loading, engine stopped, or shutting down",
    }.items()
}
_STREAM_RESPONSE: dict[str, Any] = {
    "description": "JSON body, or with stream: true server-sent events (data: {chunk} ... data: [DONE])",
    "content": {"text/event-stream": {}},
}


def create_app(config: ServiceConfig, state: Optional[ServerState] = None) -> FastAPI:
    state = state or ServerState(config, Metrics())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(state.start())
        try:
            yield
        finally:
            loading.cancel()
            state.stop()

    app = FastAPI(title="cpuserve", version=service.__version__, lifespan=lifespan)
    app.state.server = state
    app.state.metrics = state.metrics
    install_handlers(app)
    app.add_middleware(GateMiddleware, state=state)

    @app.get("/health", responses={503: _ERRORS[503]})
    async def health() -> Response:
        if state.healthy:
            return JSONResponse({"status": "ok"})
        if state.draining:
            reason = "shutting down"
        elif state.load_error is not None:
            reason = f"the model failed to load: {state.load_error}"
        elif not state.ready:
            reason = "the model is loading"
        else:
            reason = "the engine has stopped"
        return APIError(503, reason).response()

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=service.__version__)

    @app.get("/v1/models", response_model=ModelList, responses={503: _ERRORS[503]})
    async def models() -> ModelList:
        engine, _ = state.engines()
        return ModelList(data=[ModelCard(id=engine.model_name, created=state.created, max_model_len=engine.max_model_len)])

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={200: _STREAM_RESPONSE, **_ERRORS},
    )
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completions.create_completion(body, state, raw)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={200: _STREAM_RESPONSE, **_ERRORS},
    )
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create_chat_completion(body, state, raw)

    @app.post("/tokenize", response_model=TokenizeResponse, responses={k: _ERRORS[k] for k in (400, 401, 404, 413, 415, 503)})
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        engine = state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
        if body.messages is not None:
            ids = chat.render_chat(engine.tokenizer, body.messages, body.add_generation_prompt)
        else:
            ids = engine.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses={k: _ERRORS[k] for k in (400, 401, 404, 413, 415, 503)})
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        engine = state.check_model(body.model)
        vocab = engine.model_config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens, skip_special_tokens=False))

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI documents a 422 for every body; this server answers 400 instead (OpenAI's shape)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
