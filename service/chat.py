"""POST /v1/chat/completions: messages through the model's chat template, then the same engine.

Non-streaming answers are ``chat.completion`` objects; streaming sends ``chat.completion.chunk``
deltas: first ``{"role": "assistant", "content": ""}`` for every choice, then the content as it
comes, then an empty delta with the finish reason.  ``logprobs: true`` (with ``top_logprobs: k``)
gives OpenAI's chat shape: ``content: [{token, logprob, bytes, top_logprobs}]``.  ``max_tokens``
(or ``max_completion_tokens``) defaults to the rest of the context.
"""

from __future__ import annotations

import contextlib
import time
from typing import AsyncIterator, Optional, Sequence

import jinja2
from fastapi import Request
from fastapi.responses import Response

from engine.request import MAX_LOGPROBS, CompletionDelta, Logprob
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
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaFunctionCall,
    DeltaToolCall,
    ResponseToolCall,
    Usage,
)
from service.sampling import build_sampling_params
from service.state import ServerState
from service.structured import compile_spec, resolve_structured, structured_spec
from service.tool_parsers import ToolCallStream, detect_format
from service.tools import ToolPlan, chat_messages, parse_answer, plan_tools


async def create_chat_completion(req: ChatCompletionRequest, state: ServerState, raw: Request) -> Response:
    engine = admit(req, state)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    plan = plan_tools(req, detect_format(engine.tokenizer.chat_template))
    prompt_ids = render_chat(engine.tokenizer, req.messages, req.add_generation_prompt, plan)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}", "top_logprobs")
    if plan is None:
        structured = await resolve_structured(req, engine)
    elif structured_spec(req) is not None:
        raise bad_request("a request that may call tools cannot constrain its output otherwise", "tools")
    else:
        structured = plan.spec
        if structured is not None:
            await compile_spec(engine, structured)
    params = build_sampling_params(
        req, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs, structured=structured
    )
    gen = Generation(state, new_request_id("chatcmpl"), [prompt_ids], params, req.priority)
    view = _Chat(req, engine.tokenizer, engine.model_name, gen, logprobs, plan)
    return await respond(view, req.stream, raw)


def render_chat(
    tok: Tokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool, tools: Optional[ToolPlan] = None
) -> list[int]:
    """Messages -> prompt token ids, through the model's template (which adds any BOS itself);
    with ``tools``, described to the model as service/tools.py does."""
    plain = chat_messages(list(messages), tools, detect_format(tok.chat_template))
    extra = {"tools": tools.template_tools} if tools is not None and tools.template_tools else {}
    try:
        text = tok.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, **extra)
    except (ValueError, jinja2.TemplateError) as exc:  # no template, or the template refused the messages
        raise bad_request(f"cannot apply the chat template: {exc}", "messages") from None
    return tok.encode(text, add_special_tokens=False)


