"""The gate every HTTP request passes before a route: API key, body size, drain; HTTP metrics;
and the request id (X-Request-Id in, the same id out, on every log line about the request).

Plain ASGI (not Starlette's BaseHTTPMiddleware, which gets in the way of streaming and of
disconnect detection).  ``/health`` and ``/metrics`` never need the key (compared in constant
time).  The body is read here, up to ``--max-request-bytes`` (413 beyond), checked (415 for a
content type that is not JSON, 400 for a lone UTF-16 surrogate escape, which no tokenizer can
encode) and replayed to the app.  An unexpected exception in a route becomes a 500 in OpenAI's
shape here, so the connection stays usable.
"""

from __future__ import annotations

import hmac
import logging
import re
from typing import Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import APIError
from service.logs import REQUEST_ID_HEADER, current_request_id, request_id_from
from service.state import ServerState

logger = logging.getLogger("service.errors")

OPEN_PATHS = frozenset({"/health", "/metrics"})
ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/version",
        "/health",
        "/metrics",
        "/docs",
        "/openapi.json",
    }
)


class GateMiddleware:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        key = state.config.api_key
        self._key = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = 500  # if the app raises before answering
        started = False
        request_id = request_id_from(scope["headers"])
        id_token = current_request_id.set(request_id)

        async def send_and_record(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                headers = [h for h in message.get("headers", []) if h[0].lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, request_id.encode("latin-1"))]}
            await send(message)

        try:
            error = self._check(scope)
            if error is None and scope["method"] in ("POST", "PUT", "PATCH"):
                body, error = await self._read_body(scope, receive)
                if error is None:
                    error = _check_body(scope, body)
                if error is None:
                    receive = _replay(body, receive)
            if error is not None:
                self.state.metrics.rejected(error.reject_reason or "invalid")
                await error.response()(scope, receive, send_and_record)
                return
            await self.app(scope, receive, send_and_record)
        except Exception:
            logger.exception("unhandled error on %s %s", scope["method"], path)
            if started:
                raise  # mid-response: nothing sane to send; uvicorn closes the connection
            await APIError(500, "internal server error").response()(scope, receive, send_and_record)
        finally:
            self.state.metrics.http_response(path if path in ROUTES else "other", status)
            current_request_id.reset(id_token)

    def _check(self, scope: Scope) -> Optional[APIError]:
        if scope["path"] in OPEN_PATHS:
            return None
        if self._key is not None and not self._authorized(scope):
            return APIError(
                401,
                "missing or incorrect API key: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if self.state.draining and scope["method"] == "POST":
            return APIError(503, "the server is shutting down", code="shutting_down", reject_reason="shutting_down")
        return None

    def _authorized(self, scope: Scope) -> bool:
        assert self._key is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
                    return True
        return False

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes, Optional[APIError]]:
        limit = self.state.config.max_request_bytes
        too_large = APIError(
            413, f"the request body is larger than this server's limit of {limit} bytes", code="request_too_large"
        )
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return b"", too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away; the app will see an empty body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return b"", too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks), None


# One JSON string escape: a surrogate pair (fine), a lone surrogate (captured), or any other escape.
_ESCAPE = re.compile(
    rb"\\(?:u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|(?P<lone>u[dD][89a-fA-F][0-9a-fA-F]{2})|.)",
    re.DOTALL,
)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def has_lone_surrogate(body: bytes) -> bool:
    """True if the JSON text escapes half a UTF-16 surrogate pair (``"\\ud800"``): not a character."""
    if not _SURROGATE_ESCAPE.search(body):
        return False
    return any(m.group("lone") for m in _ESCAPE.finditer(body))


def _is_json_type(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def _check_body(scope: Scope, body: bytes) -> Optional[APIError]:
    for name, value in scope["headers"]:
        if name == b"content-type" and value.strip() and not _is_json_type(value):
            shown = value.decode("latin-1")[:100]
            return APIError(415, f"the request body must be JSON (Content-Type: application/json), not '{shown}'")
    if has_lone_surrogate(body):
        return APIError(
            400,
            "the request body holds a lone UTF-16 surrogate escape (such as \\ud800); strings must be valid Unicode",
        )
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body once, then the real channel (so the app still hears the client disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
