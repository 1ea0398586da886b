"""Constrained decoding through the real server and the official openai client: response_format,
vLLM's structured_outputs and guided_* fields, on both routes, streaming and not, n > 1 at
temperature 1 — every output that finishes with "stop" must validate — and the 400s for
constraints that cannot compile."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from .helpers import MODEL, metric, scrape

# Nested: objects in an array, enums, a pattern, integer bounds, bounded strings and arrays, no
# extra properties.  Bounds keep the tiny model's answers short enough to finish.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "pets": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["cat", "dog"]},
                    "legs": {"type": "integer", "minimum": 0, "maximum": 4},
                },
                "required": ["kind", "legs"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "role", "zip", "pets"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
PROMPT = "Here is a person as JSON:"


def _valid(text: str, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), schema)


def _check_choices(choices: list, texts: list[str], schema: dict[str, Any]) -> None:
    assert any(c.finish_reason == "stop" for c in choices), [(c.finish_reason, t) for c, t in zip(choices, texts)]
    for c, text in zip(choices, texts):
        if c.finish_reason == "stop":
            _valid(text, schema)


def test_chat_json_schema_n4_temperature_1(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=120, temperature=1.0, n=4, seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    assert len(r.choices) == 4
    _check_choices(r.choices, [c.message.content for c in r.choices], PERSON)


def test_completions_json_schema_n4_temperature_1(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=120, temperature=1.0, n=4,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
    )
    _check_choices(r.choices, [c.text for c in r.choices], PERSON)


def test_greedy_and_seeded_json_object(client: openai.OpenAI) -> None:
    """json_object: any JSON object; greedy rows must not take the LM head's unmasked argmax."""
    for temperature in (0.0, 0.7):
        r = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=60, temperature=temperature, seed=1,
            response_format={"type": "json_object"},
        )
        text = r.choices[0].message.content
        assert text.startswith("{"), text
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_streaming_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    kw = dict(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
              response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    _valid(text, schema)
    streamed = "".join(
        ch.choices[0].text for ch in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True, extra_body={"guided_json": schema})
    )
    _valid(streamed, schema)


@pytest.mark.parametrize(
    "body, check",
    [
        ({"structured_outputs": {"regex": r"[0-9]{3}-[A-Z]{2}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", t)),
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
        ({"structured_outputs": {"json": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
                                          "required": ["x"], "additionalProperties": False}}},
         lambda t: 0 <= json.loads(t)["x"] <= 99 and list(json.loads(t)) == ["x"]),
        ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
        ({"structured_outputs": {"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'}},
         lambda t: re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", t)),
        ({"guided_grammar": 'root ::= "say " word\nword ::= "yes" | "no"'}, lambda t: t in ("say yes", "say no")),
        ({"guided_regex": r"(true|false)"}, lambda t: t in ("true", "false")),
        ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ],
    ids=["regex", "choice", "json", "json_object", "lark", "gbnf", "guided_regex", "guided_choice"],
)
def test_structured_outputs_kinds(client: openai.OpenAI, body: dict, check) -> None:  # noqa: ANN001
    r = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=60, temperature=1.0, n=2, seed=3, extra_body=body)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=0, extra_body=body)
    outputs = [(c.finish_reason, c.text) for c in r.choices] + [(chat.choices[0].finish_reason, chat.choices[0].message.content)]
    assert any(reason == "stop" for reason, _ in outputs), outputs  # free-form JSON may run on at temperature 1
    for reason, text in outputs:
        if reason == "stop":
            assert check(text), text
        else:  # cut short: a prefix of something the constraint accepts
            assert "json" in str(body) and text.startswith("{"), (reason, text)


def test_text_format_and_unconstrained_neighbours(client: openai.OpenAI) -> None:
    """response_format text is unconstrained: the same greedy text as without it."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw, extra_body={"response_format": {"type": "text"}}).choices[0].text == plain


def test_max_tokens_gives_a_valid_prefix(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                  extra_body={"guided_json": PERSON})
    c = r.choices[0]
    assert c.finish_reason == "length" and '{"name":"'.startswith(c.text[:9]) or c.text.startswith('{"name":"')


NESTED = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer", "minimum": 0, "maximum": 9}},
                                                "required": ["b"], "additionalProperties": False},
                                  "c": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["a", "c"], "additionalProperties": False}


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_never_cut_a_constrained_output_short(client: openai.OpenAI, include: bool) -> None:
    """A "}" stop string appears inside {"a":{"b":..},"c":..}: where the text it would return is not
    complete JSON it is part of the output, so "stop" still means valid.  Kept ("include"), the
    last "}" completes the object and ends it with stop_reason "}"; dropped, no cut is ever complete
    and the grammar's own end (EOS) finishes it."""
    extra = {"guided_json": NESTED, "stop": ["}"], "include_stop_str_in_output": include}
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, extra_body=extra)
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    _valid(c.text, NESTED)
    assert getattr(c, "stop_reason", None) == ("}" if include else None)  # absent from the body when None
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True, extra_body=extra))
    assert "".join(ch.choices[0].text for ch in streamed) == c.text
    assert streamed[-1].choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=1.0, n=3, seed=2,
                                          stop=["}", ","], response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": NESTED}})
    for choice in chat.choices:
        assert choice.finish_reason == "stop", choice
        _valid(choice.message.content, NESTED)


def _error(http: httpx.Client, route: str, body: dict) -> dict:
    base = {"model": MODEL, "max_tokens": 4}
    base.update({"messages": CHAT} if "chat" in route else {"prompt": PROMPT})
    r = http.post(route, json={**base, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    return err


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/definitions/nope"}}}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}}, "response_format"),
        ({"guided_regex": "[unclosed"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_decoding_backend": "magic"}, "guided_decoding_backend"),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        ({"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(160)}}}, "guided_json"),
    ],
    ids=["unknown-type", "json_schema-without-schema", "bad-ref", "bad-type", "bad-regex", "bad-grammar", "empty-choice",
         "two-kinds", "unsupported-key", "schema-not-json", "two-fields", "backend", "whitespace", "too-large"],
)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_errors_name_the_param(http: httpx.Client, route: str, body: dict, param: str) -> None:
    err = _error(http, route, body)
    assert err["param"] == param, err
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_hostile_constraints_do_not_stall(client: openai.OpenAI, http: httpx.Client) -> None:
    """Pathological regexes, deep nesting, huge enums and recursive $ref: served or a 400, quickly."""
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(60):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    hostile = [
        {"guided_regex": "(a+)+$"},
        {"guided_regex": "(x|x|x|x)*y{1,1000}z{1,1000}"},
        {"guided_json": deep},
        {"guided_json": {"enum": [f"value-{i}" for i in range(3000)]}},
        {"guided_json": {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}},
    ]
    for body in hostile:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 8, "temperature": 1.0, **body}, timeout=30)
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert r.json()["error"]["param"] == next(iter(body))


def test_metrics_count_constrained_requests(client: openai.OpenAI, server) -> None:  # noqa: ANN001
    before = scrape(server.url)
    client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_choice": ["a", "b"]})
    after = scrape(server.url)
    assert metric(after, "cpuserve:structured_requests_total", kind="choice") == metric(
        before, "cpuserve:structured_requests_total", kind="choice") + 1
    assert metric(after, "cpuserve:step_structured_mask_seconds_count") > metric(before, "cpuserve:step_structured_mask_seconds_count")
    assert metric(after, "cpuserve:step_structured_mask_seconds_sum") > metric(before, "cpuserve:step_structured_mask_seconds_sum")
