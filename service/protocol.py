"""The wire format: pydantic models for what clients send and what the server answers.

Requests are validated strictly (``"5"`` is not an integer, ``1`` is not a boolean) so that a wrong
type is a clear 400, as OpenAI answers it.  Value ranges (``temperature`` in [0, 2], ...) are the
engine's ``SamplingParams.validate``'s job: one place for each rule.  Unknown fields are ignored,
as OpenAI and vLLM ignore them.  Responses follow OpenAI's schema field for field so the official
client parses them; vLLM's extras (``prompt_logprobs``, ``stop_reason``) are added fields.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

# --- shared --------------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


# Fields with a "plain" validator lose their type in the generated JSON schema; these restore it
# for the OpenAPI document (clients, fuzzers).
_STOP_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]}
_PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}, "minItems": 1},
    ]
}


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("'stop' must be a string or a list of strings")


class SamplingFields(_Request):
    """Fields completions and chat share: OpenAI's, then vLLM's extras under vLLM's names."""

    model: str
    n: int = 1
    temperature: Optional[float] = None  # None: 1.0
    top_p: Optional[float] = None  # None: 1.0
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = Field(None, json_schema_extra=_STOP_SCHEMA)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None  # token id (as a string) -> bias in [-100, 100]
    seed: Optional[int] = None
    user: Optional[str] = None
    # vLLM extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: Optional[int] = None
    priority: int = 0  # lower runs first

    _stop = field_validator("stop", mode="plain")(_check_stop)


# --- /v1/completions -----------------------------------------------------------------------------

Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(json_schema_extra=_PROMPT_SCHEMA)
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None  # 0..20 alternatives per position
    echo: bool = False
    suffix: Optional[str] = None  # refused: no insertion models
    best_of: Optional[int] = None  # refused unless equal to n

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            if all(isinstance(p, str) for p in value):
                return value
            if all(_is_token_id(t) for t in value):
                return value
            if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in value):
                return value
        elif isinstance(value, list):
            raise ValueError("'prompt' must not be empty")
        raise ValueError(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None
    stop_reason: Optional[Union[int, str]] = Field(None, exclude_if=lambda v: v is None)
    # vLLM's shape: one entry per prompt token (the first None), token id -> its logprob and text.
    prompt_logprobs: Optional[list[Optional[dict[str, PromptLogprob]]]] = Field(None, exclude_if=lambda v: v is None)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


# --- /v1/chat/completions ------------------------------------------------------------------------


class ChatContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ChatContentPart]]] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None  # None: up to the context length
    max_completion_tokens: Optional[int] = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: Optional[int] = None  # 0..20, needs logprobs: true
    add_generation_prompt: bool = True  # vLLM extra


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None
    stop_reason: Optional[Union[int, str]] = Field(None, exclude_if=lambda v: v is None)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = Field(None, exclude_if=lambda v: v is None)
    content: Optional[str] = Field(None, exclude_if=lambda v: v is None)


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None
    stop_reason: Optional[Union[int, str]] = Field(None, exclude_if=lambda v: v is None)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = Field(None, exclude_if=lambda v: v is None)


# --- models, tokenizer, errors -------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cpuserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """Either ``prompt`` (plain text) or ``messages`` (rendered with the chat template first)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
