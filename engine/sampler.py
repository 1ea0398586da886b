"""Logits -> next tokens, with everything OpenAI's and vLLM's sampling parameters ask for.

Order, as in vLLM: logit bias and min_tokens masks, then penalties, then (for
sampled rows) temperature, top-k, top-p, min-p and the draw.  Log-probabilities
reported to users are those of the raw model distribution, before any of it.
Seeded requests draw from their own generator, so their tokens do not depend on
what else shares the batch.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from engine.request import Logprob, Request
from engine.structured.masks import MaskBatch


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
    """Repetition penalty over each row's prompt and output tokens (as vLLM and HF: positive
    logits divided by it, negative ones multiplied), then frequency and presence penalties over
    its output tokens.  Every penalised row at once, touching only the tokens it has seen (a pass
    per row over the whole vocabulary cost several times more); ``logits`` must be contiguous."""
    vocab = logits.shape[1]
    flat = logits.view(-1)
    params = [r.params for r in requests]

    def seen(rows: list[int], ids_of: Callable[[Request], list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every (row, token) occurrence as a flat index into logits, and its row."""
        lists = [ids_of(requests[r]) for r in rows]
        # frombuffer over an array: a fraction of torch.tensor(list)'s time for a list of ints
        ids = torch.cat([torch.frombuffer(array.array("q", x), dtype=torch.long) for x in lists])
        row = torch.tensor(rows, dtype=torch.long).repeat_interleave(torch.tensor([len(x) for x in lists]))
        return ids + row * vocab, row

    def per_row(values: list[float], rows: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype)[rows]

    # A token seen several times is gathered and written back several times, with the same value.
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        idx, rows = seen(rep, lambda r: r.all_token_ids)
        penalty = per_row([p.repetition_penalty for p in params], rows)
        vals = flat[idx]
        flat[idx] = torch.where(vals > 0, vals / penalty, vals * penalty)
    freq = [i for i, p in enumerate(params)
            if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and requests[i].output_token_ids]
    if freq:
        idx, rows = seen(freq, lambda r: r.output_token_ids)
        flat.index_add_(0, idx, -per_row([p.frequency_penalty for p in params], rows))  # once per occurrence
        flat[idx] = flat[idx] - per_row([p.presence_penalty for p in params], rows)  # once per token


# With the extension, sampled rows are drawn natively (``sample_rows`` in engine/csrc/sampling.cpp):
# the same temperature, top-k, top-p, min-p and inverse-CDF lookup, a row at a time in one
# buffer, where the torch ops below make several whole-vocabulary temporaries (about 4x the
# time at 32 rows; benchmarks/HISTORY.md).
#
# The torch path (without the extension; also the reference the tests hold the native draw to):
# top-k / top-p rank the best 64 tokens of each row; rows those do not settle (top_k above
# them, or a wider nucleus) take the native cut-off when there is one (a histogram and a
# selection, O(vocab)), else rank the best 1024, then sort the whole vocabulary for what is left
# (the slow case).  What survives is all the softmax, min-p and the draw see.
CANDIDATE_TIERS = (64, 1024)  # the second only without the native cut-off


