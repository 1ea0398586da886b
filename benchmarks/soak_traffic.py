"""The soak's traffic: requests of every kind a client sends, and the one outcome each ends in.

``Traffic.run`` sends one request of a kind picked by weight (plain and streamed completions and chat,
cancellations at several stages, bad requests of a dozen sorts) and returns its :class:`Record`, never
raising: the outcomes are defined in ``soak.py``'s docstring.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

OUTCOMES = ("completed", "rejected", "cancelled", "refused", "errored", "lost")
WORDS = (
    "the a river mountain quick brown fox jumps over lazy dog music ocean city night star light code "
    "python engine server cache token memory garden winter summer story old new house road bird tree "
    "stone cloud rain fire water book letter song dream market train window door friend teacher"
).split()
OVERSIZE_BYTES = 5 * 2**20  # over the service's default 4 MiB body limit


# --------------------------------------------------------------------------------------------------
# Outcomes
# --------------------------------------------------------------------------------------------------


@dataclass
class Record:
    """One request's end: its kind, outcome (one of ``OUTCOMES``), HTTP status and timings."""

    kind: str
    outcome: str
    status: Optional[int] = None
    detail: str = ""
    latency_s: float = 0.0
    ttft_s: Optional[float] = None


@dataclass
class Stats:
    """Every request's record, and how many were sent / are in flight."""

    records: list[Record] = field(default_factory=list)
    in_flight: int = 0
    sent: int = 0

    def add(self, rec: Record) -> None:
        self.records.append(rec)

    def counts(self) -> Counter:
        return Counter(r.outcome for r in self.records)



def _is_openai_error(body: Any) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


# --------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------


