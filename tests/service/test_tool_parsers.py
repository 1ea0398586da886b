"""Tool-call parsing (service/tool_parsers.py): what each template family's model writes -> content
and tool calls, and the streamed pieces, fed a character at a time, add up to the same answer."""

from __future__ import annotations

import json

import pytest

from service.tool_parsers import ToolCallStream, detect_format, parse

NAMES = {"get_weather", "get_time"}
HERMES_TEMPLATE = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>{{ message.content }}</tool_call>"
LLAMA3_TEMPLATE = ('{%- if tools %}Given the following functions, respond with a JSON for a function call with its proper '
                   'arguments.\nRespond in the format {"name": function name, "parameters": dictionary of argument name '
                   'and its value}.{%- endif %}<|python_tag|>')


def test_detect_format() -> None:
    assert detect_format(HERMES_TEMPLATE) == "hermes"
    assert detect_format(LLAMA3_TEMPLATE) == "llama3_json"
    assert detect_format("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}") == "generic"
    assert detect_format(None) == "generic"


def _streamed(fmt: str, text: str, parallel: bool = True) -> tuple[str, list[dict]]:
    """Feed ``text`` a character at a time; the content and calls the deltas add up to."""
    s = ToolCallStream(fmt, NAMES, parallel)
    content, calls = "", []
    for i, ch in enumerate(text):
        new, deltas = s.feed(ch, final=i == len(text) - 1)
        content += new
        for d in deltas:
            if d.index == len(calls):
                assert d.id and d.id.startswith("call_") and d.name  # id and name come first
                calls.append({"name": d.name, "arguments": ""})
            else:
                assert d.id is None and d.name is None
            calls[d.index]["arguments"] += d.arguments
    return content, calls


CASES = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris {1}", "unit": "celsius"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Paris {1}", "unit": "celsius"}), ("get_time", {"tz": "CET"})]),
    ("hermes", "It is sunny, 21 degrees <tool_ca", "It is sunny, 21 degrees <tool_ca", []),
    ("hermes", '<tool_call>{"name": "nope", "arguments": {}}</tool_call> ok',
     '<tool_call>{"name": "nope", "arguments": {}}</tool_call> ok', []),
    ("hermes", '<tool_call>not json</tool_call>', "<tool_call>not json</tool_call>", []),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}; {"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}',
     "", [("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Rome", "unit": "celsius"})]),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("generic", '{"tool_calls":[{"name":"get_time","arguments":{"tz":"EST"}},{"name":"get_weather","arguments":{"city":"a\\"b","unit":"celsius"}}]}',
     "", [("get_time", {"tz": "EST"}), ("get_weather", {"city": 'a"b', "unit": "celsius"})]),
    ("generic", '{"content":"Hi \\"you\\" \\u00e9\\n"}', 'Hi "you" \u00e9', []),
]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_parse_whole_and_streamed(fmt: str, text: str, content: str, calls: list) -> None:
    whole = parse(fmt, text, NAMES, final=True)
    assert whole.content.strip() == content.strip()
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    assert all(c.done for c in whole.calls)
    streamed_content, streamed_calls = _streamed(fmt, text)
    assert streamed_content.strip() == whole.content.strip()
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == [(c.name, c.arguments) for c in whole.calls]


def test_cut_call_keeps_its_partial_arguments() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    whole = parse("hermes", text, NAMES, final=True)
    assert whole.content == "" and len(whole.calls) == 1
    assert whole.calls[0].name == "get_weather" and not whole.calls[0].done
    assert whole.calls[0].arguments == '{"city": "Par'


def test_arguments_stream_as_they_are_written() -> None:
    """The name goes out once whole, then every argument character as it comes (none held to the end)."""
    s = ToolCallStream("generic", NAMES, parallel=True)
    _, deltas = s.feed('{"tool_calls":[{"name":"get_ti', final=False)
    assert deltas == []
    _, deltas = s.feed('me","arguments":{"tz":"', final=False)
    assert [(d.name, d.arguments) for d in deltas] == [("get_time", ""), (None, '{"tz":"')]
    _, deltas = s.feed("U", final=False)
    assert [d.arguments for d in deltas] == ["U"]


def test_not_parallel_keeps_the_first_call() -> None:
    content, calls = _streamed("llama3_json", '{"name": "get_time", "parameters": {"tz": "UTC"}}; {"name": "get_time", "parameters": {"tz": "CET"}}',
                               parallel=False)
    assert [json.loads(c["arguments"]) for c in calls] == [{"tz": "UTC"}]
