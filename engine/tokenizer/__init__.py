"""Text <-> token ids: loading (GGUF, Hugging Face), chat templates, incremental detokenization."""

from engine.tokenizer.tokenizer import (
    GGUF_PRE_TOKENIZER_SPLITS,
    IncrementalDetokenizer,
    Tokenizer,
    bytes_to_unicode,
    gguf_field,
)

__all__ = ["GGUF_PRE_TOKENIZER_SPLITS", "IncrementalDetokenizer", "Tokenizer", "bytes_to_unicode", "gguf_field"]
