"""Every error the server answers, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Handlers and middleware raise :class:`APIError`; the handlers below turn it, FastAPI's request
validation errors (wrong types, missing fields, malformed JSON) and any stray HTTP error into that
body, so a client never sees FastAPI's default 422 shape.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# status -> (OpenAI error type, the rejected-requests metric reason or None)
_KINDS: dict[int, tuple[str, Optional[str]]] = {
    400: ("invalid_request_error", "invalid"),
    401: ("authentication_error", "unauthorized"),
    404: ("invalid_request_error", "invalid"),
    405: ("invalid_request_error", None),
    413: ("invalid_request_error", "too_large"),
    415: ("invalid_request_error", "invalid"),
    429: ("rate_limit_error", "queue_full"),
    500: ("server_error", None),
    503: ("service_unavailable", None),
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
        reject_reason: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        kind = _KINDS.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
        self.type = kind[0]
        self.reject_reason = reject_reason if reject_reason is not None else kind[1]

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param)


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first problem, named like OpenAI names it: 'max_tokens': Input should be a valid integer."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    if not loc:
        if err.get("type") == "missing":
            return bad_request("the request body is missing (expected a JSON object)")
        return bad_request(f"the request body must be a JSON object: {err['msg']}")
    param = loc[0]
    # Union members show up as loc parts ('prompt', 'str'); keep list indices, drop type tags.
    path = param + "".join(f"[{p}]" for p in loc[1:] if p.isdigit())
    msg = err["msg"].removeprefix("Value error, ")
    if err.get("type") == "missing":
        return bad_request(f"'{path}' is a required field", param)
    if msg.startswith("'"):  # our own validators already name the field
        return bad_request(msg, param)
    return bad_request(f"'{path}': {msg}", param)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        _count_rejection(request, exc)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = _validation_error(exc)
        _count_rejection(request, err)
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no such route: {request.method} {request.url.path}"}.get(exc.status_code, str(exc.detail))
        if exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return APIError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error").response()


def _count_rejection(request: Request, exc: APIError) -> None:
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None and exc.reject_reason is not None:
        metrics.rejected(exc.reject_reason)
