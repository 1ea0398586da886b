"""OpenAI tool calling for chat: what the model is told, what it may write, and reading it back.

How depends on the model's chat template (service/tool_parsers.detect_format):

* A template that renders tools (Hermes / Qwen ``<tool_call>`` blocks, Llama 3.1+ JSON calls) gets
  the tools as it expects them, and the history's calls and results in its own shape.  With
  ``tool_choice: "auto"`` the model writes freely and its calls are parsed out of its text; with
  ``"required"`` or a named function the constrained decoder (engine/structured) holds it to calls
  in the template's own format, each call's arguments valid under its function's ``parameters``.
* A template that knows nothing of tools (the bundled SmolLM2) gets llama-server's generic scheme:
  the tools described in a system message, and the answer constrained to one JSON object, either
  ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` or (``auto`` only) ``{"content": "..."}``.

Either way service/tool_parsers.py reads the answer into ``message.tool_calls`` and ``content``
(streamed: a call's id and name first, then its arguments as they are written), so no tool call is
left unparsed in ``content``.

``tool_choice``: ``"none"`` (tools neither described nor callable), ``"auto"`` (the default with
tools: call some or answer), ``"required"`` (at least one call), or a named function (exactly one
call to it).  ``parallel_tool_calls: false`` allows at most one call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from engine.structured import StructuredSpec
from engine.structured.spec import tool_call_schema
from service.errors import bad_request
from service.protocol import ChatCompletionRequest, ChatMessage, ResponseFunctionCall, ResponseToolCall
from service.tool_parsers import new_call_id, parse

# Tool-call JSON is generated compactly (as for response_format: a small model can pad whitespace forever).
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


@dataclass
class ToolPlan:
    mode: str  # "auto", "required" or "named"
    functions: list[dict[str, Any]]  # OpenAI function objects the answer may call
    parallel: bool
    fmt: str  # service/tool_parsers.FORMATS: how the model writes calls
    spec: Optional[StructuredSpec]  # None: "auto" on a template that renders tools (parsed, not constrained)

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    @property
    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        """The ``tools`` the chat template renders (OpenAI's shape), or None for the generic scheme."""
        return None if self.fmt == "generic" else [{"type": "function", "function": f} for f in self.functions]


def plan_tools(req: ChatCompletionRequest, fmt: str) -> Optional[ToolPlan]:
    """What the request's ``tools`` / ``tool_choice`` ask for, for a template whose tool-call
    format is ``fmt``; None when no tool may be called."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if choice == "none":
        return None
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request("'response_format' cannot be combined with tool calls; set 'tool_choice' to 'none'", "response_format")
    functions = [t.function.model_dump(exclude_none=True) for t in req.tools]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("'tools' names the same function twice", "tools")
    parallel = req.parallel_tool_calls is not False
    mode = "auto" if choice is None else choice if isinstance(choice, str) else "named"
    if mode == "named":
        wanted = choice.function.name  # type: ignore[union-attr]
        if wanted not in names:
            raise bad_request(f"'tool_choice' names function {wanted!r}, which is not in 'tools'", "tool_choice")
        functions = [f for f in functions if f["name"] == wanted]
    many = parallel and mode != "named"
    if fmt == "generic":
        grammar = _generic_grammar(functions, mode, many)
    elif mode == "auto":
        return ToolPlan(mode, functions, parallel, fmt, None)
    else:
        grammar = _native_grammar(functions, fmt, many)
    return ToolPlan(mode, functions, parallel, fmt, StructuredSpec("tool_call", grammar, "tools"))


def _json_rule(schema: dict[str, Any]) -> str:
    return "%json" + json.dumps({**schema, **_COMPACT}, separators=(",", ":"))


def _generic_grammar(functions: list[dict[str, Any]], mode: str, many: bool) -> str:
    """Lark grammar of the generic scheme's answer: one JSON object holding the calls, or
    (``auto``) the reply."""
    calls = tool_call_schema(functions, array=True)
    if not many:
        calls["maxItems"] = 1
    answer: dict[str, Any] = {
        "type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"], "additionalProperties": False,
    }
    if mode == "auto":
        text = {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"],
                "additionalProperties": False}
        answer = {"anyOf": [answer, text]}
    return f"start: answer\nanswer: {_json_rule(answer)}"


def _native_grammar(functions: list[dict[str, Any]], fmt: str, many: bool) -> str:
    """Lark grammar of one or more calls written as the template's format has them: Hermes
    ``<tool_call>`` blocks on their own lines, or Llama 3 objects separated by ``; ``."""
    if fmt == "hermes":
        call = f'"<tool_call>\\n" args "\\n</tool_call>"\nargs: {_json_rule(tool_call_schema(functions, array=False))}'
        sep = '"\\n"'
    else:
        call = f"args\nargs: {_json_rule(tool_call_schema(functions, array=False, args_key='parameters'))}"
        sep = '"; "'
    start = f"start: call ({sep} call)*" if many else "start: call"
    return f"{start}\ncall: {call}"


def _instructions(plan: ToolPlan) -> str:
    tools = json.dumps([{k: f[k] for k in ("name", "description", "parameters") if k in f} for f in plan.functions])
    lines = [f"You can call these functions (JSON schema of each one's arguments under 'parameters'): {tools}"]
    call = 'Answer with one JSON object: {"tool_calls": [{"name": <function name>, "arguments": <its arguments>}]}'
    if plan.mode == "auto":
        lines.append(call + ' to call functions, or {"content": <your reply>} to reply to the user directly.')
    else:
        lines.append(call + ".")
    return "\n".join(lines)


def chat_messages(messages: list[ChatMessage], plan: Optional[ToolPlan], fmt: str) -> list[dict[str, Any]]:
    """The messages as the chat template sees them.  Earlier assistant tool calls and ``tool``
    results: in the template's own shape where it renders tools (``fmt`` not ``generic``), else
    as the generic scheme's JSON answer, with the tools described in a system message."""
    out: list[dict[str, Any]] = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            calls = [(c, _arguments(c.function.arguments)) for c in m.tool_calls]
            if fmt == "generic":
                msg["content"] = json.dumps({"tool_calls": [{"name": c.function.name, "arguments": a} for c, a in calls]})
            else:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": a}} for c, a in calls
                ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    if plan is not None and plan.fmt == "generic":
        text = _instructions(plan)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}".strip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        raise bad_request("an assistant message's tool call 'arguments' is not valid JSON", "messages") from None


def parse_answer(plan: ToolPlan, text: str) -> tuple[Optional[str], list[ResponseToolCall]]:
    """A finished choice's text -> (content, tool calls).  A choice cut by ``max_tokens`` keeps
    the calls it began, the last one's ``arguments`` as far as they were written."""
    parsed = parse(plan.fmt, text, plan.names, final=True)
    calls = [
        ResponseToolCall(id=new_call_id(), function=ResponseFunctionCall(name=c.name, arguments=c.arguments))
        for c in parsed.calls[: None if plan.parallel else 1]
    ]
    return parsed.content or None, calls
