"""Continuous-batching scheduler: which requests run this step, and with how many tokens.

Every request carries ``num_computed_tokens`` (tokens whose K/V are in the cache);
each step it is given up to ``num_tokens - num_computed_tokens`` new tokens, so
prompts, prompt chunks and decodes are all the same thing.  The step's token budget
bounds prompt tokens only: every running decode gets its token on top (at most
``max_num_seqs`` of them), so decodes never shift where prompt chunks end.  Running
requests go first; waiting ones are admitted (priority, then arrival order) while
the budget, ``max_num_seqs`` and KV blocks allow.  When a
running request cannot get a block, the lowest-priority running request is
preempted: its blocks are freed and it is recomputed later (prefix caching
usually makes that cheap).  Nothing is ever dropped.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Optional

from engine.config import SchedulerConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]  # the request's block table (shared list owned by the KV manager)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's known tokens, so a token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # decodes first, then prefills
    total_num_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []  # sorted by Request.sort_key()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # cumulative, read by stats

    # --- queue management -------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request wherever it is (waiting, running, mid-prefill) and free its blocks at once."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = status
        request.times.finished = time.monotonic()
        self.kv.forget(request)
        self.requests.pop(request.request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the step -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running):
            req = self.running[i]
            decode = _is_decode(req)
            if not decode and budget <= 0:
                i += 1
                continue
            num_new = 1 if decode else min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, num_new):
                victim = max(self.running, key=Request.sort_key)
                if self.running.index(victim) < i:  # already given tokens this step: take them back
                    i -= 1
                    entry = next(s for s in scheduled if s.request is victim)
                    scheduled.remove(entry)
                    if not _is_decode(victim):
                        budget += entry.num_new_tokens
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # req itself was preempted; self.running shrank, i now points at the next one
            scheduled.append(ScheduledRequest(req, num_new, self.kv.block_ids(req.request_id)))
            if not decode:
                budget -= num_new
            i += 1

        if not preempted:
            self._admit_waiting(scheduled, budget)

        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # single-token queries first: the attention kernels' decode path
        num_decode = sum(1 for s in scheduled if s.num_new_tokens == 1 and s.request.prefill_done)
        total = sum(s.num_new_tokens for s in scheduled)
        return SchedulerOutput(scheduled, total, total - num_decode, num_decode, preempted)

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        now = time.monotonic()
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[i]
            sibling = req.prefill_after
            if sibling is not None and not sibling.is_finished and not sibling.prefill_done:
                i += 1  # wait for the sibling's prompt blocks, then reuse them
                continue
            computed_blocks, num_cached = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            req.num_computed_tokens = num_cached
            if not self.kv.allocate_slots(req, num_new, computed_blocks):
                req.num_computed_tokens = 0
                break
            del self.waiting[i]
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, num_new, self.kv.block_ids(req.request_id)))
            budget -= num_new

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req)

    # --- after the model ran ----------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests that hit a token-level stop.

        Returns the requests that got a new token this step (finished ones included).
        """
        advanced: list[Request] = []
        for s in output.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_blocks(req, req.num_computed_tokens)
            token = sampled.get(req.request_id)
            if token is None:
                continue  # a prompt chunk that did not reach the end
            req.append_token(token)
            advanced.append(req)
            status = self._check_stop(req, token)
            if status is not None:
                self.finish(req, status)
        return advanced

    def _check_stop(self, req: Request, token: int) -> Optional[RequestStatus]:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _is_decode(req: Request) -> bool:
    """One token to compute after the whole prompt: a decode, outside the prompt-token budget
    (a preempted request recomputing its generated tokens is still a prompt here)."""
    return req.prefill_done and req.num_tokens - req.num_computed_tokens == 1
