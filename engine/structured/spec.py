"""What a constrained request asks for, independent of the HTTP shape it came in."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json", "json_object", "regex", "choice", "grammar", "tool_call"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar", "tool_call")


@dataclass(frozen=True)
class StructuredSpec:
    """One constraint on a request's output.

    ``kind`` is what the ``cpuserve:structured_requests_total`` metric counts by; ``source`` is
    the constraint's text (a JSON schema serialised compactly, property order kept: it is the order
    generated; a regex; the choices as a JSON list; a Lark/GBNF grammar; for ``tool_call``, a Lark
    grammar), so equal constraints share one compiled grammar.
    ``param`` is the request field it came from, for error messages.
    """

    kind: Kind
    source: str
    param: str = "response_format"

    @classmethod
    def json_schema(cls, schema: Any, param: str) -> "StructuredSpec":
        return cls("json", json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def choice(cls, choices: list[str], param: str) -> "StructuredSpec":
        return cls("choice", json.dumps(list(choices)), param)

    @property
    def cache_key(self) -> tuple[str, str]:
        return (self.kind, self.source)


def tool_call_schema(functions: list[dict[str, Any]], *, array: bool, args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of a call to one of ``functions`` (OpenAI function objects: name,
    parameters): ``{"name": ..., "arguments": {...}}`` (Llama 3 writes ``parameters``:
    ``args_key``), or a non-empty list of them."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, args_key: f.get("parameters") or {"type": "object"}},
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for f in functions
    ]
    one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": one, "minItems": 1} if array else one
