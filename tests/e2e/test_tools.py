"""Chat tool calling through the real server and the official openai client: every tool_choice
mode, parallel_tool_calls, streamed tool-call deltas, a tool-result round trip, and the errors."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from .helpers import MODEL

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                       "required": ["tz"], "additionalProperties": False},
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(message, names=None) -> None:  # noqa: ANN001
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=1.0, n=3, seed=5,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        _check_calls(c.message, {"get_time"})
        assert len(c.message.tool_calls) == 1


def test_required_tool_choice_single_and_parallel(client: openai.OpenAI) -> None:
    for parallel in (False, True):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
            max_tokens=120, temperature=0,
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        _check_calls(c.message)
        if not parallel:
            assert len(c.message.tool_calls) == 1


def test_auto_gives_a_call_or_a_reply(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=1.0, n=4, seed=11)
    for c in r.choices:
        if c.finish_reason == "tool_calls":
            _check_calls(c.message)
        elif c.finish_reason == "stop":
            assert c.message.tool_calls is None and isinstance(c.message.content, str)
            assert '"tool_calls"' not in c.message.content


def test_none_ignores_tools(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0]
    r = client.chat.completions.create(**kw, tools=TOOLS, tool_choice="none").choices[0]
    assert r.message.content == plain.message.content and r.message.tool_calls is None


def test_streamed_tool_calls(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message
    calls: dict[int, dict] = {}
    finish = None
    fragments = 0
    for ch in client.chat.completions.create(**kw, stream=True):
        for choice in ch.choices:
            for tc in choice.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.function.name  # id and name come first
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and tc.function.name is None
                    fragments += 1
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert fragments > 2 * len(calls)  # arguments sent as they are generated, not once complete
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls
    ]


@pytest.mark.parametrize("max_tokens", [3, 12, 17])
def test_tool_answer_cut_by_max_tokens(client: openai.OpenAI, max_tokens: int) -> None:
    """Cut short: finish_reason "length", the calls as far as written (the last one's arguments a
    prefix of JSON), never the raw answer as content; streaming says the same."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=max_tokens, temperature=0)
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "length" and c.message.content is None, c
    for call in c.message.tool_calls or []:
        assert call.id.startswith("call_") and call.function.name in SCHEMAS
    streamed: dict[int, list[str]] = {}
    for ch in client.chat.completions.create(**kw, stream=True):
        for choice in ch.choices:
            assert not choice.delta.content
            for tc in choice.delta.tool_calls or []:
                streamed.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
            if choice.finish_reason:
                assert choice.finish_reason == "length"
    assert [(name, args) for name, args in streamed.values()] == [
        (t.function.name, t.function.arguments) for t in c.message.tool_calls or []]


def test_tool_result_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80, temperature=0,
    ).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=60, temperature=0)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "tool_calls", "length")
    if c.finish_reason == "stop":
        assert isinstance(c.message.content, str) and c.message.tool_calls is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, "tools"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "guided_regex": "a"}, "tools"),
    ],
    ids=["unknown-function", "no-tools", "bad-choice", "duplicate", "bad-name", "bad-parameters", "with-response-format",
         "with-guided"],
)
def test_tool_errors(http: httpx.Client, body: dict, param: str) -> None:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
