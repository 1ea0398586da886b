"""/v1/chat/completions through the official openai client."""

from __future__ import annotations

import httpx
import openai

from .helpers import MODEL

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_completion(client: openai.OpenAI, http: httpx.Client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert r.usage.prompt_tokens == prompt["count"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    first, *rest, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert "".join(ch.choices[0].delta.content or "" for ch in rest) == whole.choices[0].message.content
    assert rest[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens


def test_chat_n_and_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, n=2, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob  # greedy: chosen is the top


def test_chat_multi_turn_with_system_and_content_parts(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"},
        ],
        max_completion_tokens=4,
        temperature=0,
    )
    assert r.choices[0].message.content is not None
    assert r.usage.completion_tokens <= 4
