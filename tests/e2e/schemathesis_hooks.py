"""Schemathesis hooks for tests/e2e/test_reliability.py (loaded through SCHEMATHESIS_HOOKS).

- The server serves one model: the schema says so (an enum), so positive cases reach the engine
  instead of stopping at 404; negative cases still send other names (and get 404).
- ``n`` above 4 becomes 4 so one generated case cannot run for minutes on two shared cores;
  ``n`` up to 128 and beyond is covered by the targeted tests.
"""

from __future__ import annotations

from typing import Any

import schemathesis

from tests.e2e.helpers import MODEL

MAX_N = 4


@schemathesis.hook
def before_load_schema(context: Any, raw_schema: dict) -> None:
    schemas = raw_schema["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schemas[name]["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    for name in ("TokenizeRequest", "DetokenizeRequest"):
        schemas[name]["properties"]["model"] = {"anyOf": [{"type": "string", "enum": [MODEL]}, {"type": "null"}]}


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    if isinstance(body, dict):
        n = body.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and n > MAX_N:
            body["n"] = MAX_N
    return body
