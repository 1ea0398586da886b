"""Constraints -> llguidance matchers, compiled once per distinct constraint.

Compiling builds the grammar's lexer against the whole vocabulary (~1.5 ms for a realistic
schema on the bundled 49,152-token tokenizer); each request then starts from a copy of the
cached matcher.  llguidance's parser limits bound what any one grammar may cost (lexer fuel for
building and for each step, grammar size); the service also bounds the wall-clock compile time
and compiles off its event loop (service/structured.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import llguidance as llg
from llguidance.gbnf_to_lark import any_to_lark

from engine.structured.spec import StructuredSpec

# Distinct constraints whose compiled matcher stays cached (a matcher holds its lexer: tens of KiB
# to a few MiB for large schemas).
CACHE_SIZE = 128
# Largest constraint text accepted (a serialised schema, regex or grammar).
MAX_SOURCE_BYTES = 32 * 1024
# JSON is generated compactly: with free whitespace a small model can pad forever (vLLM's
# disable_any_whitespace); keys in the schema's order is what clients expect to read back.
_JSON_OPTIONS = {"whitespace_flexible": False}
# Per-grammar resource bounds (llguidance's defaults, halved for building: ~50k fuel/ms, so a
# pathological regex gives up after ~10 ms of lexer construction instead of ~20).
LIMITS = dict(initial_lexer_fuel=500_000, step_lexer_fuel=200_000, max_grammar_size=200_000, verbose_errors=False)


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled; ``param`` names the request field it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class GrammarCompiler:
    """Builds and caches matchers for one tokenizer.  Thread-safe: the service compiles on worker
    threads while the engine thread takes copies."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_json = tokenizer_json  # called on first use: unconstrained servers never serialize
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll_tokenizer: Optional[llg.LLTokenizer] = None
        self._cache: OrderedDict[tuple[str, str], llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llg.LLTokenizer:
        """llguidance's view of the vocabulary (token bytes and a trie, ~0.2 s to build): built on
        first use, so servers that never see a constrained request never pay for it."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llg.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=self._eos)
            return self._ll_tokenizer

    def compile(self, spec: StructuredSpec) -> llg.LLMatcher:
        """The pristine matcher for ``spec`` (cached); raise StructuredOutputError if it cannot compile."""
        key = spec.cache_key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        grammar = _grammar(spec)
        matcher = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=llg.LLParserLimits(**LIMITS))
        if matcher.is_error():
            raise StructuredOutputError(f"'{spec.param}' cannot be compiled: {_short(matcher.get_error())}", spec.param)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def new_matcher(self, spec: StructuredSpec) -> llg.LLMatcher:
        """A fresh matcher for one sequence (a copy of the cached one)."""
        return self.compile(spec).deep_copy()


def _grammar(spec: StructuredSpec) -> str:
    """The llguidance grammar text for ``spec``."""
    if len(spec.source.encode()) > MAX_SOURCE_BYTES:
        raise StructuredOutputError(
            f"'{spec.param}' is too large: {len(spec.source.encode())} bytes, at most {MAX_SOURCE_BYTES}", spec.param
        )
    try:
        if spec.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if spec.kind == "tool_call":  # built by service/tools.py: calls in the template's format
            return llg.LLMatcher.grammar_from_lark(spec.source)
        if spec.kind == "json":
            return llg.LLMatcher.grammar_from_json_schema(spec.source, defaults=_JSON_OPTIONS)
        if spec.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.source)
        if spec.kind == "choice":
            choices = json.loads(spec.source)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise StructuredOutputError(f"'{spec.param}' must be a non-empty list of non-empty strings", spec.param)
            return llg.grammar_from("choice", spec.source)
        if spec.kind == "grammar":
            # Lark (llguidance's dialect) as is; GBNF (llama.cpp's, rules written "a ::= b") converted to Lark.
            return llg.LLMatcher.grammar_from_lark(any_to_lark(spec.source) if "::=" in spec.source else spec.source)
    except StructuredOutputError:
        raise
    except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError/RuntimeError for bad input
        raise StructuredOutputError(f"'{spec.param}' is not valid: {_short(str(exc))}", spec.param) from None
    raise StructuredOutputError(f"unknown constraint kind {spec.kind!r}", spec.param)


def _short(message: str, limit: int = 500) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."
