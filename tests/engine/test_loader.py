"""Model loading: GGUF metadata/weights against transformers' GGUF loader, dequantization against
gguf.quants, HF directories, and the errors a user can cause."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize

from engine.loader import LoadedModel, ModelLoadError, load_model, resolve_model_path
from engine.loader.gguf import gguf_to_hf_name
from engine.loader.hf import config_from_hf
from tests.tiny_models import (
    TINY_GGUF,
    make_tiny_gguf,
    make_tiny_hf_model,
    smollm2_gguf_path,
    tiny_gguf_reference_weights,
)

QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS"]


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' LlamaTensorProcessor._reverse_permute_weights, written out independently."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


@pytest.fixture(scope="module")
def default_model() -> tuple[LoadedModel, float]:
    t0 = time.perf_counter()
    loaded = load_model("default", torch.float32)
    return loaded, time.perf_counter() - t0


@pytest.fixture(scope="module")
def hf_gguf_state_dict() -> dict[str, torch.Tensor]:
    """transformers' own GGUF load of the default model, the reference for every dense weight.

    Two speed-ups leave transformers' conversion code itself untouched: it opens the file several
    times with gguf.GGUFReader, slow on np.memmap (see engine.loader.gguf_reader._reader_class), so it gets
    the plain-array subclass reading the same bytes; and it rebuilds the same gguf tensor-name map
    once per module (~400 times), so that pure function is memoized.
    """
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    from engine.loader.gguf_reader import _reader_class

    path = smollm2_gguf_path()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", _reader_class())
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_default_model_load_time(default_model, capsys):
    loaded, seconds = default_model
    with capsys.disabled():
        print(f"\n[loader] default model ({Path(loaded.source).name}) loaded in {seconds:.2f} s (float32)")


def test_reader_parses_metadata_like_gguf(tmp_path):
    """The loader's reader builds its array fields itself (10x faster); every field must come out
    as gguf.GGUFReader's: the same parts (dtype, shape, bytes), data indexes, types and contents,
    for the default model's 49k-entry vocabulary and merges and a tiny model's."""
    from engine.loader.gguf_reader import _reader_class

    for path in (smollm2_gguf_path(), make_tiny_gguf(tmp_path, "llama", "Q8_0")):
        ours, theirs = _reader_class()(str(path), "c"), GGUFReader(str(path), "c")
        assert list(ours.fields) == list(theirs.fields)
        for name, a in theirs.fields.items():
            b = ours.fields[name]
            assert (b.offset, b.data, b.types) == (a.offset, a.data, a.types), name
            assert [(p.dtype, p.shape, p.tobytes()) for p in b.parts] == [(p.dtype, p.shape, p.tobytes()) for p in a.parts]
            assert b.contents() == a.contents(), name
        assert ours.data_offset == theirs.data_offset
        assert [(t.name, t.data_offset) for t in ours.tensors] == [(t.name, t.data_offset) for t in theirs.tensors]


def test_resolve_default():
    path = resolve_model_path("default")
    assert path.endswith(".gguf") and Path(path).is_file()


def test_default_config(default_model):
    cfg = default_model[0].config
    assert cfg.architecture == "llama"
    assert cfg.num_hidden_layers == 30
    assert cfg.num_attention_heads == 9
    assert cfg.num_key_value_heads == 3
    assert cfg.head_dim == 64
    assert cfg.hidden_size == 576
    assert cfg.intermediate_size == 1536
    assert cfg.vocab_size == 49152
    assert cfg.rope_theta == 100000.0
    assert cfg.max_position_embeddings == 8192
    assert cfg.tie_word_embeddings is True
    assert cfg.attention_bias is False
    assert cfg.rope_scaling is None
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_default_weights_match_transformers(default_model, hf_gguf_state_dict):
    """Every dense weight equals transformers' GGUF load (this is what proves the Q/K un-permutation)."""
    weights = default_model[0].weights
    expected_names = set(hf_gguf_state_dict) - {"lm_head.weight"}  # tied: transformers shares it
    assert set(weights) == expected_names
    assert "lm_head.weight" not in weights
    for name, w in weights.items():
        ref = hf_gguf_state_dict[name]
        assert w.dtype == torch.float32 and w.shape == ref.shape, name
        assert (w - ref).abs().max().item() <= 1e-6, name


def test_default_raw_blocks_match_dense(default_model):
    """Dequantizing the kept raw rows gives the dense weight, q/k included (rows un-permuted too)."""
    loaded = default_model[0]
    raw = loaded.gguf_tensors
    assert set(raw) == {n for n, w in loaded.weights.items() if w.dim() == 2}
    assert raw["model.embed_tokens.weight"].qtype == "Q8_0"
    for name, gt in raw.items():
        assert gt.data.dtype == torch.uint8 and gt.data.dim() == 2
        assert gt.shape == tuple(loaded.weights[name].shape)
        assert gt.data.shape[0] == gt.shape[0]
        if ".self_attn." in name or name.startswith("model.layers.0."):
            deq = dequantize(gt.data.numpy(), GGMLQuantizationType[gt.qtype])
            assert torch.equal(torch.from_numpy(deq), loaded.weights[name]), name


