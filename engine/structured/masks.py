"""Each step's token masks for the constrained rows, built while the model's forward runs.

The runner calls :func:`start_masks` with the requests that sample this step before it runs the
model; llguidance computes the constrained rows' masks (a bit per vocabulary token) on a worker
thread, outside the GIL.  The sampler then calls :meth:`MaskBatch.apply`, which waits for them and
sets every disallowed logit to -inf.  Unconstrained rows are never touched, and a batch without
constrained rows costs one list comprehension.  After sampling, :func:`commit_tokens` advances
each constrained row's matcher by the token it drew.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional, Sequence

import llguidance as llg
import numpy as np
import torch

if TYPE_CHECKING:
    from engine.request import Request

logger = logging.getLogger(__name__)

# One worker: the masks of a step are one batched call (llguidance spreads the rows over its own
# threads); the worker exists so that call overlaps the forward pass.
_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="structured-masks")
_executor: Optional[llg.LLExecutor] = None


def _ll_executor() -> llg.LLExecutor:
    global _executor
    if _executor is None:
        _executor = llg.LLExecutor(num_threads=max(1, min(4, (os.cpu_count() or 1) // 2)))
    return _executor


class MaskBatch:
    """The masks of one step's constrained rows.

    ``requests``: the constrained requests, in mask order (the sampler finds each one's logits row
    by identity, so it may sample them alone or among others);
    ``bits``: int32 ``[len(requests), ceil(vocab / 32)]``, bit ``t % 32`` of word ``t // 32`` set where
    token ``t`` is allowed.  ``seconds``: time spent building and applying them (for the
    ``step_structured_mask_seconds`` histogram).
    """

    def __init__(self, requests: list["Request"], vocab_size: int) -> None:
        self.requests = requests
        self.vocab_size = vocab_size
        self.bits = torch.zeros(len(requests), (vocab_size + 31) // 32, dtype=torch.int32)
        self.build_s = 0.0
        self.apply_s = 0.0
        self._future: Future = _worker.submit(self._build, [r.matcher for r in requests])

    def _build(self, matchers: list[llg.LLMatcher]) -> None:
        t0 = time.perf_counter()
        pairs = [(m, i) for i, m in enumerate(matchers)]
        _ll_executor().unsafe_compute_mask_ptr(pairs, self.bits.data_ptr(), self.bits.shape[1] * 4, len(pairs))
        self.build_s = time.perf_counter() - t0

    @property
    def seconds(self) -> float:
        return self.build_s + self.apply_s

    def allowed(self) -> torch.Tensor:
        """bool ``[len(requests), vocab_size]``: the masks, once built."""
        self._future.result()
        packed = self.bits.numpy().view(np.uint8)
        return torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little")[:, : self.vocab_size]).bool()

    def apply(self, logits: torch.Tensor, fallback: torch.Tensor, requests: Sequence["Request"]) -> None:
        """Set the constrained rows' disallowed logits to -inf, in place.

        logits, fallback: float ``[len(requests), model vocab]``, row i ``requests[i]``'s, which
        must include every constrained request; ``fallback`` holds the rows before biases and
        min_tokens, used for a row those left with no allowed token (min_tokens banning EOS where
        the grammar can only end): the grammar wins.
        """
        allowed = self.allowed()
        t0 = time.perf_counter()
        row_of = {id(r): i for i, r in enumerate(requests)}
        rows = torch.tensor([row_of[id(r)] for r in self.requests], dtype=torch.long)
        sub = logits[rows]
        width = min(sub.shape[1], allowed.shape[1])
        sub[:, :width].masked_fill_(~allowed[:, :width], -float("inf"))
        sub[:, width:] = -float("inf")  # the model's padding rows past the tokenizer's vocabulary
        dead = torch.isneginf(sub.amax(dim=-1))
        if bool(dead.any()):
            base = fallback[rows[dead]].clone()
            base[:, :width].masked_fill_(~allowed[dead][:, :width], -float("inf"))
            base[:, width:] = -float("inf")
            sub[dead] = base
        logits[rows] = sub
        self.apply_s = time.perf_counter() - t0


def start_masks(requests: Sequence["Request"], vocab_size: int) -> Optional[MaskBatch]:
    """Begin building the masks of the constrained requests among ``requests`` (this step's
    sampling requests); None when none is constrained."""
    constrained = [r for r in requests if r.matcher is not None]
    return MaskBatch(constrained, vocab_size) if constrained else None


def commit_tokens(requests: Sequence["Request"], tokens: Sequence[int]) -> None:
    """Advance each constrained request's matcher by the token it drew."""
    for req, token in zip(requests, tokens):
        m = req.matcher
        if m is not None and not m.consume_token(token):
            # Only reachable if a row had no allowed token at all; the grammar state is lost.
            logger.warning("request %s: token %d rejected by its grammar: %s", req.request_id, token, m.get_error())
