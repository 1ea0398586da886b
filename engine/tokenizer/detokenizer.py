"""Generated token ids -> text deltas for streaming, one token at a time."""

from __future__ import annotations

from typing import Sequence

from engine.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas for streaming responses.

    Decoding one token at a time is wrong for byte-level vocabularies (one character can span
    several tokens) and for SentencePiece (a token's leading space depends on what precedes it).
    Like vLLM/TGI we keep two offsets into the id list: text is decoded over a small window
    ``[prefix_offset:]`` and compared with the window's already-emitted part ``[prefix_offset:read_offset]``;
    the difference is emitted only once it no longer ends in U+FFFD (an incomplete UTF-8 sequence).
    """

    _PROMPT_CONTEXT = 5  # prompt tokens kept as left context for the first window

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self._PROMPT_CONTEXT:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.output_text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the newly completed text (possibly empty)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            # Drop ids that can no longer be part of a window, so long generations stay O(1) per token.
            if self._prefix_offset > 0:
                del self._ids[: self._prefix_offset]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
            self.output_text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of generation: emit any held-back text (which may contain U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.output_text += delta
        return delta