def test_progress_reports(tmp_path):
    messages: list[str] = []
    load_model(str(make_tiny_gguf(tmp_path, "llama", "Q8_0")), torch.float32, progress=messages.append)
    n = len(tiny_gguf_reference_weights("llama"))
    assert messages[-1] == f"loading weights {n}/{n}"
    hf_messages: list[str] = []
    load_model(str(make_tiny_hf_model(tmp_path, "qwen2")), torch.float32, progress=hf_messages.append)
    assert hf_messages and hf_messages[-1].startswith("loading weights ")


@pytest.mark.parametrize("qtype", QTYPES)
def test_quant_types_dequantize_like_gguf(tmp_path, qtype):
    path = make_tiny_gguf(tmp_path, "llama", qtype)
    loaded = load_model(str(path), torch.float32)
    reader = GGUFReader(str(path), "c")  # copy-on-write: writable arrays for torch.from_numpy
    c = TINY_GGUF
    by_hf = {gguf_to_hf_name(t.name): t for t in reader.tensors}
    assert set(loaded.weights) == set(by_hf)
    for name, w in loaded.weights.items():
        t = by_hf[name]
        ref = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
        if ".q_proj." in name:
            ref = reverse_permute(ref, c["heads"])
        elif ".k_proj." in name:
            ref = reverse_permute(ref, c["kv_heads"])
        assert torch.equal(w, torch.from_numpy(np.ascontiguousarray(ref))), name
        if w.dim() == 2:
            gt = loaded.gguf_tensors[name]
            assert gt.qtype == qtype
            raw_deq = dequantize(gt.data.numpy(), GGMLQuantizationType[qtype])
            assert torch.equal(torch.from_numpy(raw_deq), w), name
    if qtype == "F32":
        # Unquantized: the loader must give back exactly the HF-layout weights the file was made from.
        for name, ref in tiny_gguf_reference_weights("llama").items():
            assert torch.equal(loaded.weights[name], ref), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_matches_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    path = make_tiny_gguf(tmp_path, arch, "Q8_0")
    loaded = load_model(str(path), torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    ref = model.state_dict()
    cfg = loaded.config
    assert cfg.architecture == arch
    assert cfg.attention_bias is (arch == "qwen2")
    assert cfg.tie_word_embeddings is (arch == "llama")
    assert cfg.head_dim == TINY_GGUF["hidden"] // TINY_GGUF["heads"]
    assert cfg.vocab_size == model.config.vocab_size
    for name, w in loaded.weights.items():
        assert w.shape == ref[name].shape and (w - ref[name]).abs().max().item() <= 1e-6, name
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in loaded.weights
        assert "lm_head.weight" in loaded.weights and "lm_head.weight" in loaded.gguf_tensors


def test_bfloat16_is_cast_float32(tmp_path):
    path = str(make_tiny_gguf(tmp_path, "qwen2", "Q4_1"))
    f32 = load_model(path, torch.float32).weights
    bf16 = load_model(path, torch.bfloat16).weights
    for name, w in bf16.items():
        assert w.dtype == torch.bfloat16
        assert torch.equal(w, f32[name].to(torch.bfloat16)), name


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    """Llama 3.x GGUFs carry llama3 RoPE scaling as a rope_freqs tensor; it must end up in the config."""
    factor, low, high, orig, theta = 8.0, 1.0, 4.0, 8192, 500000.0
    head_dim = TINY_GGUF["hidden"] // TINY_GGUF["heads"]
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factors = []
    for f in freqs:  # llama.cpp convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            factors.append(1.0)
        elif wavelen > orig / low:
            factors.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    path = make_tiny_gguf(tmp_path, "llama", "Q8_0", rope_freqs=np.array(factors, dtype=np.float32))
    cfg = load_model(str(path), torch.float32).config
    assert cfg.rope_theta == theta
    assert cfg.rope_scaling == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }


# ---- Hugging Face directories -------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_dir_loads(tmp_path, arch):
    from safetensors.torch import load_file

    path = make_tiny_hf_model(tmp_path, arch)
    loaded = load_model(str(path), torch.float32)
    cfg = loaded.config
    assert cfg.architecture == arch
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert cfg.head_dim == 16 and cfg.vocab_size == 49152 and cfg.intermediate_size == 128
    assert cfg.rope_theta == (10000.0 if arch == "llama" else 1000000.0)
    assert cfg.attention_bias is (arch == "qwen2")
    assert cfg.tie_word_embeddings is (arch == "qwen2")
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert loaded.gguf_tensors == {}
    saved = load_file(str(path / "model.safetensors"))
    expected = {k for k in saved if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert set(loaded.weights) == expected
    for name, w in loaded.weights.items():
        assert torch.equal(w, saved[name]), name
    # The SmolLM2 tokenizer saved alongside works like the GGUF one.
    ids = loaded.tokenizer.encode("Hello, world! 😀")
    assert loaded.tokenizer.decode(ids) == "Hello, world! 😀"
    assert loaded.tokenizer.chat_template and "<|im_start|>" in loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}]
    )
    bf16 = load_model(str(path), torch.bfloat16)
    assert all(w.dtype == torch.bfloat16 for w in bf16.weights.values())