def _native_op(name: str) -> Optional[Callable[..., torch.Tensor]]:
    """The extension's sampler kernel ``name`` (engine/csrc/sampling.cpp), None without it."""
    from engine import native

    mod = native.module_with(name)
    return getattr(mod, name) if mod is not None else None


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``; natively for float32, one pass a row where torch's took ~2% of a
    32-row decode step."""
    argmax = _native_op("argmax_rows") if logits.dtype == torch.float32 and logits.shape[-1] > 0 else None
    return argmax(logits) if argmax is not None else logits.argmax(dim=-1)


def _distributions(
    logits: torch.Tensor, requests: list[Request]
) -> Iterator[tuple[list[int], Optional[torch.Tensor], torch.Tensor]]:
    """Each sampled row's final distribution, in groups of ``(rows, token ids, probabilities)``.

    Temperature, then top-k and top-p, then min-p.  Rows without top-k/top-p come back over
    the whole vocabulary (token ids ``None``); the others as their surviving candidates (or, cut
    natively, over the whole vocabulary with zeros where the cut removed tokens).
    """
    if any(r.params.temperature != 1.0 for r in requests):
        temps = torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype).unsqueeze(1)
        logits = logits / temps
    num_rows, vocab = logits.shape
    k = torch.tensor([min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in requests])
    p = torch.tensor([r.params.top_p for r in requests], dtype=logits.dtype)
    min_p = torch.tensor([r.params.min_p for r in requests], dtype=logits.dtype)
    filtered = (k < vocab) | (p < 1.0)
    plain = (~filtered).nonzero().flatten()
    if plain.numel():
        rows_logits = logits if plain.numel() == num_rows else logits[plain]
        yield plain.tolist(), None, _min_p(rows_logits.softmax(-1), min_p[plain])
    for rows, ids, probs in _top_k_top_p(logits, k, p, filtered.nonzero().flatten()):
        yield rows.tolist(), ids, _min_p(probs, min_p[rows])


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    if bool((min_p > 0).any()):
        top = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < min_p.unsqueeze(1) * top, 0.0)
    return probs


def _nucleus_mask(sorted_probs: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """True where top-k (rank >= k) or top-p (mass strictly before the token >= p) removes a token.

    ``sorted_probs`` are descending, under the top-k distribution (the k best tokens
    renormalised).
    """
    ranks = torch.arange(sorted_probs.shape[1]).unsqueeze(0)
    mask = ranks >= k.unsqueeze(1)
    probs = sorted_probs.masked_fill(mask, 0.0)
    # top_p = 1 keeps everything: float rounding can carry the mass before a tail token to 1
    mask |= (probs.cumsum(-1) - probs >= p.unsqueeze(1)) & (p < 1.0).unsqueeze(1)
    mask[:, 0] = False  # always keep the best token
    return mask


def _top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, rows: torch.Tensor
) -> Iterator[tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]]:
    """For ``rows``: ``(rows settled, candidate ids or None for the whole vocabulary, their
    probabilities once top-k and then top-p have removed what they remove)``, keeping exactly
    what a full descending sort would keep (the native cut keeps every token tied with the
    last one kept)."""
    num_rows, vocab = logits.shape
    thresholds = _native_op("sampling_thresholds")
    tiers = CANDIDATE_TIERS[:1] if thresholds is not None else CANDIDATE_TIERS
    e: Optional[torch.Tensor] = None  # exp(logit - row max) of ``rows``, once a tier needed it
    for num_cand in [c for c in tiers if c < vocab] + [vocab]:
        if rows.numel() == 0:
            return
        sub = logits if rows.numel() == num_rows else logits[rows]
        ks, ps = k[rows], p[rows]
        if num_cand == vocab and thresholds is not None:  # cut where a full sort would cut
            if e is None:
                e = (sub - sub.amax(dim=-1, keepdim=True)).exp_()
            e.masked_fill_(e < thresholds(e, ks, ps.float()).unsqueeze(1), 0.0)
            yield rows, None, e.div_(e.sum(dim=-1, keepdim=True))
            return
        if num_cand == vocab:
            cand_logits, cand_ids = sub.sort(dim=-1, descending=True)
        else:
            cand_logits, cand_ids = sub.topk(num_cand, dim=-1)
        ranks = torch.arange(num_cand).unsqueeze(0)
        log_norm = cand_logits.masked_fill(ranks >= ks.unsqueeze(1), -float("inf")).logsumexp(-1)
        beyond = ks > num_cand
        if bool(beyond.any()):  # then only the whole row's normaliser is exact (for k == vocab)
            top = cand_logits[:, :1]
            e = (sub - top).exp_()
            log_norm = torch.where(beyond, top.squeeze(1) + e.sum(-1).log(), log_norm)
        cand_probs = (cand_logits - log_norm.unsqueeze(1)).exp()
        kept = cand_logits.masked_fill(_nucleus_mask(cand_probs, ks, ps), -float("inf"))
        settled = ~beyond | ((ks == vocab) & (cand_probs.sum(-1) >= ps))
        if bool(settled.all()):
            yield rows, cand_ids, kept.softmax(-1)
            return
        yield rows[settled], cand_ids[settled], kept[settled].softmax(-1)
        rows = rows[~settled]
        e = e[~settled] if e is not None else None


# The draw looks the target up chunk by chunk: the mass of each DRAW_CHUNK tokens, then the
# cumulative sum inside the chosen chunk only: torch's cumulative sum over the whole vocabulary
# runs one element at a time.
DRAW_CHUNK = 1024


def _lookup(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the first index whose cumulative weight exceeds ``u`` times the row's total,
    and where the target falls inside that entry, as a fraction of its weight.  Zero-weight
    entries are never chosen (the target stays strictly below the total, and a zero adds
    nothing to the sum it would have to exceed)."""
    cdf = weights.cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[1] - 1)
    weight = weights.gather(1, idx)
    frac = (target - (cdf.gather(1, idx) - weight)) / weight
    return idx.squeeze(1), frac.squeeze(1)


