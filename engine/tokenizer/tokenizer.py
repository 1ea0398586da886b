"""Tokenizer: text <-> token ids, chat templates and streaming detokenization.

Built directly on the ``tokenizers`` library (transformers is a test-only dependency). A GGUF file
carries no ``tokenizer.json``, only its pieces as metadata, so :meth:`Tokenizer.from_gguf` rebuilds
the same backend that transformers' GGUF conversion builds (tests check the ids match); a Hugging
Face directory carries ``tokenizer.json`` and is loaded as is.

BOS handling is done here rather than by the backend's post-processor, so that ``add_bos`` is one
explicit flag whatever the source, and ``encode(add_special_tokens=False)`` never adds anything.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Optional, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

# GGUF token types (llama.cpp's llama_token_type)
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split regexes, keyed by `tokenizer.ggml.pre`, the same table transformers' GGUF
# conversion uses. A value missing here (e.g. "smollm", "gpt2", "default") keeps the plain GPT-2
# byte-level regex, again as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet byte-level BPE vocabularies are spelled in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a piece into two known pieces,
    best score first (transformers' ``generate_merges``, so the resulting BPE matches its conversion)."""
    merges = []
    for piece, score in scores.items():
        local = []
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """A GGUF metadata value by key (``gguf.GGUFReader``), or ``default`` when the file lacks it.

    Here rather than in engine/loader/gguf.py, which reads the rest of the file's metadata with
    it, because that module builds the tokenizer and so imports this one.
    """
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _token_content(value: Any) -> Optional[str]:
    """tokenizer_config.json spells special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A ``tokenizers`` backend plus the few facts a server needs: BOS/EOS ids, add_bos, chat template."""

    def __init__(
        self,
        backend: _Backend,
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
            self._compiled_template = _compile_template(self.chat_template)
        variables = {**self._template_tokens, **kwargs}
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader: Any) -> "Tokenizer":
        """Build from a ``gguf.GGUFReader``'s ``tokenizer.*`` metadata.

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
            backend = _byte_level_backend(tokens, merges or [], gguf_field(reader, "tokenizer.ggml.pre"))
            default_add_bos = False
        elif kind == "llama":
            scores = gguf_field(reader, "tokenizer.ggml.scores")
            backend = _sentencepiece_backend(tokens, merges, scores)
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
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            add_bos=default_add_bos if add_bos is None else bool(add_bos),
            chat_template=gguf_field(reader, "tokenizer.chat_template"),
            template_tokens={
                "bos_token": tokens[bos_id] if bos_id is not None else None,
                "eos_token": tokens[eos_id] if eos_id is not None else None,
            },
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        """Build from a Hugging Face directory: ``tokenizer.json`` plus ``tokenizer_config.json``
        (chat template, bos/eos, add_bos_token), ``chat_template.jinja`` and ``generation_config.json``."""
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ValueError(f"no tokenizer.json in {path} (only fast tokenizers are supported)")
        backend = _Backend.from_file(tok_file)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        model_cfg = _read_json(os.path.join(path, "config.json"))
        gen_cfg = _read_json(os.path.join(path, "generation_config.json"))

        vocab = backend.get_vocab(with_added_tokens=True)
        bos_tok = _token_content(cfg.get("bos_token"))
        eos_tok = _token_content(cfg.get("eos_token"))
        bos_id = vocab.get(bos_tok) if bos_tok else None
        if bos_id is None:
            bos_id = _first_id(model_cfg.get("bos_token_id"))
        eos_ids: list[int] = []
        for source in (gen_cfg.get("eos_token_id"), model_cfg.get("eos_token_id")):
            eos_ids.extend(_id_list(source))
        if eos_tok and eos_tok in vocab:
            eos_ids.append(vocab[eos_tok])

        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            # No explicit flag: the tokenizer.json post-processor decides, as in transformers.
            probe_with = backend.encode("a", add_special_tokens=True).ids
            probe_without = backend.encode("a", add_special_tokens=False).ids
            add_bos = bos_id is not None and probe_with[:1] == [bos_id] and probe_without[:1] != [bos_id]

        chat_template = cfg.get("chat_template")
        if isinstance(chat_template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
            chat_template = named.get("default") or next(iter(named.values()), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if chat_template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                chat_template = f.read()

        template_tokens = {
            key: _token_content(cfg.get(key)) for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            add_bos=bool(add_bos),
            chat_template=chat_template,
            template_tokens=template_tokens,
        )


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _first_id(value: Any) -> Optional[int]:
    ids = _id_list(value)
    return ids[0] if ids else None


def _byte_level_backend(tokens: list[str], merges: list[str], pre: Optional[str]) -> _Backend:
    """GPT-2 style byte-level BPE, as transformers' ``byte_level_tokenizer`` + ``set_split_regex``."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    merge_pairs = [tuple(m.split(" ")) for m in merges]
    backend = _Backend(
        models.BPE(
            vocab=vocab,
            merges=merge_pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = GGUF_PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(tokens: list[str], merges: Optional[list[str]], scores: Optional[list[float]]) -> _Backend:
    """SentencePiece BPE with byte fallback, as transformers' ``LlamaTokenizer`` (non-legacy)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if merges:
        merge_pairs = [tuple(m.split(" ")) for m in merges]
    else:
        if scores is None:
            raise ValueError("SentencePiece GGUF tokenizer has neither merges nor scores")
        merge_pairs = _generate_merges(vocab, dict(zip(tokens, scores)))
    backend = _Backend(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    )
    return backend


def _compile_template(source: str) -> jinja2.Template:
    """A sandboxed Jinja environment configured like transformers' chat-template renderer."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


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
