"""Request fields that constrain the output -> the engine's StructuredSpec, compiled off the event loop.

Accepted, one per request: OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) and vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``.  Grammars are Lark (llguidance's dialect) or GBNF (llama.cpp's).  Anything
that does not compile, or takes longer than COMPILE_TIMEOUT_S to, is a 400 naming its field.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional, Union

from engine.engine import LLMEngine
from engine.structured import StructuredOutputError, StructuredSpec
from service.errors import bad_request
from service.protocol import SamplingFields

# The longest a constraint may take to compile; it runs on a worker thread meanwhile, so the event
# loop and other requests carry on.  llguidance's own fuel limits end pathological grammars well
# before this (~10 ms of lexer construction); the bound is for what passes them on a busy host.
COMPILE_TIMEOUT_S = 5.0
# Backends vLLM clients may name; this server has one (llguidance), which serves all of them.
_BACKENDS = {"auto", "llguidance", "guidance", "xgrammar", "outlines", "lm-format-enforcer"}


def structured_spec(req: SamplingFields) -> Optional[StructuredSpec]:
    """The request's constraint, or None; a 400 naming the field when it asks for two or for
    something this server does not do."""
    if req.guided_whitespace_pattern is not None:
        raise bad_request("'guided_whitespace_pattern' is not supported: JSON is generated compactly", "guided_whitespace_pattern")
    if req.guided_decoding_backend is not None and req.guided_decoding_backend not in _BACKENDS:
        raise bad_request(f"unknown 'guided_decoding_backend' {req.guided_decoding_backend!r}", "guided_decoding_backend")
    found: list[StructuredSpec] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(StructuredSpec("json_object", "", "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("'response_format' of type 'json_schema' needs 'json_schema.schema'", "response_format")
        found.append(StructuredSpec.json_schema(rf.json_schema.schema_, "response_format"))
    so = req.structured_outputs
    if so is not None:
        kinds = [k for k in ("json_", "regex", "choice", "grammar") if getattr(so, k) is not None]
        kinds += ["json_object"] if so.json_object else []
        if len(kinds) != 1:
            raise bad_request(
                "'structured_outputs' needs exactly one of 'json', 'regex', 'choice', 'grammar', 'json_object'",
                "structured_outputs",
            )
        found.append(_from_value(kinds[0].rstrip("_"), getattr(so, kinds[0]), "structured_outputs"))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append(_from_value(kind, value, f"guided_{kind}"))
    if len(found) > 1:
        names = ", ".join(f"'{s.param}'" for s in found)
        raise bad_request(f"a request may constrain its output once; it set {names}", found[1].param)
    return found[0] if found else None


def _from_value(kind: str, value: Any, param: str) -> StructuredSpec:
    if kind == "json_object":
        return StructuredSpec("json_object", "", param)
    if kind == "json":
        return StructuredSpec.json_schema(_schema(value, param), param)
    if kind == "choice":
        return StructuredSpec.choice(value, param)
    return StructuredSpec(kind, value, param)  # type: ignore[arg-type]


def _schema(value: Union[dict[str, Any], str], param: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as exc:
        raise bad_request(f"'{param}' is not valid JSON: {exc}", param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}' must be a JSON schema object", param)
    return schema


async def resolve_structured(req: SamplingFields, engine: LLMEngine) -> Optional[StructuredSpec]:
    """The request's constraint, compiled and checked (see :func:`structured_spec`), or None."""
    spec = structured_spec(req)
    if spec is not None:
        await compile_spec(engine, spec)
    return spec


async def compile_spec(engine: LLMEngine, spec: StructuredSpec) -> None:
    """Compile ``spec`` (into the engine's cache) on a worker thread; 400 if it cannot compile
    or takes longer than COMPILE_TIMEOUT_S."""
    try:
        await asyncio.wait_for(asyncio.to_thread(engine.grammars.compile, spec), COMPILE_TIMEOUT_S)
    except StructuredOutputError as exc:
        raise bad_request(str(exc), exc.param) from None
    except asyncio.TimeoutError:
        raise bad_request(f"'{spec.param}' took longer than {COMPILE_TIMEOUT_S:g}s to compile", spec.param) from None