class Traffic:
    """Builds and sends one request of a randomly chosen kind; returns its Record, never raises."""

    KINDS = {  # kind -> weight
        "completion": 20,
        "completion_stream": 20,
        "chat": 10,
        "chat_stream": 10,
        "cancel_stream": 8,
        "cancel_early": 4,
        "cancel_plain": 6,
        "bad": 12,
    }

    def __init__(self, client: httpx.AsyncClient, model: str, api_key: Optional[str], max_model_len: int,
                 timeout: float) -> None:
        self.client = client
        self.model = model
        self.api_key = api_key
        self.max_model_len = max_model_len
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._oversize: Optional[bytes] = None

    def pick(self, rng: random.Random) -> str:
        kinds, weights = zip(*self.KINDS.items())
        return rng.choices(kinds, weights)[0]

    # --- payloads ---------------------------------------------------------------------------------

    def _text(self, rng: random.Random, lo: int = 3, hi: int = 60) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    def _sampling(self, rng: random.Random) -> dict:
        body: dict[str, Any] = {"max_tokens": rng.randint(1, 48)}
        if rng.random() < 0.5:
            body["temperature"] = 0.0
        else:
            body["temperature"] = rng.choice([0.7, 1.0])
            body["seed"] = rng.randint(0, 2**31)
        if rng.random() < 0.3:
            body["ignore_eos"] = True
        if rng.random() < 0.15:
            body["n"] = 2
        if rng.random() < 0.15:
            body["stop"] = [rng.choice(WORDS), "\n\n"]
        return body

    def completion(self, rng: random.Random, stream: bool) -> dict:
        # one in ten is long (a few hundred tokens): chunked prefill, and preemption in a small KV cache
        words = self._text(rng, 250, 400) if rng.random() < 0.1 else self._text(rng)
        body = {"model": self.model, "prompt": words, "stream": stream, **self._sampling(rng)}
        if rng.random() < 0.1:
            body["logprobs"] = rng.randint(0, 3)
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return body

    def chat(self, rng: random.Random, stream: bool) -> dict:
        messages = [{"role": "user", "content": self._text(rng, 2, 30)}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": "You are brief."})
        return {"model": self.model, "messages": messages, "stream": stream, **self._sampling(rng)}

    def bad(self, rng: random.Random) -> tuple[str, str, bytes, dict, set[int]]:
        """(name, path, body, extra headers, acceptable statuses) of one request that must be refused."""
        good = {"model": self.model, "prompt": "hello", "max_tokens": 2}
        js = {"Content-Type": "application/json"}

        def enc(obj: Any) -> bytes:
            return json.dumps(obj).encode()

        choices: list[tuple[str, str, bytes, dict, set[int]]] = [
            ("malformed_json", "/v1/completions", b'{"model": "x", "prompt": ', js, {400}),
            ("wrong_type", "/v1/completions", enc({**good, "max_tokens": "ten"}), js, {400}),
            ("token_out_of_vocab", "/v1/completions", enc({**good, "prompt": [2**31 - 1]}), js, {400}),
            ("lone_surrogate", "/v1/completions", b'{"model": "%s", "prompt": "a\\ud800b"}' % self.model.encode(), js, {400}),
            ("over_context", "/v1/completions", enc({**good, "prompt": [17] * (self.max_model_len + 5)}), js, {400}),
            ("n_too_large", "/v1/completions", enc({**good, "n": 10_000}), js, {400}),
            ("bad_logit_bias", "/v1/completions", enc({**good, "logit_bias": {"banana": 1}}), js, {400}),
            ("unknown_model", "/v1/completions", enc({**good, "model": "no-such-model"}), js, {404}),
            ("wrong_content_type", "/v1/completions", enc(good), {"Content-Type": "text/plain"}, {415}),
            ("bad_chat", "/v1/chat/completions", enc({"model": self.model, "messages": []}), js, {400}),
            ("unknown_route", "/v1/nothing", enc(good), js, {404}),
        ]
        if self.api_key:
            choices.append(("no_api_key", "/v1/completions", enc(good), {**js, "Authorization": ""}, {401}))
        if rng.random() < 0.03:
            if self._oversize is None:
                self._oversize = b'{"model": "x", "prompt": "' + b"y" * OVERSIZE_BYTES + b'"}'
            return "oversize_body", "/v1/completions", self._oversize, js, {413}
        return rng.choice(choices)

    # --- sending ----------------------------------------------------------------------------------

    async def run(self, kind: str, rng: random.Random) -> Record:
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout):
                if kind == "bad":
                    rec = await self._bad(rng)
                elif kind in ("completion", "chat"):
                    body = self.completion(rng, False) if kind == "completion" else self.chat(rng, False)
                    rec = await self._plain(kind, body)
                elif kind in ("completion_stream", "chat_stream"):
                    stream_chat = kind == "chat_stream"
                    body = self.chat(rng, True) if stream_chat else self.completion(rng, True)
                    rec = await self._stream(kind, body, t0, stream_chat)
                elif kind == "cancel_stream":
                    body = self.completion(rng, True) | {"max_tokens": rng.randint(16, 64), "ignore_eos": True}
                    rec = await self._stream(kind, body, t0, False, cancel_after=rng.randint(1, 4))
                elif kind == "cancel_early":  # gone before the first event: often while queued or in prefill
                    body = self.chat(rng, True) | {"max_tokens": 32}
                    rec = await self._stream(kind, body, t0, True, cancel_after=0)
                elif kind == "cancel_plain":
                    body = self.completion(rng, False) | {"max_tokens": rng.randint(16, 64), "ignore_eos": True}
                    rec = await self._plain(kind, body, give_up_after=rng.uniform(0.05, 1.5))
                else:
                    raise ValueError(kind)
        except TimeoutError:
            rec = Record(kind, "lost", detail=f"no answer within {self.timeout:g}s")
        except httpx.HTTPError as exc:
            rec = Record(kind, "lost", detail=f"{type(exc).__name__}: {exc}"[:300])
        except Exception as exc:  # noqa: BLE001 - a malformed answer is an error, never a crash of the soak
            rec = Record(kind, "errored", detail=f"{type(exc).__name__}: {exc}"[:300])
        rec.latency_s = time.monotonic() - t0
        return rec

    def _refusal(self, kind: str, resp: httpx.Response, body: Any) -> Optional[Record]:
        """429 / 503 with OpenAI's body: rejected; any other non-200: errored."""
        if resp.status_code == 200:
            return None
        if resp.status_code in (429, 503) and _is_openai_error(body):
            if resp.status_code == 429 and not resp.headers.get("Retry-After", "").isdigit():
                return Record(kind, "errored", resp.status_code, "429 without Retry-After")
            return Record(kind, "rejected", resp.status_code)
        return Record(kind, "errored", resp.status_code, str(body)[:300])

    async def _plain(self, kind: str, body: dict, give_up_after: Optional[float] = None) -> Record:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        task = asyncio.ensure_future(self.client.post(path, json=body, headers=self.headers))
        if give_up_after is not None:
            done, _ = await asyncio.wait({task}, timeout=give_up_after)
            if not done:
                task.cancel()  # closes the connection: the server must abort the request
                try:
                    await task
                except (asyncio.CancelledError, httpx.HTTPError):
                    pass
                return Record(kind, "cancelled")
        resp = await task
        data = resp.json()
        refusal = self._refusal(kind, resp, data)
        if refusal is not None:
            return refusal
        want = body.get("n", 1)
        choices = data.get("choices") or []
        if len(choices) != want or any(c.get("finish_reason") not in ("stop", "length") for c in choices):
            return Record(kind, "errored", 200, f"incomplete answer: {str(data)[:300]}")
        usage = data.get("usage") or {}
        if not 0 < usage.get("completion_tokens", 0) <= want * body["max_tokens"]:
            return Record(kind, "errored", 200, f"bad usage: {usage}")
        return Record(kind, "completed", 200)

    async def _stream(self, kind: str, body: dict, t0: float, chat: bool, cancel_after: Optional[int] = None) -> Record:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        want = body.get("n", 1)
        finished: set[int] = set()
        ttft: Optional[float] = None
        events = 0
        async with self.client.stream("POST", path, json=body, headers=self.headers) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    data = json.loads(raw)
                except ValueError:
                    data = raw.decode("utf-8", "replace")
                refusal = self._refusal(kind, resp, data)
                assert refusal is not None
                return refusal
            if cancel_after == 0:
                return Record(kind, "cancelled", 200)  # leaving the block closes the connection
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    if len(finished) != want:
                        return Record(kind, "errored", 200, f"[DONE] with {len(finished)}/{want} choices finished")
                    return Record(kind, "completed", 200, ttft_s=ttft)
                msg = json.loads(data)
                if "error" in msg:
                    return Record(kind, "errored", 200, f"error event: {msg['error']}"[:300])
                for choice in msg.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text and ttft is None:
                        ttft = time.monotonic() - t0
                    if choice.get("finish_reason") is not None:
                        finished.add(choice["index"])
                events += 1
                if cancel_after is not None and events >= cancel_after:
                    return Record(kind, "cancelled", 200)
        if cancel_after is not None and len(finished) == want:
            return Record(kind, "completed", 200, ttft_s=ttft)  # it finished before we could cancel it
        return Record(kind, "lost", 200, "the stream ended without [DONE]")

    async def _bad(self, rng: random.Random) -> Record:
        name, path, content, headers, expect = self.bad(rng)
        hdrs = {**self.headers, **headers}
        if hdrs.get("Authorization") == "":
            del hdrs["Authorization"]
        resp = await self.client.post(path, content=content, headers=hdrs)
        try:
            data = resp.json()
        except ValueError:
            data = resp.text
        kind = f"bad:{name}"
        if resp.status_code in expect and _is_openai_error(data):
            return Record(kind, "refused", resp.status_code)
        if resp.status_code in (429, 503) and _is_openai_error(data):
            return Record(kind, "rejected", resp.status_code)
        return Record(kind, "errored", resp.status_code, f"expected {sorted(expect)}: {str(data)[:200]}")
