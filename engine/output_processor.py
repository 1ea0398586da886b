"""A step's sampled tokens -> each request's delta: text, stop strings, logprobs, finish, stats.

Runs inside the engine step (its time is the step's "detokenize" phase) so that a stop string
finishes the request, and frees its KV blocks, in the same step.  While streaming, text that
could still grow into a stop string is held back.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from engine.request import CompletionDelta, Request, RequestStatus
from engine.stats import RequestStats
from engine.structured.accept import CompleteOutputCheck
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from engine.model_runner import RunnerOutput
    from engine.scheduler import Scheduler, SchedulerOutput


class OutputProcessor:
    """Keeps each live request's text state and turns what a step produced into deltas.

    ``scheduler`` is where a request that hit a stop string is finished (its blocks freed).
    """

    def __init__(self, tokenizer: Tokenizer, scheduler: "Scheduler") -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.text_states: dict[str, RequestTextState] = {}  # request id -> text state, until finished

    def add(self, request: Request) -> None:
        self.text_states[request.request_id] = RequestTextState(self.tokenizer, request)

    def process(
        self, sched: "SchedulerOutput", runner_out: "RunnerOutput", advanced: list[Request]
    ) -> tuple[list[CompletionDelta], list[RequestStats]]:
        """The step's deltas (one per request that got a token) and the stats of those it finished."""
        now = time.monotonic()
        for req in advanced:
            lp = runner_out.logprobs.get(req.request_id)
            if lp is not None:
                req.output_logprobs.append(lp)
            if req.times.first_token is None:
                req.times.first_token = now
            req.times.last_token = now
            token_stop = req.status == RequestStatus.FINISHED_STOPPED
            stop = self.text_states[req.request_id].update(req, token_level_stop=token_stop)
            if stop is not None and not req.is_finished:
                req.stop_reason = stop
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        for rid, lps in runner_out.prompt_logprobs.items():
            req = next(s.request for s in sched.scheduled if s.request.request_id == rid)
            if len(req.prompt_logprobs) < req.num_prompt_tokens:
                req.prompt_logprobs.extend(lps)
        deltas = [self.delta(req) for req in advanced]
        return deltas, [request_stats(req) for req in advanced if req.is_finished]

    def delta(self, req: Request) -> CompletionDelta:
        """What ``req`` produced since its last delta; a finished request's text state is dropped."""
        state = self.text_states.get(req.request_id)
        finished = req.is_finished
        new_text = state.take_new_text(finished) if state is not None else ""
        new_ids = req.output_token_ids[req.num_sent_tokens :]
        new_lps = req.output_logprobs[req.num_sent_tokens :]
        req.num_sent_tokens = req.num_output_tokens
        prompt_lps = None
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            if len(req.prompt_logprobs) >= req.num_prompt_tokens or finished:
                prompt_lps = req.prompt_logprobs
                req.prompt_logprobs_sent = True
        if finished:
            self.text_states.pop(req.request_id, None)
        return CompletionDelta(
            request_id=req.request_id,
            parent_id=req.parent_id,
            index=req.index,
            new_token_ids=new_ids,
            new_text=new_text,
            new_logprobs=new_lps,
            finished=finished,
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt_logprobs=prompt_lps,
            error=req.error,
            times=req.times if finished else None,
        )


def request_stats(req: Request) -> RequestStats:
    """The timings a finished request reports (queue, TTFT, TPOT, end to end)."""
    t = req.times
    end = t.finished or time.monotonic()
    tpot = None
    if t.first_token is not None and t.last_token is not None and req.num_output_tokens > 1:
        tpot = (t.last_token - t.first_token) / (req.num_output_tokens - 1)
    return RequestStats(
        request_id=req.request_id,
        finish_reason=req.status.value,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        queue_s=(t.first_scheduled or end) - t.arrival,
        ttft_s=(t.first_token - t.arrival) if t.first_token is not None else None,
        e2e_s=end - t.arrival,
        tpot_s=tpot,
    )


class RequestTextState:
    """One request's text so far: incremental detokenization, stop-string search, hold-back."""

    def __init__(self, tokenizer: Tokenizer, request: Request) -> None:
        p = request.params
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, p.skip_special_tokens)
        self.stops = p.stop
        self.include_stop = p.include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0  # characters of self.text already emitted
        self.num_tokens_seen = 0
        self.stopped: Optional[str] = None  # the stop string that ended the request
        # A constrained output ends at a stop string only where what it returns is complete
        # (engine/structured/accept.py); elsewhere the stop string is part of the constrained text.
        self.complete: Optional[CompleteOutputCheck] = None
        if self.stops and request.matcher is not None:
            self.complete = CompleteOutputCheck(request.matcher.deep_copy(), lambda t: tokenizer.encode(t, False))
        self.not_complete: set[tuple[int, str]] = set()  # stop matches already found to cut it short

    def update(self, request: Request, token_level_stop: bool) -> Optional[str]:
        """Feed the request's new tokens; returns a matched stop string (the request must then finish)."""
        new_ids = request.output_token_ids[self.num_tokens_seen :]
        self.num_tokens_seen = request.num_output_tokens
        if token_level_stop and new_ids and not self.include_stop:
            new_ids = new_ids[:-1]  # the EOS / stop token itself is not part of the text
        for tid in new_ids:
            before = len(self.text)
            self.text += self.detok.add(tid)
            if self.stops and self.stopped is None and len(self.text) > before:
                hit = self._find_stop(before)
                if hit is not None:
                    return hit
        return None

    def _find_stop(self, new_from: int) -> Optional[str]:
        start = max(0, new_from - self.holdback)
        # Earliest first; at one index, the stop string listed first.
        hits = sorted((i, k, s) for k, s in enumerate(self.stops) for i in _occurrences(self.text, s, start))
        for idx, _, s in hits:
            kept = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
            if self.complete is not None and ((idx, s) in self.not_complete or not self.complete(kept)):
                self.not_complete.add((idx, s))
                continue
            self.text = kept
            self.stopped = s
            return s
        return None

    def take_new_text(self, finished: bool) -> str:
        """Text not yet emitted; while running, keep back what could be the start of a stop string."""
        end = len(self.text) if finished or not self.stops else max(self.sent, len(self.text) - self.holdback)
        out = self.text[self.sent : end]
        self.sent = end
        return out


def _occurrences(text: str, sub: str, start: int) -> list[int]:
    """Every index >= ``start`` where ``sub`` begins in ``text`` (overlapping ones included)."""
    out = []
    idx = text.find(sub, start)
    while idx >= 0:
        out.append(idx)
        idx = text.find(sub, idx + 1)
    return out
