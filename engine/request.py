"""What a request is: its sampling parameters, its state inside the engine, and what it emits."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.structured.spec import StructuredSpec

MAX_LOGPROBS = 20


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass
class SamplingParams:
    """Per-request decoding settings; names and defaults follow vLLM's (and OpenAI's where both exist)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: Optional[int] = None  # number of top alternatives besides the chosen token
    prompt_logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured: Optional[StructuredSpec] = None  # constrained decoding (engine/structured)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field; the service turns it into a 400."""
        checks = [
            (self.n >= 1, "n", "must be at least 1"),
            (0.0 <= self.temperature <= 2.0, "temperature", "must be in [0, 2]"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be -1 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                "must not exceed max_tokens",
            ),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be between 0 and {MAX_LOGPROBS}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be between 0 and {MAX_LOGPROBS}",
            ),
            (all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()), "logit_bias", "values must be in [-100, 100]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise SamplingParamsError(name, f"'{name}' {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p cut the distribution a token is drawn from."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class SamplingParamsError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Logprob:
    """The chosen token's log-probability and the top alternatives at one position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass
class RequestTimes:
    arrival: float
    first_scheduled: Optional[float] = None
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    finished: Optional[float] = None


class Request:
    """One sequence inside the engine.  ``n > 1`` becomes n of these sharing a ``parent_id``."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        priority: int = 0,
        arrival_time: Optional[float] = None,
        parent_id: Optional[str] = None,
        index: int = 0,
        arrival_seq: int = 0,
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id or request_id
        self.index = index  # choice index within the parent
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_seq = arrival_seq
        self.times = RequestTimes(arrival=arrival_time if arrival_time is not None else time.monotonic())
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling; -1 until then
        self.num_preemptions = 0
        self.stop_reason: Optional[int | str] = None
        self.error: Optional[str] = None
        # A sibling (n > 1) whose prompt must be computed first so this one reuses its blocks.
        self.prefill_after: Optional[Request] = None
        self.generator: Optional[torch.Generator] = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.output_logprobs: list[Logprob] = []
        self.prompt_logprobs: list[Optional[Logprob]] = []
        # llguidance matcher tracking this sequence's output, when params.structured is set.
        self.matcher = None
        # What the engine has already reported in CompletionDeltas.
        self.num_sent_tokens = 0
        self.prompt_logprobs_sent = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def sort_key(self) -> tuple[int, int]:
        """Lower is served first: priority, then arrival order (FCFS)."""
        return (self.priority, self.arrival_seq)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/{self.num_tokens})"


def choice_requests(
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_ids: tuple[int, ...],
    priority: int,
    arrival_time: float,
    arrival_seq: int,
    share_prompt: bool,
) -> list[Request]:
    """One Request per choice.  ``n > 1`` becomes n sequences ``{request_id}#{i}`` with n=1 each,
    seeds ``seed + i`` (distinct but reproducible); with ``share_prompt`` (prefix caching) the
    later ones wait for the first's prompt to be computed and reuse its blocks."""
    reqs: list[Request] = []
    for i in range(params.n):
        child_params = params
        if params.n > 1:
            child_params = SamplingParams(**{**params.__dict__, "n": 1})
            if params.seed is not None:
                child_params.seed = params.seed + i
        rid = request_id if params.n == 1 else f"{request_id}#{i}"
        req = Request(
            rid,
            prompt_ids,
            child_params,
            eos_token_ids,
            priority,
            arrival_time,
            parent_id=request_id,
            index=i,
            arrival_seq=arrival_seq,
        )
        if i > 0 and share_prompt:
            req.prefill_after = reqs[0]
        reqs.append(req)
    return reqs


@dataclass
class CompletionDelta:
    """What one request produced in one engine step (new tokens and text since the last one)."""

    request_id: str
    parent_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[Logprob]
    finished: bool
    finish_reason: Optional[str]  # "stop", "length", "abort", "error"
    stop_reason: Optional[int | str] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list[Optional[Logprob]]] = None  # sent once, with the first delta
    error: Optional[str] = None
    times: Optional[RequestTimes] = None  # set on the last delta


@dataclass
class CompletionOutput:
    """One finished choice, as the offline ``LLM.generate`` returns it."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    stop_reason: Optional[int | str] = None
    logprobs: list[Logprob] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: Optional[list[Optional[Logprob]]] = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
