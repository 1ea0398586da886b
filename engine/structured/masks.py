"""Each step's token masks for the constrained rows, built off the critical path or not at all.

Most constrained rows are checked instead of masked (:meth:`MaskBatch.refused`): a greedy row's
argmax, or a token drawn from an untruncated distribution (no top-k, top-p or min-p), stands where
the grammar accepts it (a microsecond's check), and only the rows whose token it refuses get a mask
and take the argmax again or draw again from the masked distribution.  That is exact: the accepted
argmax is also the masked row's (ties too: torch's first maximum is allowed, so it is the first
allowed one), and drawing from p until a token is allowed draws from p restricted to the allowed set.
A model that mostly follows its schema thus skips most masks, whose building competed with the
forward for the cores.

Rows drawn from a truncated distribution are masked ahead, since truncating before the mask would
cut a different set: llguidance computes their masks (a bit per vocabulary token) on a worker
thread, outside the GIL.  :class:`MaskPlanner` starts them as early as they are known: right after
the previous step's tokens are committed, so they are built while the engine processes outputs and
schedules (Python on one core, the forward's threads idle) and, if need be, during the next
forward; a batch that a step's rows do not match is rebuilt before that step's forward.  The
sampler then calls :meth:`MaskBatch.apply`, which waits for them and sets every disallowed logit
to -inf (natively where the extension is built).

Unconstrained rows are never touched, and a batch without constrained rows costs one list
comprehension.  After sampling, :meth:`MaskPlanner.commit` advances each constrained row's matcher
by the token it drew.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import llguidance as llg
import numpy as np
import torch

if TYPE_CHECKING:
    from engine.request import Request

logger = logging.getLogger(__name__)

# One worker: the masks of a step are one batched call (llguidance spreads the rows over its own
# threads, up to one a core: the call starts while the engine's Python leaves the forward's threads
# idle); the worker exists so that call overlaps the engine's Python and the forward pass.
_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="structured-masks")
_executor: Optional[llg.LLExecutor] = None


def _ll_executor() -> llg.LLExecutor:
    global _executor
    if _executor is None:
        _executor = llg.LLExecutor(num_threads=max(1, min(4, os.cpu_count() or 1)))
    return _executor


class MaskBatch:
    """The masks of one step's constrained rows.

    ``requests``: the constrained requests, in mask order (the sampler finds each one's logits row
    by identity, so it may sample them alone or among others); ``positions``: each one's output
    length when its mask was started (the mask is for its next token only);
    ``bits``: int32 ``[len(requests), ceil(vocab / 32)]``, bit ``t % 32`` of word ``t // 32`` set where
    token ``t`` is allowed.  ``seconds``: time spent building and applying them (for the
    ``step_structured_mask_seconds`` histogram).
    """

    def __init__(self, requests: list["Request"], vocab_size: int) -> None:
        self.requests = requests
        self.positions = [r.num_output_tokens for r in requests]
        self.vocab_size = vocab_size
        self.bits = torch.zeros(len(requests), (vocab_size + 31) // 32, dtype=torch.int32)
        self.build_s = 0.0
        self.apply_s = 0.0
        self.late: Optional[MaskBatch] = None  # the masks of the rows refused() refused
        self._future: Optional[Future] = _worker.submit(self._build, [r.matcher for r in requests]) if requests else None

    def _build(self, matchers: list[llg.LLMatcher]) -> None:
        t0 = time.perf_counter()
        pairs = [(m, i) for i, m in enumerate(matchers)]
        _ll_executor().unsafe_compute_mask_ptr(pairs, self.bits.data_ptr(), self.bits.shape[1] * 4, len(pairs))
        self.build_s = time.perf_counter() - t0

    @property
    def seconds(self) -> float:
        return self.build_s + self.apply_s + (self.late.seconds if self.late is not None else 0.0)

    def covers(self, requests: Sequence["Request"]) -> bool:
        """Whether this batch holds the next-token mask of every one of ``requests``."""
        at = {id(r): n for r, n in zip(self.requests, self.positions)}
        return all(at.get(id(r)) == r.num_output_tokens for r in requests)

    def wait(self) -> None:
        """Block until the masks are built (the matchers may then change again)."""
        if self._future is not None:
            self._future.result()

    def allowed(self) -> torch.Tensor:
        """bool ``[len(requests), vocab_size]``: the masks, once built."""
        self.wait()
        packed = self.bits.numpy().view(np.uint8)
        return torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little")[:, : self.vocab_size]).bool()

    def apply(self, logits: torch.Tensor, fallback: torch.Tensor, requests: Sequence["Request"]) -> None:
        """Set the constrained rows' disallowed logits to -inf, in place.

        logits, fallback: float ``[len(requests), model vocab]``, row i ``requests[i]``'s; every
        constrained one of ``requests`` must be in this batch (rows of the batch that are not in
        ``requests`` are skipped). ``fallback`` holds the rows before biases and min_tokens, used
        for a row those left with no allowed token (min_tokens banning EOS where the grammar can
        only end): the grammar wins.
        """
        self.wait()
        t0 = time.perf_counter()
        row_of = {id(r): i for i, r in enumerate(requests)}
        picked = [(m, row_of[id(r)]) for m, r in enumerate(self.requests) if id(r) in row_of]
        if not picked:
            return
        masks = torch.tensor([m for m, _ in picked], dtype=torch.long)
        rows = torch.tensor([i for _, i in picked], dtype=torch.long)
        bits = self.bits if len(picked) == len(self.requests) else self.bits[masks]
        alive = _mask_rows(logits, bits, rows, self.vocab_size)
        if not bool(alive.all()):
            dead = ~alive
            base = fallback[rows[dead]].contiguous()
            _mask_rows(base, bits[dead].contiguous(), torch.arange(base.shape[0]), self.vocab_size)
            logits[rows[dead]] = base
        self.apply_s = time.perf_counter() - t0

    def refused(self, requests: Sequence["Request"], tokens: Sequence[int]) -> list[int]:
        """The rows of ``requests`` (this step's sampling rows, ``tokens`` the tokens they took
        without a mask) that are checked after the fact (:func:`checked_after`) and whose grammar
        refuses that token; their masks are started (``self.late``, to apply) before this returns."""
        rows = [i for i, r in enumerate(requests) if checked_after(r) and r.matcher.validate_tokens([int(tokens[i])]) != 1]
        if rows:
            self.late = MaskBatch([requests[i] for i in rows], self.vocab_size)
        return rows


def checked_after(req: "Request") -> bool:
    """Whether this constrained request's token is taken without a mask, then checked (greedy, or
    drawn from an untruncated distribution); else its mask is built ahead of sampling."""
    return req.matcher is not None and (req.params.greedy or not req.params.truncates)


def _mask_rows(logits: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """In place: -inf in row ``rows[m]`` of ``logits`` wherever mask ``bits[m]`` disallows the token
    (and past ``vocab_size``, the model's padding rows).  logits float ``[R, V]``; bits int32 ``[M, W]``;
    rows int64 ``[M]``.  Returns bool ``[M]``: whether row ``rows[m]`` kept a finite logit."""
    op = _native_mask_op() if logits.dtype == torch.float32 and logits.stride(1) == 1 else None
    if op is not None:
        return op(logits, bits.contiguous(), rows, vocab_size)
    packed = bits.numpy().view(np.uint8)
    allowed = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab_size]).bool()
    sub = logits[rows]
    width = min(sub.shape[1], allowed.shape[1])
    sub[:, :width].masked_fill_(~allowed[:, :width], -float("inf"))
    sub[:, width:] = -float("inf")
    logits[rows] = sub
    return ~torch.isneginf(sub.amax(dim=-1))


def _native_mask_op() -> Optional[Callable[..., torch.Tensor]]:
    """The extension's ``mask_logits_`` (engine/csrc/sampling.cpp), None without it."""
    from engine import native

    mod = native.module_with("mask_logits_")
    return mod.mask_logits_ if mod is not None else None


class MaskPlanner:
    """Starts each step's masks as soon as the rows' states are known (one per model runner).

    :meth:`commit` advances the matchers by the tokens drawn and at once starts the masks of the
    same rows' next tokens; :meth:`for_step` hands that batch to the step when it covers the
    step's constrained rows, else starts one for them (new rows, or rows that sat a step out).
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._ahead: Optional[MaskBatch] = None

    def for_step(self, requests: Sequence["Request"]) -> Optional[MaskBatch]:
        """The masks of the constrained requests among ``requests`` (this step's sampling requests)
        that are masked ahead (the others are checked after sampling, MaskBatch.refused); None
        when none is constrained."""
        ahead, self._ahead = self._ahead, None
        if not any(r.matcher is not None for r in requests):
            return None
        rows = _masked_ahead(requests)
        if ahead is not None and ahead.covers(rows):
            return ahead
        return MaskBatch(rows, self.vocab_size)

    def commit(self, requests: Sequence["Request"], tokens: Sequence[int]) -> None:
        """Advance each constrained request's matcher by the token it drew, then start the masks
        of their next tokens.  Every mask batch reading these matchers was waited for by the
        sampler already (the one worker runs batches in order)."""
        for req, token in zip(requests, tokens):
            m = req.matcher
            if m is not None and not m.consume_token(token):
                # Only reachable if a row had no allowed token at all; the grammar state is lost.
                logger.warning("request %s: token %d rejected by its grammar: %s", req.request_id, token, m.get_error())
        rows = _masked_ahead(requests)
        self._ahead = MaskBatch(rows, self.vocab_size) if rows else None


def _masked_ahead(requests: Sequence["Request"]) -> list["Request"]:
    """The constrained requests whose masks are built before sampling (not :func:`checked_after`)."""
    return [r for r in requests if r.matcher is not None and not checked_after(r)]
