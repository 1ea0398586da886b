"""Tokenizer: text <-> token ids and chat templates over a ``tokenizers`` backend.

Built directly on the ``tokenizers`` library (transformers is a test-only dependency), from a GGUF
file (engine/tokenizer/gguf.py) or a Hugging Face directory (engine/tokenizer/hf.py).

BOS handling is done here rather than by the backend's post-processor, so that ``add_bos`` is one
explicit flag whatever the source, and ``encode(add_special_tokens=False)`` never adds anything.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import jinja2
from tokenizers import Tokenizer as Backend

from engine.tokenizer.chat_template import compile_template
from engine.tokenizer.gguf import gguf_tokenizer_args
from engine.tokenizer.hf import hf_tokenizer_args


class Tokenizer:
    """A ``tokenizers`` backend plus the few facts a server needs: BOS/EOS ids, add_bos, chat template."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: Optional[int],
        eos_token_ids: Sequence[int],
        add_bos: bool,
        chat_template: Optional[str],
        special_ids: Optional[set[int]] = None,
        template_tokens: Optional[dict[str, Optional[str]]] = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.add_bos = bool(add_bos) and bos_token_id is not None
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        if special_ids is None:
            special_ids = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        self._special_ids = frozenset(special_ids)
        # Strings the chat template sees as bos_token / eos_token / ...
        if template_tokens is None:
            template_tokens = {
                "bos_token": self._piece_or_none(bos_token_id),
                "eos_token": self._piece_or_none(self.eos_token_ids[0] if self.eos_token_ids else None),
            }
        self._template_tokens = template_tokens
        self._piece_cache: dict[int, str] = {}
        self._compiled_template: Optional[jinja2.Template] = None

    def _piece_or_none(self, token_id: Optional[int]) -> Optional[str]:
        return None if token_id is None else self.backend.id_to_token(token_id)

    # -- encoding / decoding ------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS is prepended iff ``add_bos`` and ``add_special_tokens``."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The text one token decodes to (special tokens kept), for logprobs' token strings."""
        piece = self._piece_cache.get(token_id)
        if piece is None:
            piece = self.backend.decode([int(token_id)], skip_special_tokens=False)
            self._piece_cache[token_id] = piece
        return piece

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # -- chat template ------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's Jinja chat template, in a sandbox set up like
        transformers' (same options, globals and filters) so prompts match what the model was tuned on."""
        if not self.chat_template:
            raise ValueError(
                "this model has no chat template; use the completions endpoint with a plain prompt instead"
            )
        if self._compiled_template is None:
            self._compiled_template = compile_template(self.chat_template)
        variables = {**self._template_tokens, **kwargs}
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader: Any) -> "Tokenizer":
        """Build from a ``gguf.GGUFReader``'s ``tokenizer.*`` metadata (ValueError if it has none
        this code knows)."""
        return cls(**gguf_tokenizer_args(reader))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        """Build from a Hugging Face directory (``tokenizer.json`` and the configs around it)."""
        return cls(**hf_tokenizer_args(path))
