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


class JsonSchemaFormat(_Request):
    """OpenAI's ``response_format.json_schema``; ``strict`` is accepted either way (the schema is
    always enforced)."""

    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputs(_Request):
    """vLLM's ``structured_outputs``: exactly one of these.  Keys this server does not implement
    (``structural_tag``, ``whitespace_pattern``, ...) are rejected, not ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: Optional[Union[dict[str, Any], str]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


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
    # Constrained decoding (service/structured.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* names.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    # Accepted by OpenAI or vLLM, not implemented here: refused unless absent or neutral
    # (service/sampling.py: UNSUPPORTED), never silently ignored.
    use_beam_search: Optional[Any] = None
    length_penalty: Optional[Any] = None
    truncate_prompt_tokens: Optional[Any] = None
    allowed_token_ids: Optional[Any] = None
    bad_words: Optional[Any] = None
    logits_processors: Optional[Any] = None
    return_tokens_as_token_ids: Optional[Any] = None
    prediction: Optional[Any] = None

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


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ChatContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool message: which call it answers

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema; None: no arguments
    strict: Optional[bool] = None  # accepted either way: arguments always follow ``parameters``


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None  # None: true
    # Refused unless absent or neutral (see SamplingFields).
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[Any] = None
    web_search_options: Optional[Any] = None
    reasoning_effort: Optional[Any] = None
    continue_final_message: Optional[Any] = None
    chat_template: Optional[Any] = None
    chat_template_kwargs: Optional[Any] = None
    documents: Optional[Any] = None
    echo: Optional[Any] = None
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


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ResponseToolCall]] = Field(None, exclude_if=lambda v: not v)


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[Union[int, str]] = Field(None, exclude_if=lambda v: v is None)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = Field(None, exclude_if=lambda v: v is None)
    arguments: str = ""


class DeltaToolCall(BaseModel):
    """One streamed piece of a tool call: the first for each ``index`` carries its id and name."""

    index: int
    id: Optional[str] = Field(None, exclude_if=lambda v: v is None)
    type: Optional[Literal["function"]] = Field(None, exclude_if=lambda v: v is None)
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = Field(None, exclude_if=lambda v: v is None)
    content: Optional[str] = Field(None, exclude_if=lambda v: v is None)
    tool_calls: Optional[list[DeltaToolCall]] = Field(None, exclude_if=lambda v: v is None)


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[FinishReason] = None
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
