"""A tokenizer from a GGUF file's ``tokenizer.*`` metadata.

A GGUF file carries no ``tokenizer.json``, only its pieces, token types, merges or scores, so
the ``tokenizers`` backend is rebuilt (engine/tokenizer/backends.py) the way transformers'
GGUF conversion rebuilds it, with the same special and added tokens.
"""

from __future__ import annotations

from typing import Any, Optional

from tokenizers import AddedToken

from engine.tokenizer.backends import byte_level_backend, bytes_to_unicode, sentencepiece_backend

# GGUF token types (llama.cpp's llama_token_type)
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """A GGUF metadata value by key (``gguf.GGUFReader``), or ``default`` when the file lacks it.

    Here rather than in engine/loader/gguf.py, which reads the rest of the file's metadata with
    it, because that module builds the tokenizer and so imports this package.
    """
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_tokenizer_args(reader: Any) -> dict[str, Any]:
    """``Tokenizer``'s constructor arguments from a ``gguf.GGUFReader``'s metadata.

    Raises ValueError for a tokenizer model this code does not know (the loader turns it into
    a ModelLoadError).
    """
    kind = gguf_field(reader, "tokenizer.ggml.model")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    token_types = gguf_field(reader, "tokenizer.ggml.token_type") or []
    merges = gguf_field(reader, "tokenizer.ggml.merges")
    if kind == "gpt2":
        backend = byte_level_backend(tokens, merges or [], gguf_field(reader, "tokenizer.ggml.pre"))
        default_add_bos = False
    elif kind == "llama":
        scores = gguf_field(reader, "tokenizer.ggml.scores")
        backend = sentencepiece_backend(tokens, merges, scores)
        default_add_bos = True  # llama.cpp's default for SentencePiece vocabularies without the flag
    else:
        raise ValueError(
            f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
        )

    # Control tokens (e.g. <|im_start|>) become special added tokens so they are matched whole
    # and skipped on decode; user-defined ones (e.g. <think>) are matched whole but kept.
    byte_level = kind == "gpt2"
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, ttype in zip(tokens, token_types)
        if ttype == _TOKEN_TYPE_CONTROL and (alphabet is None or set(tok) <= alphabet)
    ]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab(with_added_tokens=True)
    user_defined = [
        AddedToken(tok, normalized=False, special=False)
        for tok, ttype in zip(tokens, token_types)
        if ttype == _TOKEN_TYPE_USER_DEFINED and tok in vocab
    ]
    if user_defined:
        backend.add_tokens(user_defined)

    def token_id(key: str) -> Optional[int]:
        value = gguf_field(reader, f"tokenizer.ggml.{key}")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    bos_id = token_id("bos_token_id")
    eos_id = token_id("eos_token_id")
    # Named special tokens are special too (transformers adds them as such), when in the vocab.
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    named = [
        tokens[i]
        for i in (bos_id, eos_id, token_id("unknown_token_id"), token_id("padding_token_id"))
        if i is not None and tokens[i] not in added and tokens[i] in vocab
    ]
    if named:
        backend.add_tokens([AddedToken(t, special=True) for t in dict.fromkeys(named)])

    eos_ids = [i for i in (eos_id, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None]
    add_bos = gguf_field(reader, "tokenizer.ggml.add_bos_token")
    return dict(
        backend=backend,
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        add_bos=default_add_bos if add_bos is None else bool(add_bos),
        chat_template=gguf_field(reader, "tokenizer.chat_template"),
        template_tokens={
            "bos_token": tokens[bos_id] if bos_id is not None else None,
            "eos_token": tokens[eos_id] if eos_id is not None else None,
        },
    )
