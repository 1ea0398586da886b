"""Tokenizer parity with transformers (same GGUF file), chat templates, and streaming detokenization."""

from __future__ import annotations

import jinja2
import pytest

from engine.loader.gguf_reader import open_reader
from engine.tokenizer import GGUF_PRE_TOKENIZER_SPLITS, IncrementalDetokenizer, Tokenizer
from tests.tiny_models import make_tiny_gguf, make_tiny_spm_gguf, smollm2_gguf_path

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. 1234567890 3.14159",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "    indented\n\n\n\ttabs\t\tand   spaces   \r\n",
    "emoji: 😀🎉👍🏽👨‍👩‍👧‍👦 flags 🇫🇷",
    "日本語のテキストと中文文本，还有한국어",
    "Ünïcödé àccents ñ ß ø",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after eos",
    "mixed<|im_end|>special<repo_name>tokens",
    "don't won't I'm they're WE'VE",
    "",
    " leading space",
    "trailing space ",
    "math: ∑ x² ≤ ∞, π≈3.14",
    "URL https://example.com/a?b=c&d=e#f",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Tell me a joke 😀"},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why?"},
    ],
]

STREAM_TEXTS = [
    "emoji 😀🎉👍🏽👨‍👩‍👧‍👦 done",
    "日本語のテキストと中文文本，还有한국어",
    "mixed: café ☕ 東京 🗼 and code `x = 1`",
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_gguf(open_reader(str(smollm2_gguf_path())))


@pytest.fixture(scope="module")
def theirs():
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_pre_tokenizer_table_matches_transformers():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS as reference

    assert GGUF_PRE_TOKENIZER_SPLITS == reference


def test_metadata(ours):
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1
    assert ours.eos_token_ids == (2,)
    assert ours.add_bos is False
    assert ours.chat_template and "<|im_start|>" in ours.chat_template


@pytest.mark.parametrize("text", CORPUS)
def test_encode_decode_match_transformers(ours, theirs, text):
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)


def test_special_tokens(ours, theirs):
    assert ours.encode("<|im_start|>") == [1]
    assert ours.encode("<|im_end|>") == [2]
    for i in range(17):  # SmolLM2's control tokens
        assert ours.is_special(i)
    hello = ours.encode("hello")
    assert len(hello) == 1 and not ours.is_special(hello[0])
    assert set(theirs.all_special_ids) <= {i for i in range(ours.vocab_size) if ours.is_special(i)}
    assert ours.decode(ours.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_id_to_piece(ours, theirs):
    ids = ours.encode("Hello world 😀 日本 <|im_end|>")
    for i in ids:
        assert ours.id_to_piece(i) == theirs.decode([i], skip_special_tokens=False)
    assert ours.id_to_piece(2) == "<|im_end|>"
    assert ours.id_to_piece(ours.encode(" world")[0]) == " world"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(ours, theirs, conversation, add_generation_prompt):
    expected = theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_errors(ours):
    no_template = Tokenizer(ours.backend, bos_token_id=1, eos_token_ids=[2], add_bos=False, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "hi"}])
    raising = Tokenizer(
        ours.backend, bos_token_id=1, eos_token_ids=[2], add_bos=False,
        chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok",
    )
    assert raising.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(jinja2.TemplateError, match="first message must be user"):
        raising.apply_chat_template([{"role": "assistant", "content": "x"}])
    sandboxed = Tokenizer(
        ours.backend, bos_token_id=1, eos_token_ids=[2], add_bos=False,
        chat_template="{{ messages.__class__.__mro__ }}",
    )
    with pytest.raises(jinja2.exceptions.SecurityError):
        sandboxed.apply_chat_template([])


def test_chat_template_variables(ours):
    tok = Tokenizer(
        ours.backend, bos_token_id=1, eos_token_ids=[2], add_bos=False,
        chat_template="{{ bos_token }}|{{ eos_token }}|{{ messages | tojson }}|{{ add_generation_prompt }}",
    )
    assert tok.apply_chat_template([{"role": "user", "content": "é<"}]) == (
        '<|im_start|>|<|im_end|>|[{"role": "user", "content": "é<"}]|True'
    )


def test_add_bos(ours):
    tok = Tokenizer(ours.backend, bos_token_id=1, eos_token_ids=[2], add_bos=True, chat_template=None)
    assert tok.encode("hello") == [1, *ours.encode("hello")]
    assert tok.encode("hello", add_special_tokens=False) == ours.encode("hello")


# ---- incremental detokenization -----------------------------------------------------------------


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool = True) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    return [detok.add(i) for i in ids], detok


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_detokenizer_matches_full_decode(ours, text):
    prompt = ours.encode("<|im_start|>assistant\n")
    ids = ours.encode(text)
    deltas, detok = _stream(ours, prompt, ids)
    assert "".join(deltas) == detok.output_text == ours.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    # multi-token characters were held back at least once rather than emitted broken
    assert any(d == "" for d in deltas)


def test_incremental_detokenizer_without_prompt_and_specials(ours):
    ids = ours.encode("hi 😀<|im_end|>")
    deltas, detok = _stream(ours, [], ids)
    assert detok.output_text == "hi 😀"
    deltas, detok = _stream(ours, [], ids, skip=False)
    assert detok.output_text == "hi 😀<|im_end|>"


def test_incremental_detokenizer_flush_partial_character(ours):
    emoji_ids = ours.encode("😀")
    assert len(emoji_ids) > 1
    detok = IncrementalDetokenizer(ours, ours.encode("x"))
    assert detok.add(emoji_ids[0]) == ""
    assert "\ufffd" in detok.flush()


def test_incremental_detokenizer_sentencepiece_spaces(tmp_path):
    """SentencePiece decoders drop a leading space at the start of a decode; streamed text must keep
    the spaces between words (that is what the prompt context in the window is for)."""
    tok = Tokenizer.from_gguf(open_reader(str(make_tiny_spm_gguf(tmp_path))))
    prompt = tok.encode("the")
    ids = tok.encode(" hello world, héllo 日本", add_special_tokens=False)
    deltas, detok = _stream(tok, prompt, ids)
    full = tok.decode(prompt + ids)
    assert detok.output_text == full[len(tok.decode(prompt)):] == " hello world, héllo 日本"
    assert all("\ufffd" not in d for d in deltas)


# ---- other tokenizer kinds ----------------------------------------------------------------------


SMALL_CORPUS = ["hello world", " hello  the world!", "the hello, wor ld\nhé 日本 😀", "<s>hello</s>", "", "  ", "123 4567"]


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = make_tiny_spm_gguf(tmp_path)
    ours = Tokenizer.from_gguf(open_reader(str(path)))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ours.add_bos and ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
    for text in SMALL_CORPUS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ids[0] == 1
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text


def test_qwen2_pre_tokenizer_gguf_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = make_tiny_gguf(tmp_path, "qwen2", "Q8_0")
    ours = Tokenizer.from_gguf(open_reader(str(path)))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in CORPUS + SMALL_CORPUS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text


def test_hf_dir_tokenizer_matches_gguf(tmp_path, ours, theirs):
    """The tokenizer files transformers saves (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    theirs.save_pretrained(tmp_path)
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert (hf.bos_token_id, hf.eos_token_ids, hf.add_bos, hf.vocab_size) == (1, (2,), False, 49152)
    for text in CORPUS:
        assert hf.encode(text) == ours.encode(text), text
    for conversation in CONVERSATIONS:
        assert hf.apply_chat_template(conversation) == ours.apply_chat_template(conversation)
