"""Every refusal is OpenAI's error body with the right status, and the server keeps serving after it."""

from __future__ import annotations

import httpx
import openai
import pytest

from .helpers import API_KEY, MAX_MODEL_LEN, MAX_REQUEST_BYTES, MODEL, metric, scrape

GOOD = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json=GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


BAD_COMPLETIONS = [
    # (id, body changes, param)
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"max_tokens": -5}, "max_tokens"),
    ("temperature high", {"temperature": 2.5}, "temperature"),
    ("temperature negative", {"temperature": -0.1}, "temperature"),
    ("top_p zero", {"top_p": 0}, "top_p"),
    ("top_p above one", {"top_p": 1.5}, "top_p"),
    ("n zero", {"n": 0}, "n"),
    ("logprobs 21", {"logprobs": 21}, "logprobs"),
    ("prompt over the context", {"prompt": [100] * (MAX_MODEL_LEN + 10)}, "prompt"),
    ("prompt plus max_tokens over the context", {"prompt": [100] * (MAX_MODEL_LEN - 10), "max_tokens": 20}, "max_tokens"),
    ("token id outside the vocabulary", {"prompt": [10**9]}, "prompt"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("suffix", {"suffix": "the end"}, "suffix"),
    ("best_of above n", {"best_of": 3}, "best_of"),
    ("stream_options without stream", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("max_tokens wrong type", {"max_tokens": "ten"}, "max_tokens"),
    ("temperature wrong type", {"temperature": "hot"}, "temperature"),
    ("stream wrong type", {"stream": "yes"}, "stream"),
    ("prompt wrong type", {"prompt": {"text": "hi"}}, "prompt"),
    ("mixed prompt list", {"prompt": [1, "a"]}, "prompt"),
    ("stop wrong type", {"stop": 5}, "stop"),
    ("logit_bias bad key", {"logit_bias": {"banana": 1}}, "logit_bias"),
    ("logit_bias out of range", {"logit_bias": {"5": 500}}, "logit_bias"),
    ("missing prompt", {"prompt": None}, "prompt"),
    ("missing model", {"model": None}, "model"),
]


@pytest.mark.parametrize("changes,param", [c[1:] for c in BAD_COMPLETIONS], ids=[c[0] for c in BAD_COMPLETIONS])
def test_invalid_completion_is_400(http: httpx.Client, changes: dict, param: str) -> None:
    body = {**GOOD, **changes}
    body = {k: v for k, v in body.items() if v is not None}  # None: leave the field out
    assert_error(http.post("/v1/completions", json=body), 400, param)
    assert_still_serving(http)


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"", b"[1, 2]", b'"a string"', b'{"model": "x", "prompt": "a",}'],
    ids=["malformed", "empty", "array", "string", "trailing comma"],
)
def test_malformed_body_is_400(http: httpx.Client, raw: bytes) -> None:
    r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert_error(r, 400)
    assert_still_serving(http)


BAD_CHATS = [
    ("no messages", {"messages": []}, "messages"),
    ("bad role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ("top_logprobs 21", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens"),
    ("temperature high", {"temperature": 3}, "temperature"),
    ("image content", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
]


@pytest.mark.parametrize("changes,param", [c[1:] for c in BAD_CHATS], ids=[c[0] for c in BAD_CHATS])
def test_invalid_chat_is_400(http: httpx.Client, changes: dict, param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **changes}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)
    assert_still_serving(http)


def test_unknown_model_is_404(http: httpx.Client) -> None:
    err = assert_error(http.post("/v1/completions", json={**GOOD, "model": "gpt-9"}), 404, "model")
    assert err["code"] == "model_not_found"
    chat = {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}
    assert_error(http.post("/v1/chat/completions", json=chat), 404, "model")
    assert_still_serving(http)


def test_unknown_route_is_404_in_openai_shape(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/completions"), 405)
    assert_still_serving(http)


def test_api_key(server, http: httpx.Client) -> None:  # noqa: ANN001
    with httpx.Client(base_url=server.url, timeout=60) as anon:
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY}):
            err = assert_error(anon.post("/v1/completions", json=GOOD, headers=headers), 401)
            assert err["code"] == "invalid_api_key"
        assert anon.get("/v1/models").status_code == 401
        assert anon.post("/tokenize", json={"prompt": "x"}).status_code == 401
        # /health and /metrics stay open
        assert anon.get("/health").status_code == 200
        assert anon.get("/metrics").status_code == 200
    assert_still_serving(http)


def test_official_client_sees_errors(server) -> None:  # noqa: ANN001
    bad_key = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        good.completions.create(model=MODEL, prompt="Hi", max_tokens=-1)
    assert info.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        good.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert good.completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices


def test_body_over_the_limit_is_413(http: httpx.Client) -> None:
    big = {**GOOD, "prompt": "word " * MAX_REQUEST_BYTES}
    err = assert_error(http.post("/v1/completions", json=big), 413)
    assert err["code"] == "request_too_large"
    # without a Content-Length (chunked upload) the limit holds too
    def chunks():  # noqa: ANN202
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 1000 + 1):
            yield b"x" * 1000
        yield b'"}'
    assert_error(http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)
    assert_still_serving(http)


def test_rejections_are_counted(server, http: httpx.Client) -> None:  # noqa: ANN001
    before = scrape(server.url)
    http.post("/v1/completions", json={**GOOD, "max_tokens": 0})
    httpx.post(server.url + "/v1/completions", json=GOOD)  # no key
    after = scrape(server.url)
    for reason in ("invalid", "unauthorized"):
        name = "cpuserve:requests_rejected_total"
        assert metric(after, name, reason=reason) == metric(before, name, reason=reason) + 1
    assert metric(after, "cpuserve:http_requests_total", route="/v1/completions", status="401") >= 1
