"""Whether a text is a whole output of a request's constraint: the check behind stop strings.

A stop string is matched in the detokenized text, which need not fall on a token boundary, so the
sequence's own matcher (which has moved past it) cannot say whether the text before it is complete.
This re-reads the candidate text from the constraint's start instead: it happens only when a stop
string appears in a constrained output, a few times per request at most.
"""

from __future__ import annotations

from typing import Callable, Sequence

import llguidance as llg

Encode = Callable[[str], Sequence[int]]


class CompleteOutputCheck:
    """``check(text)``: True when ``text`` is an output the constraint accepts as finished.

    ``start``: a matcher of the constraint that has consumed nothing (kept as is; each check
    works on a copy); ``encode``: text -> token ids of the same vocabulary, without special tokens.
    llguidance matches the tokens' bytes, so any tokenization of the text reads the same.
    """

    def __init__(self, start: llg.LLMatcher, encode: Encode) -> None:
        self._start = start
        self._encode = encode

    def __call__(self, text: str) -> bool:
        m = self._start.deep_copy()
        tokens = list(self._encode(text))
        return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()
