"""Text <-> token ids: loading (GGUF, Hugging Face), chat templates, incremental detokenization.

``tokenizer.py`` the Tokenizer; ``gguf.py`` / ``hf.py`` build one from a file's metadata or a
directory; ``backends.py`` the rebuilt ``tokenizers`` backends (pre-tokenizer regexes);
``chat_template.py`` the Jinja sandbox; ``detokenizer.py`` streaming detokenization.
"""

from engine.tokenizer.backends import GGUF_PRE_TOKENIZER_SPLITS, bytes_to_unicode
from engine.tokenizer.detokenizer import IncrementalDetokenizer
from engine.tokenizer.gguf import gguf_field
from engine.tokenizer.tokenizer import Tokenizer

__all__ = ["GGUF_PRE_TOKENIZER_SPLITS", "IncrementalDetokenizer", "Tokenizer", "bytes_to_unicode", "gguf_field"]