def _base_hf_config(**overrides):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
    }
    cfg.update(overrides)
    return cfg


def test_hf_config_variants():
    # transformers 4 spelling, llama3 scaling, no head_dim
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    cfg = config_from_hf(_base_hf_config(rope_theta=500000.0, rope_scaling=rope, tie_word_embeddings=True))
    assert cfg.head_dim == 16 and cfg.rope_theta == 500000.0 and cfg.rope_scaling == rope
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    # transformers 5 spelling
    cfg = config_from_hf(_base_hf_config(head_dim=32, rope_parameters={"rope_theta": 1e6, **rope}))
    assert cfg.head_dim == 32 and cfg.rope_theta == 1e6 and cfg.rope_scaling == rope
    # legacy "type" key, default rope -> None
    cfg = config_from_hf(_base_hf_config(rope_scaling={"type": "linear", "factor": 2.0}))
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0} and cfg.rope_theta == 10000.0
    assert config_from_hf(_base_hf_config(rope_parameters={"rope_theta": 1.0, "rope_type": "default"})).rope_scaling is None
    assert config_from_hf(_base_hf_config(architectures=["Qwen2ForCausalLM"])).attention_bias is True
    with pytest.raises(ModelLoadError, match="rope scaling type 'yarn'"):
        config_from_hf(_base_hf_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ModelLoadError, match="missing 'hidden_size'"):
        config_from_hf({"architectures": ["LlamaForCausalLM"]})


# ---- errors -------------------------------------------------------------------------------------


def test_missing_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("/nonexistent/model.gguf", torch.float32)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is not a model\n")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(bad), torch.float32)


def test_truncated_gguf(tmp_path):
    good = make_tiny_gguf(tmp_path, "llama", "Q8_0").read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(good[:1000])
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        load_model(str(bad), torch.float32)


def test_gguf_truncated_inside_its_vocabulary(tmp_path):
    """A file cut inside the tokenizer's string array fails as an invalid GGUF file, not with a
    string silently shortened to what is left of the file."""
    good = make_tiny_gguf(tmp_path, "llama", "Q8_0")
    reader = GGUFReader(str(good))
    field = reader.fields["tokenizer.ggml.tokens"]
    cut = field.parts[field.data[-1]].ctypes.data - reader.data.ctypes.data  # the last token's first byte
    assert 0 < cut < reader.data_offset
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[:cut])
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        load_model(str(bad), torch.float32)


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported model architecture 'gpt2'"):
        load_model(str(path), torch.float32)


def test_unsupported_quant_type(tmp_path):
    path = make_tiny_gguf(tmp_path, "llama", "IQ2_XXS")
    with pytest.raises(ModelLoadError, match="unsupported quantization type IQ2_XXS"):
        load_model(str(path), torch.float32)


def test_unsupported_hf_architecture(tmp_path):
    path = make_tiny_hf_model(tmp_path, "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported model architecture MistralForCausalLM"):
        load_model(str(path), torch.float32)


def test_hf_dir_without_safetensors(tmp_path):
    path = make_tiny_hf_model(tmp_path, "llama")
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(str(path), torch.float32)


def test_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), torch.float32)


def test_directory_with_one_gguf(tmp_path):
    make_tiny_gguf(tmp_path, "llama", "Q8_0")
    assert load_model(str(tmp_path), torch.float32).config.architecture == "llama"


def test_reader_takes_a_string_array_that_is_not_utf8_as_gguf_does(tmp_path):
    """A metadata string that is not UTF-8 fails only where it is read, as with gguf.GGUFReader:
    opening the file still works, the array's contents() raises, every other field reads the same."""
    from engine.loader.gguf_reader import _reader_class

    good = make_tiny_gguf(tmp_path, "llama", "Q8_0")
    reader = GGUFReader(str(good))
    field = reader.fields["tokenizer.ggml.tokens"]
    at = field.parts[field.data[-1]].ctypes.data - reader.data.ctypes.data  # the last token's first byte
    data = bytearray(good.read_bytes())
    data[at] = 0xFF  # never valid in UTF-8
    bad = tmp_path / "latin1.gguf"
    bad.write_bytes(bytes(data))
    ours, theirs = _reader_class()(str(bad), "c"), GGUFReader(str(bad), "c")
    for r in (ours, theirs):
        with pytest.raises(UnicodeDecodeError):
            r.fields["tokenizer.ggml.tokens"].contents()
    assert {k: f.contents() for k, f in ours.fields.items() if k != "tokenizer.ggml.tokens"} == {
        k: f.contents() for k, f in theirs.fields.items() if k != "tokenizer.ggml.tokens"
    }
