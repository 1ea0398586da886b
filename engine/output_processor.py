"""Tokens -> text for each request: incremental detokenization and stop strings.

Runs inside the engine step (its time is the step's "detokenize" phase) so that a
stop string finishes the request, and frees its KV blocks, in the same step.
While streaming, text that could still grow into a stop string is held back.
"""

from __future__ import annotations

from typing import Optional

from engine.request import Request
from engine.structured.accept import CompleteOutputCheck
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestTextState:
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
