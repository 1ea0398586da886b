"""POST /v1/completions: prompts in, OpenAI's ``text_completion`` objects (or their SSE chunks) out.

A request carries one prompt or several (strings or token ids); each gets ``n`` choices, indexed
``prompt_index * n + j``.  ``echo`` prepends the prompt text, and with ``logprobs`` the prompt's
tokens and logprobs too (the first prompt token has none: ``null``).  ``max_tokens`` defaults to
16; ``null`` means "up to the context length".  A prompt plus ``max_tokens`` beyond the context
length (``--max-model-len``) is a 400, never silently clipped.
"""

from __future__ import annotations

import contextlib
import time
from typing import AsyncIterator, Optional, Sequence

from fastapi import Request
from fastapi.responses import Response

from engine.request import Logprob
from engine.tokenizer import Tokenizer
from service.errors import bad_request
from service.generate import (
    Generation,
    admit,
    finish_reason,
    new_request_id,
    respond,
    sse,
)
from service.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    Usage,
)
from service.sampling import build_sampling_params
from service.state import ServerState
from service.structured import resolve_structured


async def create_completion(req: CompletionRequest, state: ServerState, raw: Request) -> Response:
    engine = admit(req, state)
    if req.suffix:
        raise bad_request("'suffix' is not supported: this server has no insertion model", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        if req.best_of < req.n:
            raise bad_request("'best_of' must be at least 'n'", "best_of")
        raise bad_request("'best_of' greater than 'n' is not supported; ask for 'n' choices instead", "best_of")
    prompt_ids, prompt_texts = _prompts(req, engine.tokenizer)
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:  # echoed prompt tokens come with their logprobs
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    structured = await resolve_structured(req, engine)
    params = build_sampling_params(
        req, max_tokens=req.max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs, structured=structured
    )
    gen = Generation(state, new_request_id("cmpl"), prompt_ids, params, req.priority)
    view = _Completion(req, engine.tokenizer, engine.model_name, gen, prompt_texts)
    return await respond(view, req.stream, raw)


def _prompts(req: CompletionRequest, tok: Tokenizer) -> tuple[list[list[int]], list[str]]:
    """Token ids of each prompt, and the text ``echo`` gives back for it."""
    p = req.prompt
    if isinstance(p, str):
        p = [p]
    elif isinstance(p[0], int):
        p = [p]
    ids, texts = [], []
    for item in p:
        if isinstance(item, str):
            ids.append(tok.encode(item))
            texts.append(item)
        else:
            ids.append(list(item))
            texts.append(tok.decode(item, skip_special_tokens=req.skip_special_tokens) if req.echo else "")
    if not all(ids):
        raise bad_request("the prompt is empty", "prompt")
    return ids, texts


class _LogprobWriter:
    """One choice's logprobs in the completions shape; ``text_offset`` runs on across stream chunks."""

    def __init__(self, tok: Tokenizer, k: int) -> None:
        self.tok = tok
        self.k = k
        self.offset = 0

    def prompt(self, ids: Sequence[int], lps: Optional[Sequence[Optional[Logprob]]], text: str) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for pos, tid in enumerate(ids):
            entry = lps[pos] if lps is not None and pos < len(lps) else None
            token = self.tok.id_to_piece(tid)
            out.tokens.append(token)
            out.token_logprobs.append(None if entry is None else entry.logprob)
            out.top_logprobs.append(None if entry is None else self._top(entry, token))
            out.text_offset.append(self.offset)
            self.offset += len(token)
        self.offset = len(text)  # the completion's tokens count from the end of the echoed text
        return out

    def output(self, lps: Sequence[Logprob], into: Optional[CompletionLogprobs] = None) -> CompletionLogprobs:
        out = into or CompletionLogprobs()
        for entry in lps:
            token = self.tok.id_to_piece(entry.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(entry.logprob)
            out.top_logprobs.append(self._top(entry, token))
            out.text_offset.append(self.offset)
            self.offset += len(token)
        return out

    def _top(self, entry: Logprob, token: str) -> dict[str, float]:
        top = {self.tok.id_to_piece(tid): lp for tid, lp in entry.top[: self.k]}
        top.setdefault(token, entry.logprob)  # the chosen token is always listed, as vLLM and OpenAI do
        return top


def _prompt_logprobs_field(tok: Tokenizer, lps: Optional[list[Optional[Logprob]]]) -> Optional[list]:
    """vLLM's ``prompt_logprobs``: per prompt position, token id -> logprob and text (the first is null)."""
    if lps is None:
        return None
    out: list[Optional[dict[str, PromptLogprob]]] = []
    for entry in lps:
        if entry is None:
            out.append(None)
            continue
        ranked = [(entry.token_id, entry.logprob), *entry.top]
        out.append({str(t): PromptLogprob(logprob=lp, decoded_token=tok.id_to_piece(t)) for t, lp in ranked})
    return out


class _Completion:
    """Turns a Generation's deltas into the response body or its stream of chunks."""

    def __init__(
        self, req: CompletionRequest, tok: Tokenizer, model: str, gen: Generation, prompt_texts: list[str]
    ) -> None:
        self.req = req
        self.tok = tok
        self.model = model
        self.gen = gen
        self.prompt_texts = prompt_texts
        self.n = req.n
        self.want_logprobs = req.logprobs is not None
        self.writers = [_LogprobWriter(tok, req.logprobs or 0) for _ in range(gen.num_choices)]
        self.prompt_lps: list[Optional[list[Optional[Logprob]]]] = [None] * len(gen.prompts)

    def _usage(self) -> Usage:
        g = self.gen
        return Usage(
            prompt_tokens=g.prompt_tokens,
            completion_tokens=g.completion_tokens,
            total_tokens=g.prompt_tokens + g.completion_tokens,
        )

    def _opening(self, i: int, c: int) -> tuple[str, Optional[CompletionLogprobs]]:
        """What a choice starts with: the echoed prompt text (and its logprobs)."""
        if not self.req.echo:
            return "", CompletionLogprobs() if self.want_logprobs else None
        lps = None
        if self.want_logprobs:
            lps = self.writers[c].prompt(self.gen.prompts[i], self.prompt_lps[i], self.prompt_texts[i])
        return self.prompt_texts[i], lps

    def _extra_prompt_logprobs(self, i: int) -> Optional[list]:
        if self.req.prompt_logprobs is None:
            return None
        return _prompt_logprobs_field(self.tok, self.prompt_lps[i]) or []

    async def collect(self) -> CompletionResponse:
        total = self.gen.num_choices
        texts = [""] * total
        lps: list[list[Logprob]] = [[] for _ in range(total)]
        finish: list[Optional[str]] = [None] * total
        stop_reasons: list = [None] * total
        async with contextlib.aclosing(self.gen.deltas()) as deltas:
            async for i, d in deltas:
                c = i * self.n + d.index
                if d.prompt_logprobs is not None and self.prompt_lps[i] is None:
                    self.prompt_lps[i] = d.prompt_logprobs
                texts[c] += d.new_text
                lps[c].extend(d.new_logprobs)
                if d.finished:
                    finish[c], stop_reasons[c] = finish_reason(d), d.stop_reason
        choices = []
        for c in range(total):
            i = c // self.n
            text, logprobs = self._opening(i, c)
            if logprobs is not None:
                self.writers[c].output(lps[c], into=logprobs)
            choices.append(
                CompletionChoice(
                    index=c,
                    text=text + texts[c],
                    logprobs=logprobs,
                    finish_reason=finish[c],
                    stop_reason=stop_reasons[c],
                    prompt_logprobs=self._extra_prompt_logprobs(i),
                )
            )
        return CompletionResponse(id=self.gen.request_id, model=self.model, choices=choices, usage=self._usage())

    async def stream(self) -> AsyncIterator[str]:
        created = int(time.time())
        started: set[int] = set()
        async with contextlib.aclosing(self.gen.deltas()) as deltas:
            async for i, d in deltas:
                c = i * self.n + d.index
                if d.prompt_logprobs is not None and self.prompt_lps[i] is None:
                    self.prompt_lps[i] = d.prompt_logprobs
                first = c not in started
                text, logprobs = self._opening(i, c) if first else ("", CompletionLogprobs() if self.want_logprobs else None)
                text += d.new_text
                if logprobs is not None:
                    self.writers[c].output(d.new_logprobs, into=logprobs)
                if not (text or d.finished or (logprobs is not None and logprobs.tokens)):
                    continue  # nothing to say yet (text held back for a stop string or a split character)
                started.add(c)
                choice = CompletionChoice(
                    index=c,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=finish_reason(d),
                    stop_reason=d.stop_reason if d.finished else None,
                    prompt_logprobs=self._extra_prompt_logprobs(i) if first else None,
                )
                yield sse(CompletionResponse(id=self.gen.request_id, created=created, model=self.model, choices=[choice]))
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            yield sse(
                CompletionResponse(
                    id=self.gen.request_id, created=created, model=self.model, choices=[], usage=self._usage()
                )
            )
