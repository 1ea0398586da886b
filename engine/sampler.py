"""Logits -> next tokens, with everything OpenAI's and vLLM's sampling parameters ask for.

Order, as in vLLM: logit bias and min_tokens masks, then penalties, then (for
sampled rows) temperature, top-k, top-p, min-p and the draw.  Log-probabilities
reported to users are those of the raw model distribution, before any of it.
Seeded requests draw from their own generator, so their tokens do not depend on
what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.request import Logprob, Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Optional[Logprob]]


def _apply_bias_and_masks(logits: torch.Tensor, requests: list[Request]) -> None:
    for row, req in enumerate(requests):
        p = req.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long)
            vals = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
            logits[row].index_add_(0, ids, vals)
        if req.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
            if banned:
                logits[row, banned] = -float("inf")


def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    rows = [i for i, r in enumerate(requests) if r.params.has_penalties]
    if not rows:
        return
    vocab = logits.shape[1]
    for row in rows:
        req = requests[row]
        p = req.params
        out_ids = torch.tensor(req.output_token_ids, dtype=torch.long)
        counts = torch.zeros(vocab, dtype=logits.dtype).index_add_(
            0, out_ids, torch.ones_like(out_ids, dtype=logits.dtype)
        )
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[req.all_token_ids] = True  # prompt and output, as vLLM and HF do
            lr = logits[row]
            penalized = torch.where(lr > 0, lr / p.repetition_penalty, lr * p.repetition_penalty)
            logits[row] = torch.where(seen, penalized, lr)
        if p.frequency_penalty != 0.0:
            logits[row] -= p.frequency_penalty * counts
        if p.presence_penalty != 0.0:
            logits[row] -= p.presence_penalty * (counts > 0).to(logits.dtype)


def _filter(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p for the rows being sampled; returns probabilities."""
    temps = torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype).unsqueeze(1)
    logits = logits / temps
    top_k = [r.params.top_k for r in requests]
    top_p = [r.params.top_p for r in requests]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k])  # clamped before: 10**30 overflows int64
        ranks = torch.arange(vocab).unsqueeze(0)
        mask = ranks >= k.unsqueeze(1)
        probs = sorted_logits.masked_fill(mask, -float("inf")).softmax(-1)
        cum = probs.cumsum(-1) - probs  # mass strictly before each token
        mask |= cum >= torch.tensor(top_p, dtype=logits.dtype).unsqueeze(1)
        mask[:, 0] = False  # always keep the best token
        sorted_logits = sorted_logits.masked_fill(mask, -float("inf"))
        logits = torch.empty_like(logits).scatter_(1, idx, sorted_logits)
    probs = logits.softmax(-1)
    min_p = torch.tensor([r.params.min_p for r in requests], dtype=probs.dtype).unsqueeze(1)
    if bool((min_p > 0).any()):
        top = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < min_p * top, 0.0)
    return probs


def _draw(probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Gumbel-style race: argmax(p / E) with E ~ Exp(1) equals sampling from p."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(requests) if r.generator is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], dtype=probs.dtype).exponential_()
    for i, r in enumerate(requests):
        if r.generator is not None:
            noise[i].exponential_(generator=r.generator)
    return (probs / noise).argmax(dim=-1)


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, counts: list[int]) -> list[Optional[Logprob]]:
    """Per row: the chosen token's log-probability and the ``count`` best alternatives (None where count < 0)."""
    k = max(counts)
    top_vals, top_ids = (logprobs.topk(k, dim=-1) if k > 0 else (None, None))
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    chosen_ids = chosen.tolist()
    out: list[Optional[Logprob]] = []
    for row, count in enumerate(counts):
        if count < 0:
            out.append(None)
            continue
        top = []
        if count > 0:
            top = list(zip(top_ids[row, :count].tolist(), top_vals[row, :count].tolist()))
        out.append(Logprob(chosen_ids[row], chosen_lp[row], top))
    return out


def sample(logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
    """logits: float32 [len(requests), vocab], one row per request that samples this step."""
    counts = [r.params.logprobs if r.params.logprobs is not None else -1 for r in requests]
    raw_logprobs = logits.log_softmax(-1) if any(c >= 0 for c in counts) else None

    if any(r.params.logit_bias or r.num_output_tokens < r.params.min_tokens for r in requests):
        logits = logits.clone()
        _apply_bias_and_masks(logits, requests)
    if any(r.params.has_penalties for r in requests):
        logits = logits.clone()
        _apply_penalties(logits, requests)

    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if sampled_rows:
        sub = [requests[i] for i in sampled_rows]
        probs = _filter(logits[sampled_rows], sub)
        tokens[sampled_rows] = _draw(probs, sub)

    logprobs: list[Optional[Logprob]] = [None] * len(requests)
    if raw_logprobs is not None:
        logprobs = top_logprobs(raw_logprobs, tokens, counts)
    return SamplerOutput(tokens.tolist(), logprobs)
