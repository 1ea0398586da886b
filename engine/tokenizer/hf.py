"""A tokenizer from a Hugging Face directory: ``tokenizer.json`` loaded as is, plus the facts
around it from ``tokenizer_config.json``, ``config.json``, ``generation_config.json`` and
``chat_template.jinja``."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from tokenizers import Tokenizer as Backend


def hf_tokenizer_args(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``Tokenizer``'s constructor arguments from a directory (chat template, bos/eos, add_bos_token);
    raises ValueError without a ``tokenizer.json`` (only fast tokenizers are supported)."""
    path = os.fspath(path)
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise ValueError(f"no tokenizer.json in {path} (only fast tokenizers are supported)")
    backend = Backend.from_file(tok_file)
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
    return dict(
        backend=backend,
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        add_bos=bool(add_bos),
        chat_template=chat_template,
        template_tokens=template_tokens,
    )


def _token_content(value: Any) -> Optional[str]:
    """tokenizer_config.json spells special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


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
