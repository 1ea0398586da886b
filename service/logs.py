"""Log set-up (``--log-format text|json``) and the request id every line about a request carries.

The request id is the client's ``X-Request-Id`` header when it sends a usable one, else a new
one; GateMiddleware sets it for the request's task (a context variable, so every log line written
while serving that request sees it, streaming included) and echoes it in the response header.
JSON lines hold the time, level, logger, message, request id and any exception; they carry what
the log calls pass, and no call logs a prompt or a completion's text.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import uuid
from datetime import datetime, timezone
from typing import Optional

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REQUEST_ID_HEADER = b"x-request-id"
# What a client may send as its id: printable, no spaces or quotes (it goes into logs and a
# response header), at most 128 characters. Anything else is replaced by a generated id.
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")

current_request_id: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("request_id", default=None)


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """The request's X-Request-Id when it is usable, else a fresh random id (32 hex digits)."""
    for name, value in headers:
        if name == REQUEST_ID_HEADER:
            text = value.decode("latin-1").strip()
            if _CLIENT_ID.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex


class _RequestIdFilter(logging.Filter):
    """Puts the current request id (or None) on every record as ``record.request_id``."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get()
        return True


class TextFormatter(logging.Formatter):
    """The plain format, with ``[request_id]`` before the message of lines about a request."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        rid = getattr(record, "request_id", None)
        if rid:
            record = logging.makeLogRecord({**record.__dict__, "message": f"[{rid}] {record.message}"})
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, request_id
    (when the line is about a request), exception (when one is logged)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: str, fmt: str) -> None:
    """Route every logger (uvicorn's included) to stderr in ``fmt`` (text or json)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