class _Chat:
    def __init__(
        self,
        req: ChatCompletionRequest,
        tok: Tokenizer,
        model: str,
        gen: Generation,
        top_k: Optional[int],
        tools: Optional[ToolPlan] = None,
    ) -> None:
        self.req = req
        self.tools = tools
        self.tok = tok
        self.model = model
        self.gen = gen
        self.top_k = top_k  # None: no logprobs

    def _logprobs(self, lps: Sequence[Logprob]) -> Optional[ChatChoiceLogprobs]:
        if self.top_k is None:
            return None
        content = []
        for entry in lps:
            token = self.tok.id_to_piece(entry.token_id)
            top = [self._top(tid, lp) for tid, lp in entry.top[: self.top_k]]
            content.append(
                ChatTokenLogprob(token=token, logprob=entry.logprob, bytes=list(token.encode()), top_logprobs=top)
            )
        return ChatChoiceLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> ChatTopLogprob:
        token = self.tok.id_to_piece(token_id)
        return ChatTopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    def _usage(self) -> Usage:
        g = self.gen
        return Usage(
            prompt_tokens=g.prompt_tokens,
            completion_tokens=g.completion_tokens,
            total_tokens=g.prompt_tokens + g.completion_tokens,
        )

    async def collect(self) -> ChatCompletionResponse:
        n = self.gen.num_choices
        texts = [""] * n
        lps: list[list[Logprob]] = [[] for _ in range(n)]
        finish: list[Optional[CompletionDelta]] = [None] * n
        async with contextlib.aclosing(self.gen.deltas()) as deltas:
            async for _, d in deltas:
                texts[d.index] += d.new_text
                lps[d.index].extend(d.new_logprobs)
                if d.finished:
                    finish[d.index] = d
        choices = []
        for j in range(n):
            reason = finish_reason(finish[j]) if finish[j] else None
            content, calls = (texts[j], []) if self.tools is None else parse_answer(self.tools, texts[j])
            choices.append(
                ChatChoice(
                    index=j,
                    message=ChatResponseMessage(content=content, tool_calls=calls or None),
                    logprobs=self._logprobs(lps[j]),
                    finish_reason=_tool_finish(reason, bool(calls)),
                    stop_reason=finish[j].stop_reason if finish[j] else None,
                )
            )
        return ChatCompletionResponse(id=self.gen.request_id, model=self.model, choices=choices, usage=self._usage())

    def _tool_chunks(self, stream: ToolCallStream, d: CompletionDelta) -> list[ChatChunkChoice]:
        """A tool-calling choice's new text -> its chunks: content as it comes, each call's id and
        name once written, then its arguments in fragments as they are generated."""
        content, pieces = stream.feed(d.new_text, d.finished)
        logprobs = self._logprobs(d.new_logprobs) if d.new_logprobs else None
        out = []
        if content or (logprobs and not pieces):
            out.append(ChatChunkChoice(index=d.index, delta=ChatDelta(content=content or None), logprobs=logprobs))
            logprobs = None
        for p in pieces:
            call = DeltaToolCall(index=p.index, id=p.id, type="function" if p.id else None,
                                 function=DeltaFunctionCall(name=p.name, arguments=p.arguments))
            out.append(ChatChunkChoice(index=d.index, delta=ChatDelta(tool_calls=[call]), logprobs=logprobs))
            logprobs = None
        if d.finished:
            out.append(ChatChunkChoice(index=d.index, delta=ChatDelta(),
                                       finish_reason=_tool_finish(finish_reason(d), bool(stream.ids)), stop_reason=d.stop_reason))
        return out

    async def stream(self) -> AsyncIterator[str]:
        created = int(time.time())
        plan = self.tools
        calls = [ToolCallStream(plan.fmt, plan.names, plan.parallel) for _ in range(self.gen.num_choices)] if plan else []

        def chunk(choices: list[ChatChunkChoice], usage: Optional[Usage] = None) -> str:
            return sse(
                ChatCompletionChunk(id=self.gen.request_id, created=created, model=self.model, choices=choices, usage=usage)
            )

        for j in range(self.gen.num_choices):
            yield chunk([ChatChunkChoice(index=j, delta=ChatDelta(role="assistant", content=""))])
        async with contextlib.aclosing(self.gen.deltas()) as deltas:
            async for _, d in deltas:
                if calls:
                    for c in self._tool_chunks(calls[d.index], d):
                        yield chunk([c])
                    continue
                logprobs = self._logprobs(d.new_logprobs) if d.new_logprobs else None
                if not (d.new_text or d.finished or logprobs):
                    continue  # text held back (a possible stop string, a split character)
                choice = ChatChunkChoice(
                    index=d.index,
                    delta=ChatDelta(content=d.new_text or None),
                    logprobs=logprobs,
                    finish_reason=finish_reason(d),
                    stop_reason=d.stop_reason if d.finished else None,
                )
                yield chunk([choice])
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            yield chunk([], self._usage())


def _tool_finish(reason: Optional[str], called: bool) -> Optional[str]:
    """OpenAI's finish_reason for a choice that may have called tools: "tool_calls" when it ended
    by itself after calling; "length" (calls as far as written) when max_tokens cut it."""
    return "tool_calls" if called and reason == "stop" else reason