def _uniforms(requests: list[Request], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One uniform number in [0, 1) per request; seeded requests take theirs from their own
    generator, so their tokens do not depend on the rest of the batch."""
    u = torch.empty(len(requests), dtype=dtype)
    unseeded = [i for i, r in enumerate(requests) if r.generator is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=dtype)
    for i, r in enumerate(requests):
        if r.generator is not None:
            u[i] = torch.rand(1, dtype=dtype, generator=r.generator)
    return u


def _draw(probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform number per row, looked up in the row's cumulative mass.

    Seeded requests take their number from their own generator, so their tokens do not
    depend on the rest of the batch.  (Exponential-race sampling needs a random number
    per vocabulary entry: ~0.7 ms a row here; this costs ~0.01 ms.)
    """
    u = _uniforms(requests, probs.dtype).unsqueeze(1)
    rows, vocab = probs.shape
    if vocab <= DRAW_CHUNK:
        return _lookup(probs, u)[0]
    if vocab % DRAW_CHUNK:
        probs = torch.nn.functional.pad(probs, (0, DRAW_CHUNK - vocab % DRAW_CHUNK))
    chunks = probs.view(rows, -1, DRAW_CHUNK)
    mass = chunks.sum(-1)
    chunk, frac = _lookup(mass, u)
    inside, _ = _lookup(chunks[torch.arange(rows), chunk], frac.clamp_(0.0, 1.0).unsqueeze(1))
    return chunk * DRAW_CHUNK + inside


def _row_params(requests: list[Request], vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The native draw's per-row temperature, top_k (0: none; clamped to the vocabulary, as
    clients may send any integer), top_p and min_p."""
    ps = [r.params for r in requests]
    return (
        torch.tensor([p.temperature for p in ps], dtype=torch.float32),
        torch.tensor([min(p.top_k, vocab) for p in ps], dtype=torch.long),
        torch.tensor([p.top_p for p in ps], dtype=torch.float32),
        torch.tensor([p.min_p for p in ps], dtype=torch.float32),
    )


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, counts: list[int]) -> list[Optional[Logprob]]:
    """Per row of raw logits: the chosen token's log-probability and the ``count`` most likely
    tokens with theirs (None where count < 0).  Natively (``logprobs_rows``) without a
    log-softmaxed copy of the rows: for 32 rows of 49,152 logits torch's log_softmax and topk took
    ~2.3 ms of a decode step."""
    want = [i for i, c in enumerate(counts) if c >= 0]
    out: list[Optional[Logprob]] = [None] * len(counts)
    if not want:
        return out
    if len(want) < len(counts):
        logits, chosen = logits[want], chosen[want]
    k = max(counts[i] for i in want)
    native = _native_op("logprobs_rows") if logits.dtype == torch.float32 else None
    if native is not None:
        chosen_lp, top_ids, top_vals = native(logits.contiguous(), chosen.contiguous(), k)
    else:
        lps = logits.log_softmax(-1)
        chosen_lp = lps.gather(1, chosen.unsqueeze(1)).squeeze(1)
        top_vals, top_ids = (t[:, :k] for t in lps.sort(dim=-1, descending=True, stable=True))  # ties by index
    lp_list, ids_list, vals_list, chosen_ids = chosen_lp.tolist(), top_ids.tolist(), top_vals.tolist(), chosen.tolist()
    for j, i in enumerate(want):
        out[i] = Logprob(chosen_ids[j], lp_list[j], list(zip(ids_list[j][: counts[i]], vals_list[j][: counts[i]])))
    return out


def plain_greedy(req: Request) -> bool:
    """Whether this request's next token is the argmax of the raw logits, nothing else asked: greedy,
    no logprobs, and nothing in :func:`sample` that changes its row first (bias, min_tokens, penalties,
    a grammar's mask)."""
    p = req.params
    return (
        p.greedy
        and p.logprobs is None
        and not p.logit_bias
        and req.num_output_tokens >= p.min_tokens
        and not p.has_penalties
        and req.matcher is None
    )


def fused_argmax(requests: list[Request]) -> bool:
    """Whether the LM head's fused argmax may give every token of a step whose sampling rows are
    ``requests`` (every one of its logits rows): all of them plain greedy.  Otherwise the step takes
    logits for all rows in one LM-head pass and samples them here; a second pass just for the other
    rows would read the whole head again (a constrained request among plain greedy ones)."""
    return bool(requests) and all(plain_greedy(r) for r in requests)


def _pick(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Each row's token: the argmax for greedy rows, a draw for the others (natively when the
    extension is there, else through :func:`_distributions` and :func:`_draw`, with the same uniform
    numbers either way).  logits float32 [len(requests), vocab]; returns int64 [len(requests)]."""
    greedy = any(r.params.greedy for r in requests)
    tokens = greedy_tokens(logits) if greedy else torch.empty(len(requests), dtype=torch.long)
    sampled_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if sampled_rows:
        sub = [requests[i] for i in sampled_rows]
        sub_logits = logits if len(sampled_rows) == len(requests) else logits[sampled_rows]
        native = _native_op("sample_rows") if sub_logits.dtype == torch.float32 else None
        if native is not None:
            tokens[sampled_rows] = native(sub_logits.contiguous(), *_row_params(sub, sub_logits.shape[1]), _uniforms(sub))[0]
        else:
            for rows, ids, probs in _distributions(sub_logits, sub):
                drawn = _draw(probs, [sub[i] for i in rows])
                if ids is not None:
                    drawn = ids.gather(1, drawn.unsqueeze(1)).squeeze(1)
                tokens[[sampled_rows[i] for i in rows]] = drawn
    return tokens


def sample(logits: torch.Tensor, requests: list[Request], masks: Optional[MaskBatch] = None) -> SamplerOutput:
    """logits: float32 [len(requests), vocab], one row per request that samples this step.

    ``masks``: the constrained rows' grammar masks (engine/structured), applied after biases,
    min_tokens and penalties, so every later step only sees tokens the grammar allows: before
    sampling for rows drawn from a truncated distribution, else only for the rows whose unmasked
    token the grammar refuses, which then pick again (:func:`_pick`) from their masked logits."""
    counts = [r.params.logprobs if r.params.logprobs is not None else -1 for r in requests]
    raw_logits = logits  # what logprobs report: the model's distribution, before biases and penalties

    if any(r.params.logit_bias or r.num_output_tokens < r.params.min_tokens for r in requests):
        logits = logits.clone()
        _apply_bias_and_masks(logits, requests)
    if any(r.params.has_penalties for r in requests):
        logits = logits.clone(memory_format=torch.contiguous_format)
        _apply_penalties(logits, requests)
    def masked(batch: MaskBatch) -> torch.Tensor:
        """``logits`` with ``batch``'s masks applied: a copy while logprobs still need the raw ones."""
        out = logits.clone() if logits is raw_logits and any(c >= 0 for c in counts) else logits
        batch.apply(out, raw_logits, requests)
        return out

    if masks is not None and masks.requests:
        logits = masked(masks)
    tokens = _pick(logits, requests)
    if masks is not None and (refused := masks.refused(requests, tokens.tolist())):
        logits = masked(masks.late)
        tokens[refused] = _pick(logits[refused], [requests[i] for i in refused])

    return SamplerOutput(tokens.tolist(), top_logprobs(raw_logits, tokens, counts))
