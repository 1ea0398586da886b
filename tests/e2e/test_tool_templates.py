"""Tool calling with a chat template that renders tools itself (Hermes / Qwen ``<tool_call>``
blocks), through the real server on a tiny random-weight model carrying such a template: the tools
and the history's calls reach the template in its own shape, required and named calls are written
in that format under the constrained decoder and parsed back (streamed: id and name first, then
argument fragments), and ``auto`` returns what the model wrote with no tool call left in content."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from engine.tokenizer import Tokenizer
from tests.tiny_models import make_tiny_hf_model

from .conftest import start_server

# Qwen 2.5's tool section, cut to what the test needs (the same tags, tool JSON and call shape).
HERMES = """{%- if tools %}<|im_start|>system
You may call functions. Signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Return each call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tool_call in message.tool_calls %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["tz"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("hermes"), "llama", seed=4)
    (path / "chat_template.jinja").write_text(HERMES)
    return path


@pytest.fixture(scope="module")
def hermes(model_dir, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001, ANN201
    srv = start_server("hermes", tmp_path_factory.mktemp("hermes-log"), "--model", str(model_dir),
                       "--dtype", "float32", "--threads", "1", "--kv-cache-gb", "0.1", "--max-model-len", "1024")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    # Every call names the served model (the directory's name); with_options keeps the client's settings.
    model = client.models.list().data[0].id
    yield _Named(client, model)
    srv.stop()


class _Named:
    """The client with ``model`` filled in: ``hermes.create(...)`` is chat.completions.create for the served model."""

    def __init__(self, client: openai.OpenAI, model: str) -> None:
        self.client, self.model = client, model

    def create(self, **kw):  # noqa: ANN003, ANN201
        return self.client.chat.completions.create(model=self.model, **kw)


def _prompt_tokens(model_dir, messages: list[dict], tools: list[dict]) -> int:  # noqa: ANN001
    tok = Tokenizer.from_hf_dir(model_dir)
    return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools), add_special_tokens=False))


def _check(message, names) -> None:  # noqa: ANN001
    assert message.tool_calls and not message.content
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_in_the_templates_format(hermes: "_Named", model_dir) -> None:  # noqa: ANN001
    for parallel in (True, False):
        r = hermes.create(messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=parallel, max_tokens=150, temperature=1.0, seed=3, n=2)
        for c in r.choices:
            assert c.finish_reason == "tool_calls", c
            _check(c.message, {"get_weather", "get_time"})
            assert parallel or len(c.message.tool_calls) == 1
    # The template rendered the tools (its own system block), not the generic scheme's description.
    assert r.usage.prompt_tokens == _prompt_tokens(model_dir, ASK, TOOLS)


def test_named_call_streams_id_and_name_then_argument_fragments(hermes: "_Named") -> None:
    kw = dict(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
              max_tokens=150, temperature=0)
    whole = hermes.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    _check(whole.message, {"get_weather"})
    pieces: list = []
    finish = None
    for ch in hermes.create(**kw, stream=True):
        for choice in ch.choices:
            pieces += choice.delta.tool_calls or []
            assert not choice.delta.content
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert pieces[0].id and pieces[0].function.name == "get_weather" and not pieces[0].function.arguments
    fragments = [p.function.arguments for p in pieces[1:]]
    assert len(fragments) > 2 and all(p.id is None and p.index == 0 for p in pieces[1:])  # as generated, not at the end
    assert "".join(fragments) == whole.message.tool_calls[0].function.arguments


def test_auto_and_history_in_the_templates_shape(hermes: "_Named", model_dir) -> None:  # noqa: ANN001
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    r = hermes.create(messages=history, tools=TOOLS, max_tokens=24, temperature=1.0, seed=1, n=3)
    native = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in history]
    assert r.usage.prompt_tokens == _prompt_tokens(model_dir, native, TOOLS)
    for c in r.choices:  # a random model writes text: it comes back as content, never a raw block
        assert c.finish_reason in ("stop", "length", "tool_calls")
        if c.message.tool_calls:
            _check(c.message, {"get_weather", "get_time"})
        assert "<tool_call>" not in (c.message.content or "")
