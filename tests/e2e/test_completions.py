"""/v1/completions through the official openai client: the shapes it parses and what they contain."""

from __future__ import annotations

import httpx
import openai

from .helpers import MODEL


def greedy(client: openai.OpenAI, prompt, max_tokens: int = 8, **kw):  # noqa: ANN001, ANN003, ANN201
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


def tokenize(http: httpx.Client, text: str) -> list[int]:
    r = http.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion(client: openai.OpenAI, http: httpx.Client) -> None:
    r = greedy(client, "The capital of France is", max_tokens=6)
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-") and r.model == MODEL and r.created > 0
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.text and c.logprobs is None
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(tokenize(http, "The capital of France is"))
    assert 1 <= r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    whole = greedy(client, prompt, max_tokens=10, extra_body={"ignore_eos": True})
    chunks = list(
        greedy(
            client, prompt, max_tokens=10, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    *token_chunks, usage_chunk = chunks
    assert len(token_chunks) >= 2, "tokens should arrive in several chunks"
    assert all(ch.id == token_chunks[0].id and ch.object == "text_completion" for ch in chunks)
    assert "".join(ch.choices[0].text for ch in token_chunks) == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in token_chunks][-1] == "length"
    assert all(ch.choices[0].finish_reason is None for ch in token_chunks[:-1])
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_list_of_prompts(client: openai.OpenAI) -> None:
    prompts = ["The sky is", "My favourite food is"]
    both = greedy(client, prompts, max_tokens=5)
    assert [c.index for c in both.choices] == [0, 1]
    for i, p in enumerate(prompts):
        alone = greedy(client, p, max_tokens=5)
        assert both.choices[i].text == alone.choices[0].text
    singles = [greedy(client, p, max_tokens=5).usage for p in prompts]
    assert both.usage.prompt_tokens == sum(u.prompt_tokens for u in singles)
    assert both.usage.completion_tokens == sum(u.completion_tokens for u in singles)


def test_token_id_prompts(client: openai.OpenAI, http: httpx.Client) -> None:
    text = "Water boils at"
    ids = tokenize(http, text)
    by_text = greedy(client, text, max_tokens=5)
    by_ids = greedy(client, ids, max_tokens=5)
    assert by_ids.choices[0].text == by_text.choices[0].text
    two = greedy(client, [ids, ids], max_tokens=5)
    assert [c.text for c in two.choices] == [by_text.choices[0].text] * 2
    assert two.usage.prompt_tokens == 2 * len(ids)


def test_n_choices(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt=["Hello", "Goodbye"], n=3, max_tokens=4, temperature=1.0, seed=7
    )
    assert [c.index for c in r.choices] == list(range(6))  # prompt_i * n + j
    assert r.usage.completion_tokens >= 6
    # prompt tokens counted once per prompt, not per choice
    assert r.usage.prompt_tokens == greedy(client, ["Hello", "Goodbye"], max_tokens=1).usage.prompt_tokens


def test_logprobs(client: openai.OpenAI) -> None:
    r = greedy(client, "One, two, three,", max_tokens=5, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0
        assert 3 <= len(top) <= 4 and token in top
        assert max(top.values()) == logprob  # greedy: the chosen token is the most likely


def test_echo_with_logprobs(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "Roses are red, violets"
    n_prompt = len(tokenize(http, prompt))
    r = greedy(client, prompt, max_tokens=3, echo=True, logprobs=1, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text.startswith(prompt) and len(c.text) > len(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[n_prompt] == len(prompt)
    # streamed echo: the prompt comes first, with its logprobs
    chunks = list(greedy(client, prompt, max_tokens=3, echo=True, logprobs=1, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert sum(len(ch.choices[0].logprobs.tokens) for ch in chunks) == n_prompt + 3
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None


def test_prompt_logprobs_extra(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "a b c d", "max_tokens": 1, "prompt_logprobs": 2},
    )
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r.json()["usage"]["prompt_tokens"]
    assert all(1 <= len(entry) <= 3 for entry in plp[1:])


def test_stop_strings(client: openai.OpenAI) -> None:
    prompt = "Count: 1, 2, 3, 4,"
    free = greedy(client, prompt, max_tokens=8, extra_body={"ignore_eos": True}).choices[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert stop.strip(), f"need a visible stop string, generated {free!r}"
    expected = free[: free.index(stop)]
    r = greedy(client, prompt, max_tokens=8, stop=[stop, "never-generated-xyz"], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == expected
    chunks = list(
        greedy(
            client, prompt, max_tokens=8, stop=stop, stream=True,
            extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks) == expected + stop
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int, n: int = 1) -> list[str]:
        r = client.completions.create(
            model=MODEL, prompt="In a distant galaxy", max_tokens=6, temperature=1.0, seed=seed, n=n,
            extra_body={"ignore_eos": True},
        )
        return [c.text for c in r.choices]

    first = sample(1234, n=3)
    assert sample(1234, n=3) == first
    assert len(set(first)) > 1, "the n choices of one seeded request should differ"


def test_wide_nucleus_sampling_is_seeded_and_completes(client: openai.OpenAI) -> None:
    """temperature 2 with top_p 0.99 (or top_k 1000) keeps far more than the 64 best tokens:
    those rows take the whole-vocabulary cut-off.  Seeded requests still repeat, choices differ."""
    for extra in ({"top_p": 0.99}, {"top_p": 0.9, "extra_body": {"top_k": 1000, "ignore_eos": True}}):
        kwargs = {"extra_body": {"ignore_eos": True}, **extra}

        def sample() -> list[str]:
            r = client.completions.create(
                model=MODEL, prompt="zebra quantum pickle", max_tokens=8, temperature=2.0, seed=99, n=3, **kwargs
            )
            assert all(c.finish_reason == "length" for c in r.choices) and r.usage.completion_tokens == 24
            return [c.text for c in r.choices]

        first = sample()
        assert sample() == first, extra
        assert len(set(first)) > 1, extra


def test_vllm_extras_are_accepted(client: openai.OpenAI) -> None:
    base = greedy(client, "The weather today is", max_tokens=6, extra_body={"ignore_eos": True}).choices[0].text
    r = client.completions.create(
        model=MODEL, prompt="The weather today is", max_tokens=6, temperature=0.8, user="tester",
        presence_penalty=0.0, frequency_penalty=0.0, logit_bias={}, stop=[],
        extra_body={
            "top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 6, "ignore_eos": True,
            "stop_token_ids": [], "skip_special_tokens": True, "priority": 0,
        },
    )
    assert r.choices[0].text == base  # top_k=1 is greedy whatever the temperature
    assert r.usage.completion_tokens == 6


def test_logit_bias_forces_a_token(client: openai.OpenAI, http: httpx.Client) -> None:
    token = tokenize(http, " banana")[-1]
    r = greedy(client, "I like", max_tokens=3, logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == " banana" * 3


def test_tokenize_detokenize_version(http: httpx.Client) -> None:
    ids = tokenize(http, "Hello world")
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json()["prompt"] == "Hello world"
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 3
    r = http.get("/version")
    assert r.status_code == 200 and r.json()["version"]
