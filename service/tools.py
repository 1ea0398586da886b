"""OpenAI tool calling for chat, with the constrained decoder doing the enforcing.

The bundled model's chat template knows nothing of tools, so this is the generic scheme
llama-server uses for such templates: the tools are described in a system message, and the
answer is constrained (engine/structured) to one JSON object, either
``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` with each call's arguments following
its function's ``parameters`` schema, or (``tool_choice: "auto"`` only) ``{"content": "..."}``.
:func:`parse_answer` turns that object back into OpenAI's ``message.tool_calls`` or ``content``,
so no tool call is ever left unparsed in ``content``.

``tool_choice``: ``"none"`` (tools neither described nor callable), ``"auto"`` (the default with
tools: call some or answer), ``"required"`` (at least one call), or a named function (exactly one
call of it).  ``parallel_tool_calls: false`` allows one call per answer.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from engine.structured import StructuredSpec
from engine.structured.spec import tool_call_schema
from service.errors import bad_request
from service.protocol import ChatCompletionRequest, ChatMessage, ResponseFunctionCall, ResponseToolCall


@dataclass
class ToolPlan:
    mode: str  # "auto", "required" or "named"
    functions: list[dict[str, Any]]  # OpenAI function objects the answer may call
    parallel: bool
    spec: StructuredSpec


def plan_tools(req: ChatCompletionRequest) -> Optional[ToolPlan]:
    """What the request's ``tools`` / ``tool_choice`` ask for; None when no tool may be called."""
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
    calls = tool_call_schema(functions, array=True)
    if mode == "named" or not parallel:
        calls["maxItems"] = 1
    answer: dict[str, Any] = {
        "type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"], "additionalProperties": False,
    }
    if mode == "auto":
        text = {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"],
                "additionalProperties": False}
        answer = {"anyOf": [answer, text]}
    spec = StructuredSpec("tool_call", json.dumps(answer, separators=(",", ":")), "tools")
    return ToolPlan(mode, functions, parallel, spec)


def _instructions(plan: ToolPlan) -> str:
    tools = json.dumps([{k: f[k] for k in ("name", "description", "parameters") if k in f} for f in plan.functions])
    lines = [f"You can call these functions (JSON schema of each one's arguments under 'parameters'): {tools}"]
    call = 'Answer with one JSON object: {"tool_calls": [{"name": <function name>, "arguments": <its arguments>}]}'
    if plan.mode == "auto":
        lines.append(call + ' to call functions, or {"content": <your reply>} to reply to the user directly.')
    else:
        lines.append(call + ".")
    return "\n".join(lines)


def chat_messages(messages: list[ChatMessage], plan: Optional[ToolPlan]) -> list[dict[str, Any]]:
    """The messages as the chat template sees them: tools described in a system message, earlier
    assistant tool calls written as the JSON answer they were, tool results as ``tool`` messages."""
    out: list[dict[str, Any]] = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in m.tool_calls]
            msg["content"] = json.dumps({"tool_calls": calls})
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    if plan is not None:
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


def parse_answer(text: str, finished_with_stop: bool) -> tuple[Optional[str], list[ResponseToolCall]]:
    """The constrained answer -> (content, tool calls).  An answer cut short (``length``) cannot
    be parsed: it comes back as content, as written."""
    if not finished_with_stop:
        return text, []
    answer = json.loads(text)  # the grammar guarantees it
    if "content" in answer:
        return answer["content"], []
    calls = [
        ResponseToolCall(
            id=f"call_{uuid.uuid4().hex[:24]}",
            function=ResponseFunctionCall(name=c["name"], arguments=json.dumps(c["arguments"])),
        )
        for c in answer["tool_calls"]
    ]
    return None, calls
